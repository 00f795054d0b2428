"""Inverse-inclusion update scaling (beyond the paper): a layer drawn with probability ``q``
moves ``min(1/q, limit)`` times the optimizer's change, so that in expectation it moves as
far as a layer trained every step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_slsam.core.partition import LayerPartition
from lightning_slsam.core.perturbation import BackupPool
from lightning_slsam.parallel.fsdp2 import local
from lightning_slsam.selection.rules import LayerSelection

__all__ = ["UpdateScaling"]


class UpdateScaling:
    """Inverse-inclusion update scaling: on a step whose layers the selection drew, each
    active layer's update -- the change the optimizer made to its weights -- is multiplied
    by ``min(1 / q, limit)``, with ``q`` the probability that the layer was drawn."""

    def __init__(self, limit: float) -> None:
        self.limit = float(limit)
        self._inclusion: Tensor | None = None

    def prepare(self, selection: LayerSelection, drawn: bool) -> None:
        """Before the step: the draw's inclusion probabilities (``drawn=False``: no
        scaling this step)."""
        self._inclusion = selection.inclusion() if drawn else None

    def before_update(
        self, mask: Tensor, partition: LayerPartition, pool: BackupPool
    ) -> tuple[list[Tensor], list[Tensor], list[float]] | None:
        """The drawn tensors whose update is scaled, a copy of their weights before the
        optimizer step (in ``pool``), and each one's factor minus 1."""
        if self._inclusion is None:
            return None
        factors = (1.0 / self._inclusion.clamp(min=1e-300)).clamp(max=self.limit)
        params: list[Tensor] = []
        extra: list[float] = []
        for on, factor, group in zip(mask.tolist(), factors.tolist(), partition.params):
            if on and factor > 1.0:
                params.extend(group)
                extra.extend([factor - 1.0] * len(group))
        if not params:
            return None
        params = local(params)  # FSDP2: each process scales its own shards
        return params, pool.copy(params), extra

    @staticmethod
    @torch.no_grad()
    def apply(params: list[Tensor], before: list[Tensor], extra: list[float]) -> None:
        """``w <- w + (f - 1) * (w - w_before)``: the optimizer's change times ``f``."""
        torch._foreach_sub_(before, params)  # w_before - w
        torch._foreach_mul_(before, extra)  # (f - 1) * (w_before - w)
        torch._foreach_sub_(params, before)
