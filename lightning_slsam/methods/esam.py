"""ESAM's sharpness-sensitive data selection (Du et al., 2022): the samples the second pass
runs on.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_slsam.core.contract import PER_SAMPLE_NEEDED, ForwardBackward, PassOutput, as_output

__all__ = ["SharpestSamples"]


class SharpestSamples:
    """ESAM's sharpness-sensitive data selection: the second pass runs on the fraction
    ``data_ratio`` of each micro-batch whose loss rose most under the perturbation."""

    def __init__(self, data_ratio: float) -> None:
        self.data_ratio = float(data_ratio)

    def select(self, first: PassOutput, forward_backward: ForwardBackward) -> list[Tensor]:
        before = first.per_sample
        if not before or any(b is None for b in before):
            raise ValueError(PER_SAMPLE_NEEDED)  # a loop that does not check it earlier
        with torch.no_grad():
            after = as_output(forward_backward(backward=False)).per_sample
        subsets = []
        for b, a in zip(before, after or []):
            k = max(1, round(self.data_ratio * b.numel()))
            sharpness = a.to(b.device).float() - b.float()
            subsets.append(torch.topk(sharpness, k, sorted=False).indices.sort().values)
        return subsets
