"""The Hugging Face ``Trainer`` front-end: :class:`SAMTrainer` and :class:`SAMTrainerMixin`
(``pip install "lightning-slsam[hf]"``)."""

from lightning_slsam.hf.trainer import STATE_FILE, SAMTrainer, SAMTrainerMixin

__all__ = ["STATE_FILE", "SAMTrainer", "SAMTrainerMixin"]
