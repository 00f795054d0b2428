"""The forgetting monitor for Lightning: :class:`ForgettingMonitor`."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from torch import Tensor, nn

from lightning_slsam.methods.options import check_int
from lightning_slsam.monitor.forgetting import ForgettingProbe, Forward

__all__ = ["ForgettingMonitor"]


class ForgettingMonitor(pl.Callback):
    """Logs how much a language model forgets while it is fine-tuned (any method, or none).

    Args:
        reference: batches of text from the model's pretraining distribution, held out from
            the training data, as :class:`~lightning_slsam.monitor.forgetting.ForgettingProbe`
            takes them (``reference_windows`` cuts them).
        every_n_steps: measure after every this many optimizer steps (>= 1), and at the
            end of fit. Default 50.
        top_k: next tokens kept per reference position for the KL. Default 64.
        forward: ``forward(model, batch) -> logits``; default: the LightningModule's
            ``model`` attribute if it has one (a wrapped Hugging Face model), else the
            module itself, called as ``model(input_ids=..., attention_mask=...)``.

    Logged against the global step: ``forgetting/loss``, ``forgetting/accuracy``,
    ``forgetting/kl``, and at the end ``forgetting/seconds`` and ``forgetting/fraction``.
    A reference set cut from a book, and what the metrics mean: docs/forgetting.md.

    Example:
        A tiny next-token model, measured at fit start and every 2 steps:

        >>> import lightning as L, torch
        >>> class TinyLM(L.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = torch.nn.Sequential(
        ...             torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
        ...     def training_step(self, batch, batch_idx):
        ...         logits = self.net(batch[:, :-1])
        ...         return torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:])
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.5)
        >>> _ = torch.manual_seed(0)
        >>> monitor = ForgettingMonitor([torch.randint(0, 32, (4, 16))], every_n_steps=2,
        ...     top_k=32, forward=lambda module, batch: module.net(batch["input_ids"]))
        >>> trainer = L.Trainer(max_steps=4, callbacks=[monitor], logger=False,
        ...     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(TinyLM(), torch.utils.data.DataLoader(torch.randint(0, 32, (64, 16)), 8))
        >>> [step for step, _ in monitor.history]
        [0, 2, 4]
        >>> monitor.history[0][1]["kl"], monitor.history[-1][1]["kl"] > 0
        (0.0, True)
    """

    def __init__(self, reference: list[Tensor] | list[Mapping[str, Tensor]],
                 every_n_steps: int = 50, top_k: int = 64,
                 forward: Forward | None = None) -> None:  # fmt: skip
        super().__init__()
        check_int("every_n_steps", every_n_steps, 1)
        # Checks the arguments now; the probe is bound to the model at fit start.
        ForgettingProbe(nn.Module(), reference, top_k=top_k, forward=forward)
        self.reference, self.every_n_steps, self.top_k = reference, every_n_steps, top_k
        self.forward = forward
        self.probe: ForgettingProbe | None = None
        #: ``(global_step, metrics)`` of every measurement, fit start's included.
        self.history: list[tuple[int, dict[str, float]]] = []
        #: The monitor's cost at the end of fit: ``seconds`` and ``fraction`` of the fit.
        self.cost: dict[str, float] = {}
        self._fit_began = 0.0
        self._last_step = -1
        self._saved_start: Any = None

    def _model(self, pl_module: pl.LightningModule) -> Any:
        inner = getattr(pl_module, "model", None)
        return inner if inner is not None and self.forward is None else pl_module

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_began = time.perf_counter()
        self.probe = ForgettingProbe(self._model(pl_module), self.reference,
                                     top_k=self.top_k, forward=self.forward)  # fmt: skip
        if self._saved_start is not None:  # resumed: the KL still counts from the first start
            self.probe.load_start(self._saved_start)
        else:
            self.probe.start()
            self._record(trainer, self.probe.measure())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           *args: Any) -> None:  # fmt: skip
        step = trainer.global_step
        if self.probe is None or step == self._last_step or step % self.every_n_steps:
            return
        self._record(trainer, self.probe.measure())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.probe is None:
            return
        if trainer.global_step != self._last_step:
            self._record(trainer, self.probe.measure())
        total = max(time.perf_counter() - self._fit_began, 1e-9)
        cost = {"seconds": self.probe.seconds, "fraction": self.probe.seconds / total}
        self.cost = cost
        self._log(trainer, {f"forgetting/{k}": v for k, v in cost.items()})

    def _record(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        self._last_step = trainer.global_step
        self.history.append((trainer.global_step, metrics))
        shown = {f"forgetting/{k}": v for k, v in metrics.items() if k != "tokens"}
        self._log(trainer, shown)

    @staticmethod
    def _log(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def state_dict(self) -> dict[str, Any]:
        start = self.probe.start_state() if self.probe is not None else self._saved_start
        return {"history": self.history, "start": start}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
        self._saved_start = state_dict.get("start")
