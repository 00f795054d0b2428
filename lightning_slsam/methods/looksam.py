"""LookSAM (Liu et al., 2022, "Towards Efficient and Scalable Sharpness-Aware
Minimization"): a SAM step every ``interval`` steps stores ``g_v``, the part of the SAM
gradient orthogonal to the gradient ``g``; the one-pass steps in between add
``alpha * ||g|| / ||g_v|| * g_v``. The first SAM step warns when ``alpha`` exceeds
:data:`AMPLIFICATION_LIMIT` times ``||g_v|| / ||g||`` (:func:`amplification_message`).

>>> [Lookahead(interval=3, alpha=0.7, eps=1e-12).kind(t) for t in range(5)]
['sam', 'reuse', 'reuse', 'sam', 'reuse']
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_slsam.core.partition import by_position
from lightning_slsam.core.step import MethodParts, StepContext, StepKind
from lightning_slsam.methods.options import number
from lightning_slsam.methods.spec import MethodOptions, MethodSpec, option
from lightning_slsam.parallel.shards import Shards

__all__ = ["AMPLIFICATION_LIMIT", "LookSAMOptions", "LookSAMSpec", "Lookahead",
           "amplification_message"]  # fmt: skip

#: The largest ``alpha / ratio`` without a warning: a reuse step's added component over the
#: first SAM step's orthogonal part (docs/methods.md, "the reuse check", says why 3).
AMPLIFICATION_LIMIT = 3.0


def amplification_message(alpha: float, ratio: float) -> str | None:
    """The warning for reuse weight ``alpha`` at orthogonal ratio ``ratio``, or ``None`` when
    ``alpha / ratio`` is at most :data:`AMPLIFICATION_LIMIT` (or nothing is reused).

    >>> amplification_message(0.7, 0.5) is None  # a CNN's first SAM step
    True
    >>> print(amplification_message(0.7, 0.04)[:139])
    LookSAM: at the first SAM step the SAM gradient's component orthogonal to the gradient
    was 0.04 of the gradient's norm, and each reuse step
    """
    if alpha == 0 or ratio <= 0 or alpha / ratio <= AMPLIFICATION_LIMIT:
        return None
    suggested = AMPLIFICATION_LIMIT * ratio
    digits = max(0, 1 - math.floor(math.log10(suggested)))  # two significant digits, down
    suggested = math.floor(suggested * 10**digits) / 10**digits
    return (
        f"LookSAM: at the first SAM step the SAM gradient's component orthogonal to the"
        f" gradient was {ratio:.3g} of the gradient's norm, and each reuse step adds"
        f" alpha={alpha:g} of the gradient's norm along it: {alpha / ratio:.0f} times what the"
        f" SAM step added, over {AMPLIFICATION_LIMIT:g}. Options: alpha={suggested:g} or less,"
        " interval=1 (SAM), or another method"
        " (docs/methods.md#looksam-on-a-pretrained-transformer-the-reuse-check)."
    )


class Lookahead(MethodParts):
    """LookSAM's parts: SAM steps keep ``g_v = g_s - <g, g_s>/||g||^2 g`` (``g_s`` the SAM
    gradient; saved with the engine's state), ``"reuse"`` steps add it as the module says."""

    def __init__(self, interval: int, alpha: float, eps: float) -> None:
        self.interval = int(interval)
        self.alpha = float(alpha)
        self.eps = float(eps)
        self.vertical: dict[int, Tensor] = {}
        #: ``||g_v|| / ||g||`` at these parts' first SAM step (``None`` before it).
        self.orthogonal_ratio: float | None = None
        #: The SAM step keeps the first pass's gradients for the store (``alpha > 0``).
        self.keeps_first_grads = self.alpha > 0

    def kind(self, step: int) -> StepKind:
        return "sam" if step % self.interval == 0 else "reuse"

    @torch.no_grad()
    def after_sam_step(self, ctx: StepContext, pp: list[Tensor], pg: list[Tensor],
                       params2: list[Tensor], grads2: list[Tensor]) -> None:  # fmt: skip
        """After a SAM step: ``g_v`` of every perturbed tensor (with ``alpha > 0``)."""
        if self.keeps_first_grads:
            self.store(pp, pg, params2, grads2, ctx.shards)

    def store(self, pp: list[Tensor], pg: list[Tensor], params2: list[Tensor],
              grads2: list[Tensor], shards: Shards) -> None:  # fmt: skip
        """``g_v`` of every perturbed tensor (``pp``, ``pg``: the first pass's tensors and
        gradients; ``params2``, ``grads2``: the second pass's)."""
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
        if self.orthogonal_ratio is None:  # one host read per run
            norm = torch.linalg.vector_norm(shards.norms(vertical, like=[x[2] for x in pairs]))
            self.orthogonal_ratio = float(norm.double() / (g_sq.sqrt() + self.eps))
            message = amplification_message(self.alpha, self.orthogonal_ratio)
            if message is not None:
                self.warn(message)

    @torch.no_grad()
    def adjust_grads(self, ctx: StepContext, params: list[Tensor], grads: list[Tensor]) -> None:
        """Reuse step: ``g <- g + alpha * ||g|| / ||g_v|| * g_v`` (tensors with a ``g_v``)."""
        shards = ctx.shards
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
class LookSAMOptions(MethodOptions):
    """LookSAM's options.

    Args:
        interval: steps between SAM steps, >= 1. LookSAM: 5.
        alpha: weight of the reused component, >= 0 (0: plain steps in between). LookSAM: 0.7;
            the first SAM step warns when it is too large and says how large.
    """

    interval: int = option(5, number(1, integer=True))
    alpha: float = option(0.7, number(0))


@dataclass(kw_only=True, eq=False)
class LookSAMSpec(LookSAMOptions, MethodSpec):
    """LookSAM: a SAM step every ``interval`` steps, reusing its orthogonal part in between."""

    name: ClassVar[str] = "looksam"
    label: ClassVar[str] = "LookSAM"

    def parts(self, generator: torch.Generator) -> MethodParts:
        return Lookahead(self.interval, self.alpha, self.make_perturbation().eps)
