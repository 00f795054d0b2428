"""SSAM-F (Mi et al., 2022, "Make Sharpness-Aware Minimization Stronger: A Sparsified
Perturbation Approach"): SAM whose ascent is zeroed outside the ``1 - sparsity`` of the
coordinates with the largest empirical Fisher information (:class:`FisherMask`). The
official code's flags in these options: docs/paper-and-code.md#ssam-f-and-its-official-code.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_slsam.core.partition import by_position
from lightning_slsam.core.passes import PassRunner
from lightning_slsam.core.step import ExtraWork, MethodParts, StepContext
from lightning_slsam.methods.options import number
from lightning_slsam.methods.spec import MethodOptions, MethodSpec, option
from lightning_slsam.parallel.shards import WHOLE, Shards

__all__ = ["FisherMask", "SSAMFOptions", "SSAMFSpec"]


class FisherMask(MethodParts):
    """SSAM-F's mask: the top ``1 - sparsity`` of all coordinates by the sum of squared
    per-sample gradients over ``fisher_samples`` samples of the batch, recomputed every
    ``mask_interval`` optimizer steps (the first included).

    Example:
        >>> import torch
        >>> w = [torch.zeros(4)]
        >>> mask = FisherMask(sparsity=0.5, fisher_samples=16, mask_interval=10)
        >>> mask.due(0), mask.due(3)  # refreshed at the first step, then every 10
        (True, True)
        >>> mask.set_fisher(w, [torch.tensor([0.1, 0.9, 0.5, 0.0])])
        >>> mask.masks_for(w), mask.due(3), mask.due(10)
        ([tensor([0., 1., 1., 0.])], False, True)
    """

    def __init__(self, sparsity: float, fisher_samples: int, mask_interval: int) -> None:
        self.sparsity = float(sparsity)
        self.fisher_samples = int(fisher_samples)
        self.mask_interval = int(mask_interval)
        self.masks: dict[int, Tensor] = {}

    def due(self, step: int) -> bool:
        """Whether the mask must be recomputed before optimizer step ``step``."""
        return not self.masks or step % self.mask_interval == 0

    def before_step(self, ctx: StepContext) -> ExtraWork:
        """Refresh the mask from per-sample gradients when it is due."""
        if not self.due(ctx.step):
            return ExtraWork()
        loop, layers, shards = ctx.loop, ctx.layers, ctx.shards
        fb = loop.forward_backward
        sizes = fb.batch_sizes
        active = layers.activate(layers.all)
        local = shards.local(active)
        fisher = [torch.zeros_like(s, dtype=torch.float32) for s in local]
        count = min(self.fisher_samples, sizes[0])
        group = shards.group(active) if shards.sharded else None
        sources: list[float | None] = [None]
        if group is not None:
            count, sources = _sample_sources(fb, group, count, local[0].device)
        empty = torch.zeros(0, dtype=torch.long)
        # One sample per pass: normalisation layers use (and keep) their running statistics.
        backward = sent = 0
        isolation = ctx.isolation
        with isolation.evaluating() if isolation is not None else nullcontext():
            for i in range(count):
                for loss_scale in sources:
                    loop.zero_grad()
                    subsets = [torch.tensor([i])] + [empty] * (len(sizes) - 1)
                    if loss_scale is None:
                        fb(subsets=subsets)
                    else:
                        fb(subsets=subsets, loss_scale=loss_scale)
                    grads = [p.grad for p in active]
                    present = [j for j, g in enumerate(grads) if g is not None]
                    squares = [shards.local([grads[j]])[0].float().square() for j in present]
                    torch._foreach_add_([fisher[j] for j in present], squares)
                    backward += 1
        loop.zero_grad()
        if group is not None:  # (g / world)^2 summed over sources, times world: the mean
            torch._foreach_mul_(fisher, float(len(sources)))
        elif loop.averager is not None:  # the same mask on every process
            sent = loop.averager.average_(fisher)
        self.set_fisher(active, fisher, shards)
        return ExtraWork(backward, sent)

    @torch.no_grad()
    def set_fisher(
        self, params: list[Tensor], fisher: list[Tensor], shards: Shards = WHOLE
    ) -> None:
        """Keep the top ``1 - sparsity`` coordinates of ``fisher`` over all ``params`` (ties by
        position; under FSDP2 ``fisher`` is local shards, the top that of whole tensors)."""
        keep = round(sum(p.numel() for p in params) * (1.0 - self.sparsity))
        chosen = shards.top(fisher, keep, params)
        self.masks = {id(p): c.to(p.dtype) for p, c in zip(params, chosen)}

    def ascent_masks(self, ctx: StepContext, params: list[Tensor]) -> list[Tensor]:
        return self.masks_for(params, ctx.shards)

    def masks_for(self, params: list[Tensor], shards: Shards = WHOLE) -> list[Tensor]:
        """The masks of ``params`` (all ones for a tensor the Fisher pass did not see)."""
        return [
            self.masks.get(id(p), torch.ones_like(s)) for p, s in zip(params, shards.local(params))
        ]

    def kept_fraction(self) -> float:
        """Fraction of coordinates the current mask perturbs."""
        total = sum(m.numel() for m in self.masks.values())
        kept = sum(float(m.sum()) for m in self.masks.values())
        return kept / total if total else 1.0

    def state_dict(self, index: dict[int, int]) -> dict[str, Any]:
        return {"fisher_masks": {index[k]: v for k, v in self.masks.items()}}

    def load_state_dict(self, state: dict[str, Any], tensors: list[Tensor]) -> None:
        if state.get("fisher_masks"):
            self.masks = by_position(state["fisher_masks"], tensors)


def _sample_sources(
    fb: PassRunner, group: Any, count: int, device: torch.device
) -> tuple[int, list[float | None]]:
    """FSDP2, which averages every backward: the per-sample count every process can serve,
    and this process's loss scale for each source process (1 for itself, 0 for the others)."""
    if "loss_scale" not in inspect.signature(fb).parameters:
        raise ValueError(
            "SSAM-F under FSDP2 needs a forward_backward callable with a `loss_scale`"
            " argument (the loss is multiplied by it before the backward pass), to take"
            " each process's per-sample gradients in turn."
        )
    agreed = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    rank = dist.get_rank(group)
    return int(agreed), [float(r == rank) for r in range(dist.get_world_size(group))]


@dataclass(kw_only=True, eq=False)
class SSAMFOptions(MethodOptions):
    """SSAM-F's options.

    Args:
        sparsity: fraction of coordinates not perturbed, in [0, 1). Paper: 0.5.
        fisher_samples: per-sample gradients per refresh, capped at the batch size. Default 16.
        mask_interval: optimizer steps between refreshes (the first included). Default 100.
    """

    sparsity: float = option(0.5, number(0, 1, high_open=True))
    fisher_samples: int = option(16, number(1, integer=True))
    mask_interval: int = option(100, number(1, integer=True))


@dataclass(kw_only=True, eq=False)
class SSAMFSpec(SSAMFOptions, MethodSpec):
    """SSAM-F: SAM's ascent on the ``1 - sparsity`` coordinates of largest Fisher information."""

    name: ClassVar[str] = "ssamf"
    label: ClassVar[str] = "SSAMF"

    def parts(self, generator: torch.Generator) -> MethodParts:
        return FisherMask(self.sparsity, self.fisher_samples, self.mask_interval)
