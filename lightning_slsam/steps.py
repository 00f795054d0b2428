"""The kinds of training step, as strategies the engine runs.

A schedule names each step's kind (:mod:`lightning_slsam.schedules`); the engine looks the
kind up and runs it:

* :class:`SAMStep` -- SAM's two passes: gradient, ascent, gradient at the perturbed
  weights, exact restore, update;
* :class:`PlainStep` -- one pass and the update (RST's plain steps);
* :class:`LookSAMReuse` -- LookSAM: the SAM steps store the part of the SAM gradient
  orthogonal to the plain one, the steps in between (kind ``"reuse"``) add it back;
* :class:`SingleStep` -- single-step SAM: one pass at weights perturbed along the previous
  step's gradient.

Around the SAM step, optional parts each own their state (:mod:`lightning_slsam.extras`).
A new kind of step is a new :class:`StepKind` subclass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_slsam.extras import FisherRefresh, PassIsolation, SharpestSamples, by_position
from lightning_slsam.finish import finish_step
from lightning_slsam.passes import StepCall, gradient_pass
from lightning_slsam.perturbation import local_norms
from lightning_slsam.sharding import local, shard_layout, sum_over_shards

if TYPE_CHECKING:
    from lightning_slsam.engine import SparseSAMEngine

__all__ = ["LookSAMReuse", "PlainStep", "SAMStep", "SingleStep", "StepKind"]


class StepKind:
    """A kind of training step. :meth:`run` trains the layers in ``call.result.active_mask``
    and ends with :func:`~lightning_slsam.finish.finish_step`, which steps the optimizer or
    skips."""

    def run(self, engine: SparseSAMEngine, call: StepCall) -> None:
        raise NotImplementedError

    def state_dict(self, index: dict[int, int]) -> dict[str, Any]:
        """Per-tensor state, keyed by the tensors' positions (``index``: id -> position)."""
        return {}

    def load_state_dict(self, state: dict[str, Any], tensors: list[Tensor]) -> None:
        pass


class PlainStep(StepKind):
    """One gradient pass and the update."""

    def run(self, engine: SparseSAMEngine, call: StepCall) -> None:
        mask = call.result.active_mask
        out = gradient_pass(engine.freezer, call, engine.activate(mask), mask)
        finish_step(engine, call, out.scalars(), [], out.layer_norms, mask)


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

    def run(self, engine: SparseSAMEngine, call: StepCall) -> None:
        mask = call.result.active_mask
        out = gradient_pass(engine.freezer, call, engine.activate(mask), mask)
        self._add(out.params, out.grads)
        finish_step(engine, call, out.scalars(), [], out.layer_norms, mask)

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


class SAMStep(StepKind):
    """SAM's two passes, on the layers the selection drew.

    Args:
        isolation: BatchNorm statistics and dropout replay between the passes.
        sharpest: ESAM's data selection for the second pass (``None``: the whole batch).
        fisher: SSAM-F's coordinate mask on the ascent (``None``: every coordinate).
        looksam: LookSAM's store of the orthogonal component (``None``: not kept).
        sync_first_pass: average the first pass's gradients across processes before the
            ascent (otherwise every process perturbs along its own gradient).
    """

    def __init__(
        self,
        isolation: PassIsolation,
        sharpest: SharpestSamples | None = None,
        fisher: FisherRefresh | None = None,
        looksam: LookSAMReuse | None = None,
        sync_first_pass: bool = True,
    ) -> None:
        self.isolation = isolation
        self.sharpest = sharpest
        self.fisher = fisher
        self.looksam = looksam if looksam is not None and looksam.keeps_first_grads else None
        self.sync_first_pass = sync_first_pass

    def run(self, engine: SparseSAMEngine, call: StepCall) -> None:
        freezer, mask1 = engine.freezer, call.result.active_mask
        with self.isolation.sam_step() as isolated:
            # 1. The gradient at the current weights, on the drawn layers.
            first = gradient_pass(
                freezer, call, engine.activate(mask1), mask1, sync=self.sync_first_pass
            )
            # 2. The layers the second pass trains (a selection may narrow the draw).
            mask2 = engine.selection.refine(
                mask1, first.layer_norms.double().cpu() if engine.selection.refine_uses_norms
                else None,
            )  # fmt: skip
            active2 = first.active if mask2 is mask1 else engine.activate(mask2)
            call.result.active_mask = mask2
            keep = {id(p) for p in active2}
            chosen = [i for i, p in enumerate(first.params) if id(p) in keep]
            pp = [first.params[i] for i in chosen]
            pg = [first.grads[i] for i in chosen]
            # 3. The ascent. A non-finite first pass is only detected at the end of the
            # step (checking here would cost a second host sync every step); the exact
            # restore undoes whatever a NaN perturbation did.
            backup = engine.perturbation.perturb_(
                pp, pg, first.norms[chosen], first.slots[chosen], freezer.num_groups,
                inplace=self.looksam is None,
                masks=self.fisher.masks_for(pp) if self.fisher is not None else None,
                scaled=engine.weight_flags(pp),
            )  # fmt: skip
            # Free the first-pass gradients before the next forward; LookSAM keeps them.
            first.grads.clear()
            if self.looksam is None:
                pg = []
            call.zero_grad()
            isolated.first_pass_done()
            # 4. The gradient at the perturbed weights, then the exact restore.
            try:
                subsets = None
                if self.sharpest is not None:
                    with isolated.extra_forward():
                        subsets = self.sharpest.select(first.output, call.forward_backward)
                isolated.second_pass_starts()
                second = gradient_pass(freezer, call, active2, mask2, subsets=subsets)
            finally:
                engine.perturbation.restore_(pp, backup)
                isolated.step_done()
            del backup
        if self.looksam is not None:
            self.looksam.store(pp, pg, second.params, second.grads)
        # 5. The update with the second pass's gradients (or a skip).
        finish_step(engine, call, first.scalars(), second.scalars(), first.layer_norms, mask1)


class SingleStep(StepKind):
    """Single-step SAM: one pass at weights perturbed along each tensor's gradient from
    the last step it was trained in; the first step is a plain one on every layer."""

    def __init__(self) -> None:
        self.last_grad: dict[int, Tensor] = {}

    @property
    def ready(self) -> bool:
        """Whether a previous gradient exists (else the step is a dense plain one)."""
        return bool(self.last_grad)

    def run(self, engine: SparseSAMEngine, call: StepCall) -> None:
        mask = call.result.active_mask
        active = engine.activate(mask)
        pp = [p for p in active if id(p) in self.last_grad]
        pg = [self.last_grad[id(p)] for p in pp]
        device = pp[0].device if pp else None
        # Stored as local shards (FSDP2): the params tell the layout.
        norms = local_norms(pg, shard_layout(pp), device)
        backup = engine.perturbation.perturb_(
            pp, pg, norms, engine.freezer.slots(pp),
            engine.freezer.num_groups, inplace=False, scaled=engine.weight_flags(pp),
        )  # fmt: skip
        try:
            out = gradient_pass(engine.freezer, call, active, mask)
        finally:
            engine.perturbation.restore_(pp, backup)
        del backup
        if finish_step(engine, call, out.scalars(), [], out.layer_norms, mask):
            # The gradient tensors themselves (after the optimizer's unscaling/clipping):
            # zero_grad(set_to_none=True) detaches them from .grad, no copy is made.
            for param, grad in zip(out.params, local(out.grads)):
                self.last_grad[id(param)] = grad

    def state_dict(self, index: dict[int, int]) -> dict[str, Any]:
        return {"last_grad": {index[k]: v for k, v in self.last_grad.items()}}

    def load_state_dict(self, state: dict[str, Any], tensors: list[Tensor]) -> None:
        self.last_grad = by_position(state.get("last_grad", {}), tensors)
