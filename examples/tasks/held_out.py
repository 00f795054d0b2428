"""What the experiment tasks add to a validation split: a held-out test split evaluated
beside it (logged as ``test_*``) and label noise on the training labels."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_slsam.methods.options import check_number

__all__ = ["HELD_OUT", "check_held_out", "check_smoothing", "log_held_out", "noisy_labels"]

#: The held-out splits a task's validation loop runs, by dataloader index.
HELD_OUT = ("val", "test")


def check_held_out(val_fraction: Any, test_fraction: Any, label_noise: Any) -> None:
    """Check the held-out fractions (together under 1) and the label noise; a
    ``ValueError`` naming the option."""
    check_number("val_fraction", val_fraction, "in (0, 1)", lambda v: 0 < v < 1)
    check_number("test_fraction", test_fraction, "in [0, 1)", lambda v: 0 <= v < 1)
    if val_fraction + test_fraction >= 1:
        raise ValueError(
            f"`val_fraction` + `test_fraction` must be under 1 (training needs rows), got"
            f" {val_fraction} + {test_fraction}."
        )
    check_number("label_noise", label_noise, "in [0, 1)", lambda v: 0 <= v < 1)


def noisy_labels(labels: Tensor, fraction: float, num_classes: int, seed: int) -> Tensor:
    """``labels`` with ``fraction`` of them replaced by a class drawn uniformly (the true
    one included: ``fraction * (1 - 1 / num_classes)`` end wrong), from ``seed + 1``."""
    if not fraction:
        return labels
    generator = torch.Generator().manual_seed(seed + 1)
    chosen = torch.randperm(len(labels), generator=generator)[: round(fraction * len(labels))]
    noisy = labels.clone()
    noisy[chosen] = torch.randint(num_classes, (len(chosen),), generator=generator)
    return noisy


def log_held_out(
    module: Any, dataloader_idx: int, logits: Tensor, labels: Tensor, loss: Tensor
) -> None:
    """Log a held-out batch's ``<split>_loss`` and ``<split>_acc`` (``val``; ``test`` for
    the second loader), with the module's ``<split>_acc`` metric."""
    split = HELD_OUT[dataloader_idx]
    metric = getattr(module, f"{split}_acc")
    metric.update(logits.argmax(-1), labels)
    size = labels.shape[0]
    kw = {"on_epoch": True, "batch_size": size, "add_dataloader_idx": False}
    module.log(f"{split}_loss", loss, prog_bar=split == "val", **kw)
    module.log(f"{split}_acc", metric, prog_bar=True, **kw)


def check_smoothing(value: float) -> None:
    """``label_smoothing`` must be a number in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"`label_smoothing` must be a number in [0, 1), got {value!r}.")
