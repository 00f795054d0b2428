"""What the demo, the example tasks and the recipes share: the seeded row split, per-batch
padding and learning-rate schedules."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_slsam.lightning.callback import estimated_stepping_batches
from lightning_slsam.methods.options import check_choice, check_number

__all__ = [
    "SCHEDULES",
    "PaddingCollator",
    "check_training",
    "require",
    "split_rows",
    "with_schedule",
]

SCHEDULES = ("constant", "linear", "cosine")


def require(module: str, user: str, package: str | None = None) -> None:
    """Raise ``ImportError`` with the install command when ``user`` (a class name) needs
    ``module`` (the ``package`` to install, default ``module``) and it is missing."""
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
    """Check the optimisation options (``learning_rate=None``: the recipe chooses); a
    ``ValueError`` naming the option."""
    if learning_rate is not None:
        check_number("learning_rate", learning_rate, "> 0", lambda v: v > 0)
    check_number("weight_decay", weight_decay, ">= 0", lambda v: v >= 0)
    check_number("warmup_ratio", warmup_ratio, "in [0, 1)", lambda v: 0 <= v < 1)
    check_choice("schedule", schedule, SCHEDULES)


def split_rows(
    num_rows: int, seed: int, val_fraction: float, test_fraction: float = 0.0
) -> tuple[list[int], list[int], list[int]]:
    """Train, validation and test row indices from one permutation drawn from ``seed``
    alone: validation takes its first rows, test the next (so adding a test split keeps
    the validation rows), training the rest."""
    if num_rows < 2:
        raise ValueError(f"The data has {num_rows} rows: 2 or more are needed to split.")
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed)).tolist()
    held = min(max(1, round(val_fraction * num_rows)), num_rows - 1)
    tested = min(round(test_fraction * num_rows), num_rows - 1 - held)
    return order[held + tested :], order[:held], order[held : held + tested]


@dataclass
class PaddingCollator:
    """Pads tokenised examples to the longest one of the batch (``labels`` -> a tensor of
    ``label_dtype``: ``torch.long`` for classes, ``torch.float32`` for regression); a
    dataclass so that DataLoader workers can pickle it."""

    pad_token_id: int = 0
    label_dtype: torch.dtype = torch.long

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Tensor]:
        longest = max(len(ex["input_ids"]) for ex in examples)
        labels = [ex["labels"] for ex in examples]
        batch = {"labels": torch.tensor(labels, dtype=self.label_dtype)}
        if "index" in examples[0]:  # the example's position in its set
            batch["index"] = torch.tensor([ex["index"] for ex in examples], dtype=torch.long)
        for key in (k for k in examples[0] if k not in ("labels", "index")):
            fill = self.pad_token_id if key == "input_ids" else 0
            rows = [ex[key] + [fill] * (longest - len(ex[key])) for ex in examples]
            batch[key] = torch.tensor(rows, dtype=torch.long)
        return batch


def with_schedule(
    trainer: Any, optimizer: torch.optim.Optimizer, schedule: str, warmup_ratio: float
) -> Any:
    """``optimizer`` with a per-step schedule for ``configure_optimizers``: a linear
    warm-up over ``warmup_ratio`` of the steps (at least one when > 0), then ``linear`` /
    ``cosine`` decay to 0 at the last step or ``constant`` (no warm-up: the bare optimizer)."""
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
