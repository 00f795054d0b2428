"""LookSAM (Liu et al., 2022, "Towards Efficient and Scalable Sharpness-Aware
Minimization"): a full SAM step every ``interval`` steps, which stores ``g_v``, the part of
the SAM gradient orthogonal to the plain gradient; the steps in between run one pass and
add ``alpha * ||g|| / ||g_v|| * g_v`` to their gradient (Active Ratio ``1 + 1/interval``:
1.2x at 5).

>>> [Lookahead(interval=3, alpha=0.7, eps=1e-12).kind(t) for t in range(5)]
['sam', 'reuse', 'reuse', 'sam', 'reuse']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_slsam.core.partition import by_position
from lightning_slsam.core.step import MethodParts
from lightning_slsam.methods.options import number
from lightning_slsam.methods.spec import MethodSpec, option
from lightning_slsam.parallel.shards import Whole

__all__ = ["LookSAMSpec", "Lookahead"]


class Lookahead(MethodParts):
    """LookSAM's parts: the SAM steps keep ``g_v = g_s - <g, g_s>/||g||^2 g``, the part of
    the SAM gradient ``g_s`` orthogonal to the plain gradient ``g``; the ``"reuse"`` steps
    in between add ``alpha * ||g|| / ||g_v|| * g_v`` to their gradient (``alpha=0``: plain
    steps). ``g_v`` is saved with the engine's state."""

    def __init__(self, interval: int, alpha: float, eps: float) -> None:
        self.interval = int(interval)
        self.alpha = float(alpha)
        self.eps = float(eps)
        self.vertical: dict[int, Tensor] = {}
        #: The SAM step keeps the first pass's gradients for the store (``alpha > 0``).
        self.keeps_first_grads = self.alpha > 0
        self.after_sam_step = self.store if self.keeps_first_grads else None

    def kind(self, step: int) -> str:
        return "sam" if step % self.interval == 0 else "reuse"

    @torch.no_grad()
    def store(self, pp: list[Tensor], pg: list[Tensor], params2: list[Tensor],
              grads2: list[Tensor], shards: Whole) -> None:  # fmt: skip
        """After a SAM step: ``g_v`` of every perturbed tensor."""
        g_s = {id(p): g for p, g in zip(params2, grads2)}
        pairs = [(p, g, g_s[id(p)]) for p, g in zip(pp, pg) if id(p) in g_s]
        if not pairs:
            return
        g = shards.local([x[1] for x in pairs])
        gs = shards.local([x[2] for x in pairs])
        # In float64: g_v is a small difference of nearly parallel vectors, so rounding in
        # the coefficient is amplified (and would depend on how the tensors are sharded).
        dots = torch.stack([(a.double() * b.double()).sum() for a, b in zip(g, gs)])
        squares = torch.stack([a.double().square().sum() for a in g])
        sums = shards.sums(torch.stack([dots, squares], 1), [x[1] for x in pairs])
        inner, g_sq = sums.sum(0)
        coeff = inner / (g_sq + self.eps)
        vertical = torch._foreach_sub(gs, torch._foreach_mul(g, coeff.to(g[0].dtype)))
        for (param, _, _), v in zip(pairs, vertical):
            self.vertical[id(param)] = v

    @torch.no_grad()
    def adjust_grads(self, params: list[Tensor], grads: list[Tensor], shards: Whole) -> None:
        """Reuse step: ``g <- g + alpha * ||g|| / ||g_v|| * g_v`` (tensors with a ``g_v``)."""
        pairs = [(g, self.vertical[id(p)]) for p, g in zip(params, grads) if id(p) in self.vertical]
        if not pairs or self.alpha == 0:
            return
        whole = [x[0] for x in pairs]
        g = shards.local(whole)
        v = [x[1] for x in pairs]  # stored as local shards
        ratio = torch.linalg.vector_norm(shards.norms(g, like=whole)) / (
            torch.linalg.vector_norm(shards.norms(v, like=whole)) + self.eps
        )
        torch._foreach_add_(g, torch._foreach_mul(v, (self.alpha * ratio).to(g[0].dtype)))

    def state_dict(self, index: dict[int, int]) -> dict[str, Any]:
        return {"vertical": {index[k]: v for k, v in self.vertical.items()}}

    def load_state_dict(self, state: dict[str, Any], tensors: list[Tensor]) -> None:
        self.vertical = by_position(state.get("vertical", {}), tensors)


@dataclass(kw_only=True, eq=False)
class LookSAMSpec(MethodSpec):
    """LookSAM: a SAM step every ``interval`` steps; the steps in between reuse the stored
    orthogonal component with weight ``alpha``.

    Args:
        interval: steps between SAM steps, >= 1. LookSAM: 5.
        alpha: weight of the reused component, >= 0 (0: plain steps in between). LookSAM: 0.7.
    """

    name: ClassVar[str] = "looksam"
    label: ClassVar[str] = "LookSAM"
    renamed: ClassVar[dict[str, str]] = {"sam_interval": "interval", "looksam_alpha": "alpha"}

    interval: int = option(5, number(1, integer=True))
    alpha: float = option(0.7, number(0))

    def parts(self, generator: torch.Generator) -> MethodParts:
        return Lookahead(self.interval, self.alpha, self.perturbation.eps)
