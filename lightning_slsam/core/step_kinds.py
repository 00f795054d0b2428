"""The kinds of training step, as strategies the engine runs.

A schedule names each step's kind (:mod:`lightning_slsam.core.schedules`); the engine looks
the kind up among the method's kinds and runs it with the step's
:class:`~lightning_slsam.core.step_parts.StepParts`:

* :class:`SAMStep` -- SAM's two passes: gradient, ascent, gradient at the perturbed
  weights, exact restore, update; a method plugs its own parts into it (ESAM's sample
  choice for the second pass, SSAM-F's ascent mask, LookSAM's store of the SAM gradient);
* :class:`PlainStep` -- one pass and the update (RST's plain steps);
* :class:`SingleStep` -- single-step SAM: one pass at weights perturbed along the previous
  step's gradient.

LookSAM's reuse step is a method's own kind
(:class:`~lightning_slsam.methods.looksam.LookSAMReuse`). A new kind of step is a new
:class:`StepKind` subclass that a method's specification supplies
(:meth:`~lightning_slsam.MethodSpec.step_kinds`) or that is handed to the engine
(``SparseSAMEngine(..., kinds={...})``); its state is saved with the engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import Tensor

from lightning_slsam.core.contract import ForwardBackward, PassOutput, StepCall
from lightning_slsam.core.freezing import by_position
from lightning_slsam.core.gradient_pass import gradient_pass
from lightning_slsam.core.perturbation import local_norms
from lightning_slsam.core.step_parts import StatefulPart, StepParts
from lightning_slsam.parallel.fsdp2 import local, shard_layout

__all__ = ["PlainStep", "SAMStep", "SingleStep", "StepKind"]


class StepKind(StatefulPart):
    """A kind of training step. :meth:`run` trains the layers in ``call.result.active_mask``
    and ends with :meth:`StepParts.commit <lightning_slsam.core.step_parts.StepParts.commit>`,
    which steps the optimizer or skips.

    Class attributes tell the engine how to draw for the kind: ``one_pass`` (the kind runs
    one gradient pass: the engine's ``dense_one_pass`` option trains every layer on it);
    :meth:`needs_every_layer` (this step must train every layer, e.g. single-step SAM's
    first step). Its state (:class:`~lightning_slsam.core.step_parts.StatefulPart`) is
    saved and loaded with the engine's.
    """

    one_pass: bool = False
    #: Whether the kind needs per-sample losses from the passes (ESAM's sample choice).
    needs_per_sample: bool = False

    def needs_every_layer(self) -> bool:
        """Whether this step trains every layer instead of the selection's draw."""
        return False

    def run(self, parts: StepParts, call: StepCall) -> None:
        raise NotImplementedError


class SampleChoice(Protocol):
    """Chooses the samples of the second pass (ESAM's sharpness-sensitive selection)."""

    def select(self, first: PassOutput, forward_backward: ForwardBackward) -> list[Tensor]: ...


class AscentMasks(Protocol):
    """Per-coordinate masks on the ascent (SSAM-F's Fisher mask)."""

    def masks_for(self, params: list[Tensor]) -> list[Tensor]: ...


#: Called after the second pass with the perturbed tensors, their first-pass gradients,
#: and the second pass's tensors and gradients (LookSAM's store).
AfterSecondPass = Callable[[list[Tensor], list[Tensor], list[Tensor], list[Tensor]], None]


class PlainStep(StepKind):
    """One gradient pass and the update."""

    one_pass = True

    def run(self, parts: StepParts, call: StepCall) -> None:
        mask = call.result.active_mask
        out = gradient_pass(parts.freezer, call, parts.activate(mask), mask)
        parts.commit(call, out.scalars(), [], out.layer_norms, mask)


class SAMStep(StepKind):
    """SAM's two passes, on the layers the selection drew.

    Args:
        samples: the second pass's samples (ESAM; ``None``: the whole batch).
        ascent_masks: per-coordinate masks on the ascent (SSAM-F; ``None``: every
            coordinate).
        after_second_pass: called with the perturbed tensors and both passes' gradients
            (LookSAM's store; ``None``: the first pass's gradients are freed before the
            second pass).
    """

    def __init__(
        self,
        samples: SampleChoice | None = None,
        ascent_masks: AscentMasks | None = None,
        after_second_pass: AfterSecondPass | None = None,
    ) -> None:
        self.samples = samples
        self.needs_per_sample = samples is not None
        self.ascent_masks = ascent_masks
        self.after_second_pass = after_second_pass

    def run(self, parts: StepParts, call: StepCall) -> None:
        freezer, mask1 = parts.freezer, call.result.active_mask
        with parts.isolation.sam_step() as isolated:
            # 1. The gradient at the current weights, on the drawn layers.
            first = gradient_pass(
                freezer, call, parts.activate(mask1), mask1, sync=parts.sync_first_pass
            )
            # 2. The layers the second pass trains (a selection may narrow the draw).
            selection = parts.selection
            mask2 = selection.refine(
                mask1, first.layer_norms.double().cpu() if selection.refine_uses_norms
                else None,
            )  # fmt: skip
            active2 = first.active if mask2 is mask1 else parts.activate(mask2)
            call.result.active_mask = mask2
            keep = {id(p) for p in active2}
            chosen = [i for i, p in enumerate(first.params) if id(p) in keep]
            pp = [first.params[i] for i in chosen]
            pg = [first.grads[i] for i in chosen]
            # 3. The ascent. A non-finite first pass is only detected at the end of the
            # step (checking here would cost a second host sync every step); the exact
            # restore undoes whatever a NaN perturbation did.
            keep_first = self.after_second_pass is not None
            backup = parts.perturbation.perturb_(
                pp, pg, first.norms[chosen], first.slots[chosen], freezer.num_groups,
                inplace=not keep_first,
                masks=self.ascent_masks.masks_for(pp) if self.ascent_masks is not None
                else None,
                scaled=parts.weight_flags(pp),
            )  # fmt: skip
            # Free the first-pass gradients before the next forward (unless kept).
            first.grads.clear()
            if not keep_first:
                pg = []
            call.zero_grad()
            isolated.first_pass_done()
            # 4. The gradient at the perturbed weights, then the exact restore.
            try:
                subsets = None
                if self.samples is not None:
                    with isolated.extra_forward():
                        subsets = self.samples.select(first.output, call.forward_backward)
                isolated.second_pass_starts()
                second = gradient_pass(freezer, call, active2, mask2, subsets=subsets)
            finally:
                parts.perturbation.restore_(pp, backup)
                isolated.step_done()
            del backup
        if self.after_second_pass is not None:
            self.after_second_pass(pp, pg, second.params, second.grads)
        # 5. The update with the second pass's gradients (or a skip).
        parts.commit(call, first.scalars(), second.scalars(), first.layer_norms, mask1)


class SingleStep(StepKind):
    """Single-step SAM: one pass at weights perturbed along each tensor's gradient from
    the last step it was trained in; the first step is a plain one on every layer."""

    def __init__(self) -> None:
        self.last_grad: dict[int, Tensor] = {}

    one_pass = True

    @property
    def ready(self) -> bool:
        """Whether a previous gradient exists (else the step is a dense plain one)."""
        return bool(self.last_grad)

    def needs_every_layer(self) -> bool:
        return not self.ready

    def run(self, parts: StepParts, call: StepCall) -> None:
        if not self.ready:  # the first step: a plain one on every layer
            call.result.kind = "plain"
        mask = call.result.active_mask
        active = parts.activate(mask)
        pp = [p for p in active if id(p) in self.last_grad]
        pg = [self.last_grad[id(p)] for p in pp]
        device = pp[0].device if pp else None
        # Stored as local shards (FSDP2): the params tell the layout.
        norms = local_norms(pg, shard_layout(pp), device)
        backup = parts.perturbation.perturb_(
            pp, pg, norms, parts.freezer.slots(pp),
            parts.freezer.num_groups, inplace=False, scaled=parts.weight_flags(pp),
        )  # fmt: skip
        try:
            out = gradient_pass(parts.freezer, call, active, mask)
        finally:
            parts.perturbation.restore_(pp, backup)
        del backup
        if parts.commit(call, out.scalars(), [], out.layer_norms, mask):
            # The gradient tensors themselves (after the optimizer's unscaling/clipping):
            # zero_grad(set_to_none=True) detaches them from .grad, no copy is made.
            for param, grad in zip(out.params, local(out.grads)):
                self.last_grad[id(param)] = grad

    def state_dict(self, index: dict[int, int]) -> dict[str, Any]:
        return {"last_grad": {index[k]: v for k, v in self.last_grad.items()}}

    def load_state_dict(self, state: dict[str, Any], tensors: list[Tensor]) -> None:
        self.last_grad = by_position(state.get("last_grad", {}), tensors)
