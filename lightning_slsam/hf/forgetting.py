"""The forgetting monitor for the Hugging Face Trainer: :class:`ForgettingCallback`."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from torch import Tensor
from transformers import TrainerCallback

from lightning_slsam.methods.options import check_int
from lightning_slsam.monitor.forgetting import ForgettingProbe, Forward

__all__ = ["ForgettingCallback"]


class ForgettingCallback(TrainerCallback):
    """Logs how much a language model forgets while a ``transformers.Trainer`` fine-tunes
    it, through ``trainer.log``: ``forgetting/loss``, ``forgetting/accuracy`` and
    ``forgetting/kl`` at the start, every ``every_n_steps`` optimizer steps and at the end,
    then ``forgetting/seconds`` and ``forgetting/fraction`` (docs/forgetting.md).

    Args:
        trainer: the Trainer it reports through.
        reference: batches of reference text (as
            :class:`~lightning_slsam.monitor.forgetting.ForgettingProbe` takes them).
        every_n_steps: measure after every this many optimizer steps (>= 1). Default 50.
        top_k: next tokens kept per reference position at the start. Default 64.
        forward: ``forward(model, batch) -> logits``; default ``model(input_ids=...,
            attention_mask=...)``.

    Example::

        trainer = SAMTrainer(model=model, args=args, train_dataset=data, sam="slsam")
        trainer.add_callback(ForgettingCallback(trainer, reference, every_n_steps=50))
    """

    def __init__(self, trainer: Any, reference: list[Tensor] | list[Mapping[str, Tensor]],
                 every_n_steps: int = 50, top_k: int = 64,
                 forward: Forward | None = None) -> None:  # fmt: skip
        check_int("every_n_steps", every_n_steps, 1)
        self.trainer = trainer
        self.probe = ForgettingProbe(trainer.model, reference, top_k=top_k, forward=forward)
        self.every_n_steps = every_n_steps
        #: ``(global_step, metrics)`` of every measurement.
        self.history: list[tuple[int, dict[str, float]]] = []
        #: The monitor's cost at the end: ``seconds`` and ``fraction`` of the training time.
        self.cost: dict[str, float] = {}
        self._began = 0.0
        self._last = -1

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._began = time.perf_counter()
        if not self.probe.started:
            self.probe.start()
            self._record(state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.every_n_steps == 0 and state.global_step != self._last:
            self._record(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step != self._last:
            self._record(state.global_step)
        total = max(time.perf_counter() - self._began, 1e-9)
        self.cost = {"seconds": self.probe.seconds, "fraction": self.probe.seconds / total}
        self.trainer.log({f"forgetting/{k}": v for k, v in self.cost.items()})

    def _record(self, step: int) -> None:
        metrics = self.probe.measure()
        self._last = step
        self.history.append((step, metrics))
        self.trainer.log({f"forgetting/{k}": v for k, v in metrics.items() if k != "tokens"})
