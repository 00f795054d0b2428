"""The Hugging Face ``Trainer`` front-end: :class:`SAMTrainer` and :class:`SAMTrainerMixin`
(``pip install "lightning-slsam[hf]"``), and the forgetting monitor's callback."""

from lightning_slsam.hf.forgetting import ForgettingCallback
from lightning_slsam.hf.trainer import STATE_FILE, SAMTrainer, SAMTrainerMixin

__all__ = ["STATE_FILE", "ForgettingCallback", "SAMTrainer", "SAMTrainerMixin"]
