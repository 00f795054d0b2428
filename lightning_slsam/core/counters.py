"""What the engine counts over a run: per-layer activations and gradient norms, steps of
each kind, skipped steps and the active ratio; saved in its checkpoint state.

>>> import torch
>>> counters = StepCounters()
>>> counters.reset_counters(3)
>>> counters.record_norms(torch.tensor([True, False, True]), torch.tensor([1.0, 9.0, 3.0]))
>>> counters.mean_norms().tolist()[::2]
[1.0, 3.0]
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_slsam.core.contract import StepResult

__all__ = ["StepCounters"]


class StepCounters:
    """The engine's counters (a base class of :class:`~lightning_slsam.SparseSAMEngine`).

    Attributes:
        counts: steps in which each layer was updated (int64, CPU).
        norm_sums, norm_counts: sum and number of the first-pass gradient norms measured
            for each layer (the selection's input; :meth:`mean_norms`).
        num_steps: steps run, skipped ones included; ``num_skipped``: skipped ones.
        kind_counts: steps of each kind (skipped ones excluded).
        active_ratio_sum: sum over non-skipped steps of :attr:`StepResult.active_ratio`.
        last_result: the latest :class:`StepResult`.
    """

    def reset_counters(self, num_layers: int) -> None:
        """Start counting afresh for ``num_layers`` layers."""
        self.counts = torch.zeros(num_layers, dtype=torch.int64)
        self.norm_sums = torch.zeros(num_layers, dtype=torch.float64)
        self.norm_counts = torch.zeros(num_layers, dtype=torch.int64)
        self.num_steps = 0
        self.num_skipped = 0
        self.kind_counts: dict[str, int] = {}
        self.active_ratio_sum = 0.0
        self.last_result: StepResult | None = None

    def count(self, result: StepResult) -> None:
        """Count a finished step."""
        self.num_steps += 1
        if result.skipped:
            self.num_skipped += 1
        else:
            self.counts += result.active_mask.to(torch.int64)
            self.active_ratio_sum += result.active_ratio
            self.kind_counts[result.kind] = self.kind_counts.get(result.kind, 0) + 1
        self.last_result = result

    def record_norms(self, mask: Tensor, norms: Tensor) -> None:
        """Add the first-pass norms ``norms`` of the layers in ``mask`` (float64, CPU)."""
        self.norm_sums += torch.where(mask, norms, 0.0)
        self.norm_counts += mask.to(torch.int64)

    @property
    def mean_active_ratio(self) -> float:
        """Mean "Active Ratio" (summed over passes) over the non-skipped steps."""
        done = self.num_steps - self.num_skipped
        return self.active_ratio_sum / done if done else math.nan

    def frequencies(self) -> Tensor:
        """Fraction of non-skipped steps each layer was updated (float64)."""
        done = max(self.num_steps - self.num_skipped, 1)
        return self.counts.double() / done

    def mean_norms(self) -> Tensor:
        """Mean first-pass gradient norm of each layer over the steps it was measured in
        (float64; NaN for a layer never measured)."""
        return self.norm_sums / self.norm_counts.double()

    def never_selected(self) -> int:
        """Layers not updated in any step so far."""
        return int((self.counts == 0).sum())

    def counters_state(self) -> dict[str, Any]:
        """The counters, for a checkpoint."""
        return {
            "counts": self.counts.clone(),
            "norm_sums": self.norm_sums.clone(),
            "norm_counts": self.norm_counts.clone(),
            "num_steps": self.num_steps,
            "num_skipped": self.num_skipped,
            "kind_counts": dict(self.kind_counts),
            "active_ratio_sum": self.active_ratio_sum,
        }

    def load_counters(self, state: dict[str, Any]) -> None:
        """Restore :meth:`counters_state`'s output (older checkpoints lack the norms)."""
        self.counts = state["counts"].clone().to(torch.int64)
        n = self.counts.numel()
        self.norm_sums = state.get("norm_sums", torch.zeros(n)).clone().double()
        self.norm_counts = state.get("norm_counts", torch.zeros(n)).clone().to(torch.int64)
        self.num_steps = int(state["num_steps"])
        self.num_skipped = int(state["num_skipped"])
        self.kind_counts = dict(state.get("kind_counts", {}))
        self.active_ratio_sum = float(state["active_ratio_sum"])
