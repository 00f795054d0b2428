"""One training step of every method, as functions: :func:`sam_step` (two passes, the ascent,
the exact restore), :func:`plain_step` (one pass) and :func:`single_step` (one pass at weights
perturbed along known directions: S2-SAM, Momentum-SAM, ARWP). Each returns a :class:`Passed`;
:func:`commit` ends the step with one host transfer and the update, or a skip. A method adds
its :class:`MethodParts`; the stateful shell is :class:`~lightning_slsam.core.engine.SAMEngine`.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from lightning_slsam.core.isolation import PassIsolation, StepIsolation
from lightning_slsam.core.partition import LayerFreezer
from lightning_slsam.core.passes import LossOutput, PassOutput, PassRunner
from lightning_slsam.core.perturbation import BackupPool, SAMPerturbation
from lightning_slsam.parallel.ddp import GradientAverager, average_grads
from lightning_slsam.parallel.shards import Shards
from lightning_slsam.selection.rules import LayerSelection

__all__ = ["STEP_KINDS", "ExtraWork", "LoopHooks", "MethodParts", "Passed", "StepContext",
           "StepKind", "StepResult", "commit", "gradient_pass", "plain_step", "sam_step",
           "scale_update", "single_step"]  # fmt: skip

#: The kinds a step can be: SAM's two passes, one plain pass, LookSAM's reuse, single-step SAM.
StepKind = Literal["sam", "plain", "reuse", "single"]
STEP_KINDS: tuple[StepKind, ...] = ("sam", "plain", "reuse", "single")


@dataclass
class LoopHooks:
    """What the training loop hands a step.

    Attributes:
        forward_backward: runs one pass over the step's batch (a ``PassRunner``).
        zero_grad: sets every gradient to ``None``.
        optimizer_step: ``optimizer_step(skip)``; ``skip=True`` changes only step counters.
        grad_scale: returns a scaler's loss scale (device tensor) the norms are divided by.
        averager: averages gradients across processes (DDP); ``None`` on one process.
        check_draw: check on this step that every process drew the same layers.
        after_update: defers post-update work where the optimizer steps later (``None``: now).
        optimizer: the optimizer ``optimizer_step`` steps (or a wrapper).
    """

    forward_backward: PassRunner
    zero_grad: Callable[[], None]
    optimizer_step: Callable[[bool], None]
    grad_scale: Callable[[], Tensor] | None = None
    averager: GradientAverager | None = None
    check_draw: bool = False
    after_update: Callable[[Callable[[], None]], None] | None = None
    optimizer: Any = None


@dataclass(frozen=True)
class StepContext:
    """One step's surroundings, as the step functions and a method's hooks see them.

    Attributes:
        step: the step's 0-based count of optimizer steps (skipped ones included).
        loop: what the training loop handed the step.
        layers: the layers, frozen and unfrozen a draw at a time.
        isolation: what one pass may leave behind (``None``: nothing to isolate).
        shards: the :mod:`~lightning_slsam.parallel.shards` seam (whole tensors or FSDP2).
        planned: the run's planned optimizer steps (``math.inf``: not known).
        module: the model (``None`` where the engine was built without it).
    """

    step: int
    loop: LoopHooks
    layers: LayerFreezer
    isolation: PassIsolation | None
    shards: Shards
    planned: float = math.inf
    module: torch.nn.Module | None = None


class ExtraWork(NamedTuple):
    """What a hook ran outside the training passes: backward passes, bytes all-reduced."""

    backward: int = 0
    allreduce_bytes: int = 0


@dataclass
class StepResult:
    """What happened in one step (built once, by the engine, when the step has ended).

    Attributes:
        loss: first-pass loss, detached.
        active_mask: bool ``[num_layers]`` CPU mask of the layers the optimizer updated.
        trainable_numel: parameters that could take part (the ratios' denominator).
        kind: ``"sam"``, ``"plain"``, ``"reuse"`` or ``"single"``.
        pass_numel: parameters with a gradient in each training backward pass.
        extra_backward: backward passes outside the training passes (SSAM-F's Fisher).
        allreduce_bytes: bytes this process all-reduced across processes this step.
        skipped: whether the update was skipped; ``skip_reason`` says why.
        drawn: whether the selection drew the active set (not single-step SAM's first step).
        active_ratio: the paper's "Active Ratio", summed over passes (AdamW 1, SAM 2).
    """

    loss: Tensor | None
    active_mask: Tensor
    trainable_numel: int
    kind: StepKind
    pass_numel: list[int] = field(default_factory=list)
    extra_backward: int = 0
    allreduce_bytes: int = 0
    skipped: bool = False
    skip_reason: str | None = None
    drawn: bool = True
    active_ratio: float = 0.0

    @property
    def num_backward(self) -> int:
        """Backward passes run, extra ones included."""
        return len(self.pass_numel) + self.extra_backward

    @property
    def active_ratio_per_pass(self) -> list[float]:
        """Fraction of trainable parameters with a gradient, per training pass."""
        return [n / max(self.trainable_numel, 1) for n in self.pass_numel]


class MethodParts:
    """What a method adds to the shared steps; this base adds nothing (SAM on every step).

    Every hook takes the step's :class:`StepContext` first (which method uses each:
    docs/extending.md); per-tensor state is saved as dicts keyed by tensor position.
    """

    #: Whether the steps' losses must carry per-sample losses (ESAM's sample choice).
    needs_per_sample: bool = False
    #: Whether the SAM step keeps the first pass's gradients for :meth:`after_sam_step`.
    keeps_first_grads: bool = False
    #: Whether the engine keeps each update's gradients as the next directions (S2-SAM).
    keeps_last_grads: bool = True
    #: Whether :meth:`directions` returns tensors for this step alone, scaled in place.
    fresh_directions: bool = False
    #: Whether a one-pass step hands :meth:`after_update` its tensors and gradients.
    reads_update_grads: bool = False
    #: The :data:`~lightning_slsam.core.passes.OUTPUT_KEYS` :meth:`extra_loss` reads.
    needs_outputs: tuple[str, ...] = ()
    #: The method's name in messages.
    label: str = "the method"
    #: How a hook reports a warning (set by the engine's builder).
    warn: Callable[[str], None] = warnings.warn

    def kind(self, step: int) -> StepKind:
        """The kind of step ``step`` (0-based count of optimizer steps)."""
        return "sam"

    def check_optimizer(self, optimizer: Any) -> None:
        """Raise a ``ValueError`` naming the fix for an optimizer the method cannot use."""

    def before_step(self, ctx: StepContext) -> ExtraWork:
        """Run before the step's kind; returns the work it did outside the training passes."""
        return ExtraWork()

    def choose_samples(
        self, ctx: StepContext, first: PassOutput, isolated: StepIsolation | None
    ) -> list[Tensor] | None:
        """The second pass's samples, one index tensor per micro-batch (``None``: all), from the
        first pass's output (ESAM); an extra forward runs inside ``isolated.extra_forward()``."""
        return None

    def ascent_masks(self, ctx: StepContext, params: list[Tensor]) -> list[Tensor] | None:
        """A coordinate mask per perturbed tensor (``None``: the whole ascent; SSAM-F)."""
        return None

    def after_sam_step(self, ctx: StepContext, params: list[Tensor], first_grads: list[Tensor],
                       params2: list[Tensor], grads2: list[Tensor]) -> None:  # fmt: skip
        """After a SAM step's second pass: both passes' tensors and gradients (LookSAM)."""

    def adjust_grads(self, ctx: StepContext, params: list[Tensor], grads: list[Tensor]) -> None:
        """On a ``"reuse"`` step, change ``grads`` in place before the update (LookSAM)."""

    def directions(
        self, ctx: StepContext, params: Sequence[Tensor], last_grads: dict[int, Tensor]
    ) -> dict[int, Tensor]:
        """A ``"single"`` step's directions by ``id`` (empty: none yet); here ``last_grads``."""
        return last_grads

    def after_update(self, ctx: StepContext, params: list[Tensor], grads: list[Tensor]) -> None:
        """After a one-pass step's update (:attr:`reads_update_grads`): its tensors, gradients."""

    def extra_loss(self, ctx: StepContext, i: int, output: LossOutput) -> Tensor | None:
        """The term added to micro-batch ``i``'s loss before its backward (``None``: none)."""
        return None

    def state_dict(self, index: dict[int, int]) -> dict[str, Any]:
        """The parts' state; ``index`` maps ``id(tensor)`` to its position."""
        return {}

    def load_state_dict(self, state: dict[str, Any], tensors: list[Tensor]) -> None:
        """Restore :meth:`state_dict`'s output (``tensors``: the partition's, by position)."""


@dataclass
class _Pass:
    """One gradient pass's results (all on the device)."""

    output: PassOutput
    active: list[Tensor]
    params: list[Tensor]  # active tensors that received a gradient
    grads: list[Tensor]
    slots: Tensor  # each tensor's normalisation group
    norms: Tensor  # per-tensor gradient norms
    layer_norms: Tensor  # per-layer gradient norms
    numel: int  # parameters the pass trained
    allreduce_bytes: int  # bytes it all-reduced


@dataclass
class Passed:
    """What a step function computed, for :func:`commit` to end the step with.

    Attributes:
        first: the first pass's scalars (its loss, a finiteness probe of its gradients).
        second: the second pass's (empty for a step of one pass).
        layer_norms: the first pass's per-layer gradient norms.
        update_mask: the layers drawn for the first pass, which the selection learns about.
        active_mask: the layers the update trains.
        pass_numel: parameters with a gradient in each pass.
        allreduce_bytes: bytes the passes all-reduced across processes.
        kept: tensors and gradients to keep once the update is made (``None``: none).
    """

    first: list[Tensor]
    second: list[Tensor]
    layer_norms: Tensor
    update_mask: Tensor
    active_mask: Tensor
    pass_numel: list[int]
    allreduce_bytes: int
    kept: tuple[list[Tensor], list[Tensor]] | None = None


def gradient_pass(ctx: StepContext, active: list[Tensor], mask: Tensor,
                  subsets: list[Tensor] | None = None, sync: bool = True) -> _Pass:  # fmt: skip
    """One forward/backward on ``active``; under DDP averages gradients (``sync``) or norms."""
    loop, layers, shards = ctx.loop, ctx.layers, ctx.shards
    loop.zero_grad()
    fb = loop.forward_backward
    output = fb(subsets=subsets) if subsets else fb()
    sent = 0
    averager = None if shards.sharded else loop.averager
    if averager is not None and sync:
        sent += average_grads(active, averager)
    params = [p for p in active if p.grad is not None]  # a tensor the forward skipped: norm 0
    grads = [p.grad for p in params]
    slots = layers.slots(params)
    norms = shards.norms(grads, output.loss.device)  # type: ignore[arg-type]
    layer_norms = layers.layer_norms(norms, slots)
    if averager is not None and not sync:
        sent += averager.average_([layer_norms])
    return _Pass(output, active, params, grads, slots, norms, layer_norms,  # type: ignore[arg-type]
                 layers.numel(mask), sent)  # fmt: skip


def sam_step(ctx: StepContext, mask: Tensor, *, selection: LayerSelection,
             perturbation: SAMPerturbation, parts: MethodParts,
             sync_first_pass: bool) -> Passed:  # fmt: skip
    """SAM's two passes on the layers in ``mask``."""
    layers, shards = ctx.layers, ctx.shards
    iso = ctx.isolation.begin() if ctx.isolation is not None else None
    # 1. The gradient at the current weights, on the drawn layers.
    first = gradient_pass(ctx, layers.activate(mask), mask, sync=sync_first_pass)
    # 2. The layers the second pass trains (a selection may narrow or widen the draw).
    mask2, active2 = mask, first.active
    if selection.refines:
        norms = first.layer_norms.double().cpu() if selection.refine_uses_norms else None
        mask2 = selection.refine(mask, norms)
        active2 = layers.activate(mask2)
    keep = {id(p) for p in active2}
    chosen = [i for i, p in enumerate(first.params) if id(p) in keep]
    pp = [first.params[i] for i in chosen]
    pg = [first.grads[i] for i in chosen]
    # 3. The ascent. A NaN first pass is caught in commit; the exact restore undoes it.
    keep_first = parts.keeps_first_grads
    backup = perturbation.perturb_(
        pp, pg, first.norms[chosen], first.slots[chosen], layers.num_groups,
        inplace=not keep_first, masks=parts.ascent_masks(ctx, pp),
        scaled=layers.weight_flags(pp) if perturbation.adaptive else None, shards=shards,
    )  # fmt: skip
    # Free the first-pass gradients before the next forward (unless kept).
    first.grads.clear()
    if not keep_first:
        pg = []
    ctx.loop.zero_grad()
    if iso is not None:
        iso.first_pass_done()
    # 4. The gradient at the perturbed weights, then the exact restore.
    try:
        subsets = parts.choose_samples(ctx, first.output, iso)
        if iso is not None:
            iso.second_pass_starts()
        second = gradient_pass(ctx, active2, mask2, subsets=subsets)
    finally:
        perturbation.restore_(pp, backup, shards)
        if iso is not None:
            iso.step_done()
    del backup
    parts.after_sam_step(ctx, pp, pg, second.params, second.grads)
    # 5. The update with the second pass's gradients (or a skip): the engine's commit.
    return Passed(
        [first.output.loss, first.norms.sum()], [second.output.loss, second.norms.sum()],
        first.layer_norms, mask, mask2, [first.numel, second.numel],
        first.allreduce_bytes + second.allreduce_bytes,
    )  # fmt: skip


def plain_step(
    ctx: StepContext, mask: Tensor, *, parts: MethodParts, reuse: bool = False,
    keep: bool = False,
) -> Passed:  # fmt: skip
    """One pass on ``mask``'s layers (``reuse``: the method adjusts grads; ``keep``: kept)."""
    out = gradient_pass(ctx, ctx.layers.activate(mask), mask)
    if reuse:
        parts.adjust_grads(ctx, out.params, out.grads)
    return _one_pass(out, mask, keep)


def single_step(ctx: StepContext, mask: Tensor, *, perturbation: SAMPerturbation,
                directions: dict[int, Tensor], keep: bool = False,
                fresh: bool = False) -> Passed:  # fmt: skip
    """One pass at weights perturbed along ``directions`` (by ``id``), restored exactly before
    the update. ``keep``: return tensors and gradients; ``fresh``: scale directions in place."""
    layers, shards = ctx.layers, ctx.shards
    active = layers.activate(mask)
    pp = [p for p in active if id(p) in directions]
    pg = [directions[id(p)] for p in pp]
    device = pp[0].device if pp else None
    # Stored as local shards (FSDP2): the params tell the layout.
    unscaled = perturbation.norm == "none"
    norms = torch.zeros(0, device=device) if unscaled else shards.norms(pg, device, like=pp)
    backup = perturbation.perturb_(
        pp, pg, norms, layers.slots(pp), layers.num_groups, inplace=fresh,
        scaled=layers.weight_flags(pp) if perturbation.adaptive else None, shards=shards,
    )  # fmt: skip
    try:
        out = gradient_pass(ctx, active, mask)
    finally:
        perturbation.restore_(pp, backup, shards)
    del backup
    return _one_pass(out, mask, keep)


def _one_pass(out: _Pass, mask: Tensor, keep: bool) -> Passed:
    kept = (out.params, out.grads) if keep else None
    return Passed([out.output.loss, out.norms.sum()], [], out.layer_norms, mask, mask,
                  [out.numel], out.allreduce_bytes, kept)  # fmt: skip


def commit(ctx: StepContext, passed: Passed, inclusion: Tensor | None, *,
           update_scale: float | None,
           pool: BackupPool) -> tuple[str | None, int, Tensor | None]:  # fmt: skip
    """End the step with one host transfer: the update, scaled by ``inclusion`` (``None``: no
    scaling), or a skip. Scalars are averaged first, so every process decides alike.

    Returns:
        why the update was skipped (``None``: it was made), the bytes all-reduced doing so,
        and, if updated, the first pass's per-layer norms (float64, CPU, unscaled).
    """
    loop, layers = ctx.loop, ctx.layers
    first, second, layer_norms = passed.first, passed.second, passed.layer_norms
    device = layer_norms.device
    scalars = torch.stack([s.detach().float().reshape(()).to(device) for s in (*first, *second)])
    sent = loop.averager.average_([scalars]) if loop.averager is not None else 0
    if loop.grad_scale is not None:
        # The selection learns from true gradient norms, not loss-scaled ones.
        layer_norms = layer_norms / loop.grad_scale().to(device).float()
    host = torch.cat([scalars, layer_norms.float()]).cpu()
    finite = torch.isfinite(host)
    k1, k = len(first), len(scalars)
    where = " in the first pass" if second else ""
    if not bool(finite[:k1].all()) or not bool(finite[k:].all()):
        reason = f"non-finite loss or gradient{where}"
    elif not bool(finite[k1:k].all()):
        reason = "non-finite loss or gradient in the second pass"
    else:
        # Update scaling: a layer drawn with probability q moves min(1/q, cap) times as far.
        scaled: list[Tensor] = []
        extra: list[float] = []
        if inclusion is not None and update_scale is not None:
            factors = (1.0 / inclusion.clamp(min=1e-300)).clamp(max=update_scale)
            for on, factor, group in zip(
                passed.active_mask.tolist(), factors.tolist(), layers.partition.params
            ):
                if on and factor > 1.0:
                    scaled.extend(group)
                    extra.extend([factor - 1.0] * len(group))
        if scaled:
            scaled = ctx.shards.local(scaled)  # FSDP2: each process scales its own shards
            before = pool.copy(scaled)
        loop.optimizer_step(False)
        if scaled:
            update = functools.partial(scale_update, scaled, before, extra)
            loop.after_update(update) if loop.after_update is not None else update()
        return None, sent, host[k:].double()
    loop.zero_grad()
    warnings.warn(
        f"SL-SAM skipped step {ctx.step}: {reason}. Weights, optimizer state and"
        " layer selection are unchanged.",
        RuntimeWarning,
        stacklevel=3,
    )
    loop.optimizer_step(True)
    return reason, sent, None


def scale_update(params: list[Tensor], before: list[Tensor], factors: list[float]) -> None:
    """``w <- w + (f - 1) (w - w0)``, ``w0`` in ``before`` (overwritten), ``factors``: ``f - 1``."""
    with torch.no_grad():
        torch._foreach_sub_(before, params)
        torch._foreach_mul_(before, factors)
        torch._foreach_sub_(params, before)
