"""LookSAM (Liu et al., 2022): the step kind that reuses the SAM steps' orthogonal gradient
component on the steps in between.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_slsam.core.contract import StepCall
from lightning_slsam.core.freezing import by_position
from lightning_slsam.core.gradient_pass import gradient_pass
from lightning_slsam.core.perturbation import local_norms
from lightning_slsam.core.step_kinds import PlainStep
from lightning_slsam.core.step_parts import StepParts
from lightning_slsam.parallel.fsdp2 import local, shard_layout, sum_over_shards

__all__ = ["LookSAMReuse"]


class LookSAMReuse(PlainStep):
    """LookSAM (Liu et al., 2022): the SAM steps keep ``g_v = g_s - <g, g_s>/||g||^2 g``,
    the part of the SAM gradient ``g_s`` orthogonal to the plain gradient ``g``; the steps
    in between run one pass and add ``alpha * ||g|| / ||g_v|| * g_v`` to their gradient.
    """

    def __init__(self, alpha: float, eps: float) -> None:
        self.alpha = float(alpha)
        self.eps = float(eps)
        self.vertical: dict[int, Tensor] = {}

    @property
    def keeps_first_grads(self) -> bool:
        """Whether the SAM step must keep the first pass's gradients for :meth:`store`."""
        return self.alpha > 0

    def run(self, parts: StepParts, call: StepCall) -> None:
        mask = call.result.active_mask
        out = gradient_pass(parts.freezer, call, parts.activate(mask), mask)
        self._add(out.params, out.grads)
        parts.commit(call, out.scalars(), [], out.layer_norms, mask)

    @torch.no_grad()
    def store(self, pp, pg, params2, grads2) -> None:
        """After a SAM step: ``g_v`` of every perturbed tensor."""
        g_s = {id(p): g for p, g in zip(params2, grads2)}
        pairs = [(p, g, g_s[id(p)]) for p, g in zip(pp, pg) if id(p) in g_s]
        if not pairs:
            return
        layout = shard_layout([x[1] for x in pairs])  # FSDP2: sums over all shards
        g = local([x[1] for x in pairs])
        gs = local([x[2] for x in pairs])
        # In float64: g_v is a small difference of nearly parallel vectors, so rounding in
        # the coefficient is amplified (and would depend on how the tensors are sharded).
        dots = torch.stack([(a.double() * b.double()).sum() for a, b in zip(g, gs)])
        squares = torch.stack([a.double().square().sum() for a in g])
        inner, g_sq = sum_over_shards(torch.stack([dots, squares], 1), layout).sum(0)
        coeff = inner / (g_sq + self.eps)
        vertical = torch._foreach_sub(gs, torch._foreach_mul(g, coeff.to(g[0].dtype)))
        for (param, _, _), v in zip(pairs, vertical):
            self.vertical[id(param)] = v

    @torch.no_grad()
    def _add(self, params: list[Tensor], grads: list[Tensor]) -> None:
        """Reuse step: ``g <- g + alpha * ||g|| / ||g_v|| * g_v`` (tensors with a ``g_v``)."""
        pairs = [(g, self.vertical[id(p)]) for p, g in zip(params, grads) if id(p) in self.vertical]
        if not pairs or self.alpha == 0:
            return
        layout = shard_layout([x[0] for x in pairs])
        g = local([x[0] for x in pairs])
        v = [x[1] for x in pairs]  # stored as local shards
        ratio = torch.linalg.vector_norm(local_norms(g, layout)) / (
            torch.linalg.vector_norm(local_norms(v, layout)) + self.eps
        )
        torch._foreach_add_(g, torch._foreach_mul(v, (self.alpha * ratio).to(g[0].dtype)))

    def state_dict(self, index: dict[int, int]) -> dict[str, Any]:
        return {"vertical": {index[k]: v for k, v in self.vertical.items()}}

    def load_state_dict(self, state: dict[str, Any], tensors: list[Tensor]) -> None:
        self.vertical = by_position(state.get("vertical", {}), tensors)
