"""ESAM (Du et al., 2022, "Efficient Sharpness-aware Minimization for Improved Training of
Neural Networks"): SAM perturbing a random ``weight_ratio`` of the layers (:class:`ExpandToAll`),
its second pass, which updates every layer, on the ``data_ratio`` of each batch whose
per-sample loss the perturbation raised most (:class:`SharpestSamples`). The official code's
flags in these options: docs/paper-and-code.md#esam-and-its-official-code.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_slsam.core.isolation import StepIsolation
from lightning_slsam.core.partition import LayerPartition
from lightning_slsam.core.passes import PER_SAMPLE_NEEDED, PassOutput, PassRunner
from lightning_slsam.core.step import MethodParts, StepContext
from lightning_slsam.methods.options import RATIO
from lightning_slsam.methods.spec import MethodOptions, MethodSpec, option
from lightning_slsam.selection.rules import LayerSelection, UniformSelection, WrappedSelection

__all__ = ["ESAMOptions", "ESAMSpec", "ExpandToAll", "SharpestSamples"]


class ExpandToAll(WrappedSelection):
    """First pass on ``first``'s sample, then every layer (ESAM's stochastic weight
    perturbation with a dense update). ``first`` (the wrapped rule, ``inner``) does not learn.

    Example:
        >>> import torch
        >>> first_pass = UniformSelection(4, 0.25, generator=torch.Generator().manual_seed(0))
        >>> rule = ExpandToAll(first_pass)
        >>> first = rule.sample()
        >>> first.tolist(), rule.refine(first, None).tolist()
        ([False, False, True, False], [True, True, True, True])
    """

    refines = True

    def __init__(self, first: LayerSelection) -> None:
        super().__init__(first)

    def sample(self) -> Tensor:
        return self.inner.sample()

    def refine(self, active: Tensor, norms: Tensor | None) -> Tensor:
        return torch.ones(self.num_layers, dtype=torch.bool)

    def update(self, active: Tensor, norms: Tensor, inclusion: Tensor | None = None) -> bool:
        return False

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


class SharpestSamples(MethodParts):
    """ESAM's sharpness-sensitive data selection: the second pass runs on the fraction
    ``data_ratio`` of each micro-batch whose loss rose most under the perturbation."""

    needs_per_sample = True

    def __init__(self, data_ratio: float) -> None:
        self.data_ratio = float(data_ratio)

    def choose_samples(
        self, ctx: StepContext, first: PassOutput, isolated: StepIsolation | None
    ) -> list[Tensor]:
        # The extra forward leaves running statistics and random streams as they were.
        with isolated.extra_forward() if isolated is not None else nullcontext():
            return self.select(first, ctx.loop.forward_backward)

    def select(self, first: PassOutput, forward_backward: PassRunner) -> list[Tensor]:
        """The samples of each micro-batch whose loss ``forward_backward`` (at the perturbed
        weights) raised most over ``first``'s."""
        before = first.per_sample
        if not before or any(b is None for b in before):
            raise ValueError(PER_SAMPLE_NEEDED)  # a loop that does not check it earlier
        with torch.no_grad():
            after = forward_backward(backward=False).per_sample
        subsets = []
        for b, a in zip(before, after or []):
            k = max(1, round(self.data_ratio * b.numel()))  # type: ignore[union-attr]
            sharpness = a.to(b.device).float() - b.float()  # type: ignore[union-attr]
            subsets.append(torch.topk(sharpness, k, sorted=False).indices.sort().values)
        return subsets


@dataclass(kw_only=True, eq=False)
class ESAMOptions(MethodOptions):
    """ESAM's options.

    Args:
        weight_ratio: fraction of layers perturbed, in (0, 1]. Paper: 0.5.
        data_ratio: fraction of each batch in the second pass, in (0, 1]; 1.0 turns the
            selection off. Paper: 0.5.
    """

    weight_ratio: float = option(0.5, RATIO)
    data_ratio: float = option(0.5, RATIO)


@dataclass(kw_only=True, eq=False)
class ESAMSpec(ESAMOptions, MethodSpec):
    """ESAM: stochastic weight perturbation and sharpness-sensitive data selection."""

    name: ClassVar[str] = "esam"
    label: ClassVar[str] = "ESAM"
    samples_layers: ClassVar[bool] = True

    def selection(self, layers: LayerPartition, generator: torch.Generator) -> LayerSelection:
        return ExpandToAll(UniformSelection(layers.num_layers, self.weight_ratio, generator))

    def parts(self, generator: torch.Generator) -> MethodParts:
        return SharpestSamples(self.data_ratio) if self.data_ratio < 1 else MethodParts()
