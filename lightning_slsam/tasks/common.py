"""What the offline tasks and the paper recipes share: per-batch padding and learning-rate
schedules (their argument checks are :mod:`lightning_slsam.methods.options`')."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_slsam.lightning.callback import estimated_stepping_batches
from lightning_slsam.methods.options import check_choice, check_number

__all__ = ["SCHEDULES", "PaddingCollator", "check_training", "require", "with_schedule"]

SCHEDULES = ("constant", "linear", "cosine")


def require(module: str, user: str, package: str | None = None) -> None:
    """Fail at construction, with the install command, when ``user`` (a task or recipe
    class) needs ``module`` and it is not installed (the ``tasks`` extra brings timm,
    transformers and scikit-learn)."""
    try:
        importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"{user} needs the `{package or module}` package, which is not installed:"
            ' `pip install "lightning-slsam[tasks]"`.'
        ) from err


def check_training(
    learning_rate: Any, weight_decay: Any, warmup_ratio: Any, schedule: Any = "constant"
) -> None:
    """The optimisation options every task and recipe takes (``learning_rate=None``: the
    recipe chooses; a ``ValueError`` naming the option otherwise)."""
    if learning_rate is not None:
        check_number("learning_rate", learning_rate, "> 0", lambda v: v > 0)
    check_number("weight_decay", weight_decay, ">= 0", lambda v: v >= 0)
    check_number("warmup_ratio", warmup_ratio, "in [0, 1)", lambda v: 0 <= v < 1)
    check_choice("schedule", schedule, SCHEDULES)


@dataclass
class PaddingCollator:
    """Pads tokenised examples to the longest one of the batch (``labels`` -> a tensor of
    ``label_dtype``: ``torch.long`` for classes, ``torch.float32`` for regression).

    Padding per batch, not to ``max_length``, keeps short sentences cheap on a CPU. A
    dataclass rather than a closure so that DataLoader workers can pickle it.
    """

    pad_token_id: int = 0
    label_dtype: torch.dtype = torch.long

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Tensor]:
        longest = max(len(ex["input_ids"]) for ex in examples)
        labels = [ex["labels"] for ex in examples]
        batch = {"labels": torch.tensor(labels, dtype=self.label_dtype)}
        for key in (k for k in examples[0] if k != "labels"):
            fill = self.pad_token_id if key == "input_ids" else 0
            rows = [ex[key] + [fill] * (longest - len(ex[key])) for ex in examples]
            batch[key] = torch.tensor(rows, dtype=torch.long)
        return batch


def with_schedule(
    trainer: Any, optimizer: torch.optim.Optimizer, schedule: str, warmup_ratio: float
) -> Any:
    """``optimizer`` with a per-step schedule for ``configure_optimizers`` to return.

    ``linear`` / ``cosine`` decay to 0 at the last optimizer step after a linear warm-up
    over ``warmup_ratio`` of the steps (at least one step when > 0); ``constant`` keeps the
    rate after the warm-up, and without one is the bare optimizer.
    """
    if schedule == "constant" and not warmup_ratio:
        return optimizer
    total = estimated_stepping_batches(trainer)
    if not math.isfinite(total):
        raise ValueError(
            f"The {schedule!r} learning-rate schedule (warmup_ratio={warmup_ratio}) needs a"
            " finite training length: set `max_steps` or `max_epochs` on the Trainer."
        )
    total = max(1, int(total))
    warmup = max(1, round(warmup_ratio * total)) if warmup_ratio else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
