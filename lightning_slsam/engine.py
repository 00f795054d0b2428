"""One training step of any SAM method of the plugin, in plain PyTorch.

:class:`SparseSAMEngine` knows nothing of Lightning. A method is three parts:

* a **selection** (:mod:`lightning_slsam.selection`): which layers the first pass
  computes, which the second pass computes and the optimizer updates;
* a **perturbation** (:mod:`lightning_slsam.perturbation`): the ascent on those layers;
* a **schedule** (:mod:`lightning_slsam.schedules`): what kind each step is (SAM, plain,
  LookSAM reuse, single-step).

Optionally ESAM's sharpness-sensitive data selection (``data_ratio < 1``) and SSAM-F's
Fisher mask (``fisher``). The engine is given callables and runs the step around them:

* ``forward_backward(subsets=None, backward=True)`` computes the loss on the current
  batch (each micro-batch ``i`` restricted to the sample indices ``subsets[i]`` when
  given, skipped when that index tensor is empty), back-propagates it when ``backward``
  and returns it detached -- as a tensor, or as a :class:`PassOutput` carrying per-sample
  losses (needed by ESAM's data selection). Methods that address single samples (ESAM,
  SSAM-F) also read its ``batch_sizes`` attribute. Simple callables without arguments
  serve every other method;
* ``zero_grad()`` sets every gradient to ``None``;
* ``optimizer_step(skip)`` steps the base optimizer (``skip=True``: every gradient is
  ``None`` and nothing may change, but per-step counters such as Lightning's
  ``global_step`` still advance).

Layers outside the active set get ``requires_grad=False`` before each forward, so autograd
builds no weight-gradient work for them, their ``.grad`` stays ``None`` and the optimizer
leaves them (and their state) untouched. Every step synchronises with the host once, at
its end: losses, a finiteness probe and the per-layer norms travel together; a non-finite
value skips the step with the weights restored exactly and nothing else changed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_slsam.distributed import GradientAverager
from lightning_slsam.layers import LayerPartition
from lightning_slsam.perturbation import (
    FisherMask,
    SAMPerturbation,
    group_norms,
    is_weight_name,
    tensor_norms,
)
from lightning_slsam.running import BN_STATS, RandomState, RunningStats
from lightning_slsam.schedules import EveryStep, IntervalSchedule, Schedule
from lightning_slsam.selection import LayerSelection

__all__ = ["PassOutput", "SparseSAMEngine", "StepContext", "StepResult"]


@dataclass
class PassOutput:
    """What ``forward_backward`` returns when it has more than the loss to report.

    Attributes:
        loss: the detached (scalar) loss of the pass.
        per_sample: detached per-sample losses, one tensor per micro-batch, if known.
    """

    loss: Tensor
    per_sample: list[Tensor | None] | None = None


@dataclass
class StepContext:
    """How the surrounding trainer scales gradients and talks to other processes.

    Attributes:
        grad_scale: returns the current loss scale of a gradient scaler (a tensor on the
            gradients' device) when one is in use: the per-layer norms the selection learns
            from are divided by it. Everything else SAM computes is scale-free.
        averager: averages gradients across processes (DDP); ``None`` on one process.
    """

    grad_scale: Callable[[], Tensor] | None = None
    averager: GradientAverager | None = None


@dataclass
class StepResult:
    """What happened in one step.

    Attributes:
        loss: first-pass loss, detached.
        active_mask: bool ``[num_layers]`` CPU mask of the layers the optimizer updated.
        pass_numel: parameters with a gradient in each training backward pass.
        trainable_numel: parameters that could take part (the ratios' denominator).
        kind: ``"sam"``, ``"plain"``, ``"reuse"`` or ``"single"``.
        extra_backward: backward passes outside the training passes (SSAM-F's Fisher).
        allreduce_bytes: bytes this process all-reduced across processes this step.
        skipped: whether the update was skipped; ``skip_reason`` says why.
        drawn: whether the selection drew the active set. A forced dense step (the plain
            first step of single-step SAM) is not a draw, and the selection does not learn
            from it.
    """

    loss: Tensor | None
    active_mask: Tensor
    trainable_numel: int
    kind: str
    pass_numel: list[int] = field(default_factory=list)
    extra_backward: int = 0
    allreduce_bytes: int = 0
    skipped: bool = False
    skip_reason: str | None = None
    drawn: bool = True

    @property
    def num_backward(self) -> int:
        """Backward passes run, extra ones included."""
        return len(self.pass_numel) + self.extra_backward

    @property
    def active_ratio_per_pass(self) -> list[float]:
        """Fraction of trainable parameters with a gradient, per training pass."""
        return [n / max(self.trainable_numel, 1) for n in self.pass_numel]

    @property
    def active_ratio(self) -> float:
        """The SL-SAM paper's "Active Ratio": that fraction summed over the training passes
        (plain AdamW 1.0, SAM 2.0)."""
        return sum(self.active_ratio_per_pass)


class SparseSAMEngine:
    """Runs SAM-method steps over a :class:`LayerPartition` (pure PyTorch).

    Args:
        partition: the layers, from :func:`~lightning_slsam.layers.build_partition`.
        selection: the layer-selection rule (a :class:`~lightning_slsam.LayerBandit` for
            SL-SAM).
        perturbation: the ascent applied to the perturbed tensors.
        schedule: the kind of each step (default: SAM on every step).
        data_ratio: ESAM's sharpness-sensitive data selection: the second pass runs on
            this fraction of each batch, the samples whose loss rose most under the
            perturbation (1.0, the default, disables it).
        fisher: SSAM-F's coordinate mask, refreshed on its own schedule.
        module: the model, whose normalisation layers' running statistics are managed.
        bn_stats: which pass's running statistics a two-pass step keeps: ``"first"``
            (default: the unperturbed pass, as official SAM implementations do),
            ``"second"`` (the perturbed pass) or ``"both"`` (updated twice, as the SL-SAM
            reference code does). Extra forwards (ESAM's selection, SSAM-F's Fisher) never
            count.
        replay_dropout: replay the first pass's random state in the second pass, so both
            see the same dropout masks (default ``False``: fresh masks, as official SAM).
        sync_first_pass: under multi-process training, average the first pass's gradients
            before the ascent (default). ``False`` perturbs every process with its own
            gradient (SAM's m-sharpness): no first-pass gradient traffic, only the
            per-layer norm vector is averaged.
        dense_one_pass: the steps that run one pass ("plain" and "reuse" kinds) train
            every layer instead of the selection's draw (default ``False``).
        update_scale: inverse-inclusion update scaling (beyond the paper; ``None``, the
            default, disables it). On a step whose layers the selection drew, each active
            layer's update -- the change the optimizer made to its weights -- is multiplied
            by ``min(1 / q, update_scale)``, with ``q`` the probability that the layer was
            drawn (:meth:`~lightning_slsam.selection.LayerSelection.inclusion`). A layer
            active in a fraction ``q`` of the steps then moves, in expectation, as far as
            it would if it were trained every step. Must be ``>= 1``.

    Attributes:
        counts: steps in which each layer was updated (int64, CPU).
        norm_sums, norm_counts: sum and number of the first-pass gradient norms measured
            for each layer (the selection's input; :meth:`mean_norms`).
        num_steps: steps run, skipped ones included; ``num_skipped``: skipped ones.
        kind_counts: steps of each kind (skipped ones excluded).
        active_ratio_sum: sum over non-skipped steps of :attr:`StepResult.active_ratio`.
        last_result: the latest :class:`StepResult`.
    """

    def __init__(
        self,
        partition: LayerPartition,
        selection: LayerSelection,
        perturbation: SAMPerturbation,
        schedule: Schedule | None = None,
        data_ratio: float = 1.0,
        fisher: FisherMask | None = None,
        module: torch.nn.Module | None = None,
        bn_stats: str = "first",
        replay_dropout: bool = False,
        sync_first_pass: bool = True,
        check_masks: bool = False,
        dense_one_pass: bool = False,
        update_scale: float | None = None,
    ) -> None:
        if update_scale is not None and not (
            isinstance(update_scale, (int, float)) and 1.0 <= update_scale < float("inf")
        ):
            raise ValueError(
                f"`update_scale` must be None or a finite number >= 1, got {update_scale!r}."
            )
        if not (isinstance(data_ratio, (int, float)) and 0 < data_ratio <= 1):
            raise ValueError(f"`data_ratio` must be in (0, 1], got {data_ratio!r}.")
        if bn_stats not in BN_STATS:
            raise ValueError(f"`bn_stats` must be one of {BN_STATS}, got {bn_stats!r}.")
        self.partition = partition
        self.selection = selection
        self.perturbation = perturbation
        self.schedule = schedule if schedule is not None else EveryStep()
        self.data_ratio = float(data_ratio)
        self.fisher = fisher
        self.running_stats = RunningStats(module) if module is not None else None
        self.bn_stats = bn_stats
        self.replay_dropout = bool(replay_dropout)
        self.sync_first_pass = bool(sync_first_pass)
        self.check_masks = bool(check_masks)
        self.dense_one_pass = bool(dense_one_pass)
        self.update_scale = None if update_scale is None else float(update_scale)
        # This step's inclusion probabilities, when its update is scaled.
        self._inclusion: Tensor | None = None
        self._context = StepContext()
        n = partition.num_layers
        self.counts = torch.zeros(n, dtype=torch.int64)
        self.norm_sums = torch.zeros(n, dtype=torch.float64)
        self.norm_counts = torch.zeros(n, dtype=torch.int64)
        self.num_steps = 0
        self.num_skipped = 0
        self.kind_counts: dict[str, int] = {}
        self.active_ratio_sum = 0.0
        self.last_result: StepResult | None = None
        # Single-step SAM: each tensor's last gradient; LookSAM: its stored g_v.
        self.last_grad: dict[int, Tensor] = {}
        self.vertical: dict[int, Tensor] = {}
        self._layer_numel = torch.tensor(partition.numel, dtype=torch.int64)
        self._always_numel = sum(p.numel() for p in partition.always_active)
        # Normalisation groups: one per layer, then one per always-active tensor.
        self._slot = {id(p): i for i, group in enumerate(partition.params) for p in group}
        self._slot.update({id(p): n + j for j, p in enumerate(partition.always_active)})
        self._num_groups = n + len(partition.always_active)
        self._all = torch.ones(n, dtype=torch.bool)
        # ASAM scales weight tensors only (biases are perturbed unscaled).
        flat_names = [name for group in partition.param_names for name in group]
        named = [*zip(partition.flat_params, flat_names)]
        named += [*zip(partition.always_active, partition.always_active_names)]
        self._weights = {id(p) for p, name in named if is_weight_name(name)}

    def _scaled(self, params: list[Tensor]) -> list[bool] | None:
        """ASAM's per-tensor scaling flags (``None`` unless the perturbation is adaptive)."""
        if not self.perturbation.adaptive:
            return None
        return [id(p) in self._weights for p in params]

    # -- freezing -------------------------------------------------------------------
    def activate(self, mask: Tensor) -> list[Tensor]:
        """Make exactly the layers in ``mask`` (plus always-active tensors) trainable.

        Returns the active tensors, always-active ones first.
        """
        active: list[Tensor] = list(self.partition.always_active)
        for param in self.partition.always_active:
            param.requires_grad_(True)
        for param in self.partition.always_frozen:
            param.requires_grad_(False)
        for on, group in zip(mask.tolist(), self.partition.params):
            for param in group:
                if param.requires_grad != on:
                    param.requires_grad_(on)
            if on:
                active.extend(group)
        return active

    def release(self) -> None:
        """Make every partition tensor trainable again (the state outside a step)."""
        for param in self.partition.flat_params:
            if not param.requires_grad:
                param.requires_grad_(True)
        for param in self.partition.always_frozen:
            param.requires_grad_(True)

    def _numel(self, mask: Tensor) -> int:
        return int(self._layer_numel[mask].sum()) + self._always_numel

    # -- the step ---------------------------------------------------------------------
    def step(
        self,
        forward_backward: Callable[..., Tensor | PassOutput],
        zero_grad: Callable[[], None],
        optimizer_step: Callable[[bool], None],
        context: StepContext | None = None,
    ) -> StepResult:
        """Run one training step of the configured method (``context``: gradient scaling
        and multi-process averaging, when the trainer uses them)."""
        self._context = context if context is not None else StepContext()
        kind = self.schedule.kind(self.num_steps)
        # Single-step SAM has no previous gradient at first: a plain step on every layer,
        # whose gradients the next steps perturb along. With dense_one_pass, the steps of
        # a schedule that run one pass (RST's plain steps, LookSAM's reuse steps) train
        # every layer too. The selection draws (and learns) on the other steps only.
        warmup = kind == "single" and not self.last_grad
        forced = warmup or (self.dense_one_pass and kind in ("plain", "reuse"))
        mask = self._all.clone() if forced else self.selection.sample()
        scaled = self.update_scale is not None and not forced
        self._inclusion = self.selection.inclusion() if scaled else None
        if self.check_masks and self._context.averager is not None:
            self._check_same_draw(mask, kind)
        result = StepResult(None, mask, self.partition.trainable_numel, kind, drawn=not forced)
        try:
            if self.fisher is not None and self.fisher.due(self.num_steps):
                self._refresh_fisher(forward_backward, zero_grad, result)
            run = {"sam": self._sam, "single": self._single}.get(kind, self._one_pass)
            run(result, forward_backward, zero_grad, optimizer_step)
            if warmup:
                result.kind = "plain"
        finally:
            self.release()
        self.num_steps += 1
        if result.skipped:
            self.num_skipped += 1
        else:
            self.counts += result.active_mask.to(torch.int64)
            self.active_ratio_sum += result.active_ratio
            self.kind_counts[result.kind] = self.kind_counts.get(result.kind, 0) + 1
        self.last_result = result
        return result

    def train_step(
        self,
        compute_loss: Callable[..., Tensor],
        optimizer: torch.optim.Optimizer,
        batch_size: int | None = None,
    ) -> StepResult:
        """One step in a plain PyTorch loop.

        Args:
            compute_loss: runs the forward pass on the current batch and returns the loss
                (called once per pass; back-propagation is done here). Methods that
                address single samples (ESAM's data selection, SSAM-F) call it as
                ``compute_loss(index)`` with a tensor of sample indices, and ESAM needs it
                to return per-sample losses (a 1-D tensor; it is averaged for the update).
            optimizer: the base optimizer; not stepped at all when the step is skipped.
            batch_size: samples in the batch (needed by ESAM and SSAM-F).
        """

        def forward_backward(subsets: list[Tensor] | None = None, backward: bool = True):
            index = subsets[0] if subsets else None
            if index is not None and index.numel() == 0:
                return PassOutput(torch.zeros(()), [None])
            with torch.set_grad_enabled(backward and torch.is_grad_enabled()):
                loss = compute_loss() if index is None else compute_loss(index)
            per_sample = loss.detach() if loss.dim() == 1 else None
            loss = loss.mean() if loss.dim() == 1 else loss
            if backward and loss.requires_grad:  # False when no active layer reaches it
                loss.backward()
            return PassOutput(loss.detach(), [per_sample])

        forward_backward.batch_sizes = [batch_size] if batch_size else []  # type: ignore[attr-defined]

        def optimizer_step(skip: bool) -> None:
            if not skip:
                optimizer.step()

        return self.step(
            forward_backward, lambda: optimizer.zero_grad(set_to_none=True), optimizer_step
        )

    # -- step kinds ------------------------------------------------------------------------
    def _sam(self, result, forward_backward, zero_grad, optimizer_step) -> None:
        mask1 = result.active_mask
        stats = self.running_stats if self.running_stats else None
        before = stats.snapshot() if stats and self.bn_stats == "second" else None
        rng = RandomState() if self.replay_dropout else None
        first = self._gradient_pass(
            result, self.activate(mask1), mask1, forward_backward, zero_grad,
            sync=self.sync_first_pass,
        )  # fmt: skip
        refine_norms = (
            first.layer_norms.double().cpu() if self.selection.refine_uses_norms else None
        )
        mask2 = self.selection.refine(mask1, refine_norms)
        active2 = first.active if mask2 is mask1 else self.activate(mask2)
        result.active_mask = mask2
        keep = {id(p) for p in active2}
        chosen = [i for i, p in enumerate(first.params) if id(p) in keep]
        pp = [first.params[i] for i in chosen]
        pg = [first.grads[i] for i in chosen]
        looksam = isinstance(self.schedule, IntervalSchedule) and self.schedule.alpha > 0
        masks = self.fisher.masks_for(pp) if self.fisher is not None else None
        # A non-finite first pass is only detected at the end of the step: checking here
        # would cost a second host synchronisation every step, and the exact restore
        # undoes whatever a NaN perturbation did.
        backup = self.perturbation.perturb_(
            pp, pg, first.norms[chosen], first.slots[chosen], self._num_groups,
            inplace=not looksam, masks=masks, scaled=self._scaled(pp),
        )  # fmt: skip
        # Free the first-pass gradients before the next forward; LookSAM alone keeps them.
        first.grads.clear()
        if not looksam:
            pg = []
        zero_grad()
        after_first = stats.snapshot() if stats and self.bn_stats == "first" else None
        try:
            subsets = None
            if self.data_ratio < 1:
                if rng is not None:
                    rng.restore()
                selection_snapshot = stats.snapshot() if stats else None
                subsets = self._sharpest_samples(first.output, forward_backward)
                if selection_snapshot is not None:
                    stats.restore(selection_snapshot)  # the selection forward never counts
            if before is not None:
                stats.restore(before)  # only the second pass's statistics count
            if rng is not None:
                rng.restore()  # the second pass draws the first pass's dropout masks
            second = self._gradient_pass(
                result, active2, mask2, forward_backward, zero_grad, subsets=subsets
            )
        finally:
            self.perturbation.restore_(pp, backup)
            if after_first is not None:
                stats.restore(after_first)  # only the first pass's statistics count
        del backup
        if looksam:
            self._store_vertical(pp, pg, second.params, second.grads)
        self._finish(result, first.scalars(), second.scalars(), first.layer_norms, mask1,
                     zero_grad, optimizer_step)  # fmt: skip

    def _check_same_draw(self, mask: Tensor, kind: str) -> None:
        """Debug mode under DDP: every process must draw the same layers and step kind.

        Two checksums of the mask and the kind are gathered from every process (one small
        collective); on a mismatch every process raises the same error before touching a
        weight, instead of hanging in a gradient all-reduce of different tensors.
        """
        averager = self._context.averager
        assert averager is not None
        index = torch.arange(1, mask.numel() + 1, dtype=torch.int64, device=mask.device)
        bits = mask.to(torch.int64)
        kinds = ("sam", "plain", "reuse", "single")
        code = kinds.index(kind) if kind in kinds else len(kinds)
        value = torch.stack([(bits * index).sum(), (bits * (index * index % 1_000_003)).sum(),
                             bits.sum() * 8 + code])  # fmt: skip
        seen = averager.gather(value).cpu()
        differ = [rank for rank in range(len(seen)) if not torch.equal(seen[rank], seen[0])]
        if differ:
            counts = seen[:, 2] // 8
            raise RuntimeError(
                f"check_masks: at step {self.num_steps} process(es) {differ} drew other layers"
                f" or another step kind than process 0 (active layers per process:"
                f" {counts.tolist()}). The processes' selection generators have diverged:"
                " keep the callback's `seed` the same on every process (the default, None,"
                " takes the `seed_everything` seed of rank 0) and do not draw from the"
                " callback's generators yourself."
            )

    def _one_pass(self, result, forward_backward, zero_grad, optimizer_step) -> None:
        mask = result.active_mask
        out = self._gradient_pass(result, self.activate(mask), mask, forward_backward, zero_grad)
        if result.kind == "reuse":
            self._add_vertical(out.params, out.grads)
        self._finish(result, out.scalars(), [], out.layer_norms, mask, zero_grad, optimizer_step)

    def _single(self, result, forward_backward, zero_grad, optimizer_step) -> None:
        mask = result.active_mask
        active = self.activate(mask)
        pp = [p for p in active if id(p) in self.last_grad]
        pg = [self.last_grad[id(p)] for p in pp]
        slots = torch.tensor([self._slot[id(p)] for p in pp], dtype=torch.long)
        device = pp[0].device if pp else None
        backup = self.perturbation.perturb_(
            pp, pg, tensor_norms(pg, device), slots, self._num_groups, inplace=False,
            scaled=self._scaled(pp),
        )  # fmt: skip
        try:
            out = self._gradient_pass(result, active, mask, forward_backward, zero_grad)
        finally:
            self.perturbation.restore_(pp, backup)
        del backup
        if self._finish(result, out.scalars(), [], out.layer_norms, mask, zero_grad,
                        optimizer_step):  # fmt: skip
            # The gradient tensors themselves (after the optimizer's unscaling/clipping):
            # zero_grad(set_to_none=True) detaches them from .grad, no copy is made.
            for param, grad in zip(out.params, out.grads):
                self.last_grad[id(param)] = grad

    def _gradient_pass(
        self, result, active, mask, forward_backward, zero_grad, subsets=None, sync=True
    ) -> _Pass:
        """One forward/backward on the ``active`` tensors; gradients and norms kept on device.

        Under multi-process training the gradients are averaged across processes first
        (``sync``); otherwise the per-layer norms alone are.
        """
        zero_grad()
        output = _as_output(forward_backward(subsets=subsets) if subsets else forward_backward())
        if result.loss is None:
            result.loss = output.loss
        result.pass_numel.append(self._numel(mask))
        averager = self._context.averager
        if averager is not None and sync:
            result.allreduce_bytes += self._average_grads(active, averager)
        params, grads, slots = self._with_grad(active)
        norms = tensor_norms(grads, output.loss.device)
        layer_norms = self._layer_norms(norms, slots)
        if averager is not None and not sync:
            result.allreduce_bytes += averager.average_([layer_norms])
        return _Pass(output, active, params, grads, slots, norms, layer_norms)

    @torch.no_grad()
    def _average_grads(self, active: list[Tensor], averager: GradientAverager) -> int:
        """Average the active tensors' gradients across processes.

        Every process sends every active tensor (the sets are equal on all ranks), a zero
        gradient standing in for a missing one; a presence flag per tensor travels in the
        same collective, so a tensor no process used keeps ``grad=None``, as on one process.
        """
        if not active:
            return 0
        present = torch.tensor(
            [p.grad is not None for p in active], dtype=active[0].dtype, device=active[0].device
        )
        grads = []
        for param in active:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        sent = averager.average_([*grads, present])
        for param, flag in zip(active, present.tolist()):
            if flag == 0:
                param.grad = None
        return sent

    # -- pieces ------------------------------------------------------------------------------
    def _finish(
        self, result, first, second, layer_norms, update_mask, zero_grad, optimizer_step
    ) -> bool:
        """The step's one host transfer, then either the update or a skip.

        ``first`` / ``second``: scalars (loss, gradient-norm probe) of each pass.
        """
        device = layer_norms.device
        scalars = torch.stack(
            [s.detach().float().reshape(()).to(device) for s in (*first, *second)]
        )
        if self._context.averager is not None:
            # Every process must take the same decision: one non-finite value anywhere
            # makes the mean non-finite everywhere.
            result.allreduce_bytes += self._context.averager.average_([scalars])
        if self._context.grad_scale is not None:
            # The selection learns from true gradient norms, not loss-scaled ones.
            layer_norms = layer_norms / self._context.grad_scale().to(device).float()
        host = torch.cat([scalars, layer_norms.float()]).cpu()
        finite = torch.isfinite(host)
        k1, k = len(first), len(scalars)
        where = " in the first pass" if second else ""
        if not bool(finite[:k1].all()) or not bool(finite[k:].all()):
            reason = f"non-finite loss or gradient{where}"
        elif not bool(finite[k1:k].all()):
            reason = "non-finite loss or gradient in the second pass"
        else:
            scaled = self._before_scaled_update(result.active_mask)
            optimizer_step(False)
            if scaled is not None:
                self._scale_update(*scaled)
            norms = host[k:].double()
            self.norm_sums += torch.where(update_mask, norms, 0.0)
            self.norm_counts += update_mask.to(torch.int64)
            if result.drawn:
                self.selection.update(update_mask, norms)
            return True
        result.skipped = True
        result.skip_reason = reason
        zero_grad()
        warnings.warn(
            f"SL-SAM skipped step {self.num_steps}: {reason}. Weights, optimizer state and"
            " layer selection are unchanged.",
            RuntimeWarning,
            stacklevel=4,
        )
        optimizer_step(True)
        return False

    def _before_scaled_update(
        self, mask: Tensor
    ) -> tuple[list[Tensor], list[Tensor], list[float]] | None:
        """With ``update_scale``: the drawn tensors whose update is scaled, a copy of their
        weights before the optimizer step, and each one's factor minus 1."""
        if self._inclusion is None or self.update_scale is None:
            return None
        factors = (1.0 / self._inclusion.clamp(min=1e-300)).clamp(max=self.update_scale)
        params: list[Tensor] = []
        extra: list[float] = []
        for on, factor, group in zip(mask.tolist(), factors.tolist(), self.partition.params):
            if on and factor > 1.0:
                params.extend(group)
                extra.extend([factor - 1.0] * len(group))
        if not params:
            return None
        # The perturbation's backup was restored before this point: its pool is free.
        return params, self.perturbation.pool.copy(params), extra

    @staticmethod
    @torch.no_grad()
    def _scale_update(params: list[Tensor], before: list[Tensor], extra: list[float]) -> None:
        """``w <- w + (f - 1) * (w - w_before)``: the optimizer's change times ``f``."""
        torch._foreach_sub_(before, params)  # w_before - w
        torch._foreach_mul_(before, extra)  # (f - 1) * (w_before - w)
        torch._foreach_sub_(params, before)

    def _with_grad(self, active: list[Tensor]) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Active tensors that received a gradient, their grads and group slots.

        A sampled tensor the forward did not use has ``grad=None``: it counts as norm 0.
        """
        params, grads = [], []
        for param in active:
            if param.grad is not None:
                params.append(param)
                grads.append(param.grad)
        slots = torch.tensor([self._slot[id(p)] for p in params], dtype=torch.long)
        return params, grads, slots

    def _layer_norms(self, norms: Tensor, slots: Tensor) -> Tensor:
        """Per-layer L2 norms (``[num_layers]``; 0 for a layer without gradient)."""
        return group_norms(norms, slots, self._num_groups)[: self.partition.num_layers]

    def _sharpest_samples(self, first: PassOutput, forward_backward) -> list[Tensor]:
        """ESAM's data selection: per micro-batch, the samples whose loss rose most."""
        before = first.per_sample
        if not before or any(b is None for b in before):
            raise ValueError(
                "ESAM's data selection (data_ratio < 1) needs per-sample losses: return"
                " them from training_step as a 1-D tensor (e.g. cross_entropy(...,"
                " reduction='none')), or as {'loss': ..., 'per_sample_loss': ...}; or set"
                " data_ratio=1.0 to disable it."
            )
        with torch.no_grad():
            after = _as_output(forward_backward(backward=False)).per_sample
        subsets = []
        for b, a in zip(before, after or []):
            k = max(1, round(self.data_ratio * b.numel()))
            sharpness = a.to(b.device).float() - b.float()
            subsets.append(torch.topk(sharpness, k, sorted=False).indices.sort().values)
        return subsets

    def _refresh_fisher(self, forward_backward, zero_grad, result: StepResult) -> None:
        """SSAM-F: Fisher information from per-sample gradients of the current batch."""
        assert self.fisher is not None
        sizes = list(getattr(forward_backward, "batch_sizes", []) or [])
        if not sizes:
            raise ValueError(
                "SSAM-F's Fisher mask needs the batch size: the forward_backward callable"
                " must have a `batch_sizes` attribute (train_step(..., batch_size=...))."
            )
        active = self.activate(self._all)
        fisher = [torch.zeros_like(p, dtype=torch.float32) for p in active]
        empty = torch.zeros(0, dtype=torch.long)
        # One sample per pass: normalisation layers use their running statistics (which
        # also keeps these passes from changing them).
        stats = self.running_stats if self.running_stats else None
        with stats.evaluating() if stats else nullcontext():
            for i in range(min(self.fisher.fisher_samples, sizes[0])):
                zero_grad()
                forward_backward(subsets=[torch.tensor([i])] + [empty] * (len(sizes) - 1))
                for acc, param in zip(fisher, active):
                    if param.grad is not None:
                        acc.add_(param.grad.float().square())
                result.extra_backward += 1
        zero_grad()
        if self._context.averager is not None:  # the same mask on every process
            result.allreduce_bytes += self._context.averager.average_(fisher)
        self.fisher.set_fisher(active, fisher)

    @torch.no_grad()
    def _store_vertical(self, pp, pg, params2, grads2) -> None:
        """LookSAM: keep g_v = g_s - <g, g_s>/||g||^2 g, the part of the SAM gradient g_s
        orthogonal to the plain gradient g, for every perturbed tensor."""
        g_s = {id(p): g for p, g in zip(params2, grads2)}
        pairs = [(p, g, g_s[id(p)]) for p, g in zip(pp, pg) if id(p) in g_s]
        if not pairs:
            return
        g = [x[1] for x in pairs]
        gs = [x[2] for x in pairs]
        inner = torch.stack([(a.float() * b.float()).sum() for a, b in zip(g, gs)]).sum()
        g_sq = tensor_norms(g).square().sum()
        coeff = inner / (g_sq + self.perturbation.eps)
        vertical = torch._foreach_sub(gs, torch._foreach_mul(g, coeff.to(g[0].dtype)))
        for (param, _, _), v in zip(pairs, vertical):
            self.vertical[id(param)] = v

    @torch.no_grad()
    def _add_vertical(self, params: list[Tensor], grads: list[Tensor]) -> None:
        """LookSAM reuse step: g <- g + alpha * ||g|| / ||g_v|| * g_v (tensors with a g_v)."""
        assert isinstance(self.schedule, IntervalSchedule)
        pairs = [(g, self.vertical[id(p)]) for p, g in zip(params, grads) if id(p) in self.vertical]
        if not pairs or self.schedule.alpha == 0:
            return
        g = [x[0] for x in pairs]
        v = [x[1] for x in pairs]
        ratio = torch.linalg.vector_norm(tensor_norms(g)) / (
            torch.linalg.vector_norm(tensor_norms(v)) + self.perturbation.eps
        )
        torch._foreach_add_(g, torch._foreach_mul(v, (self.schedule.alpha * ratio).to(g[0].dtype)))

    # -- statistics and state ----------------------------------------------------------
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

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue identically: selection and schedule state,
        counters, and the per-tensor stores of single-step SAM, LookSAM and SSAM-F
        (indexed by the tensor's position in the partition)."""
        index = self._tensor_index()
        return {
            "selection": self.selection.state_dict(),
            "schedule": self.schedule.state_dict(),
            "counts": self.counts.clone(),
            "norm_sums": self.norm_sums.clone(),
            "norm_counts": self.norm_counts.clone(),
            "num_steps": self.num_steps,
            "num_skipped": self.num_skipped,
            "kind_counts": dict(self.kind_counts),
            "active_ratio_sum": self.active_ratio_sum,
            "last_grad": {index[k]: v for k, v in self.last_grad.items()},
            "vertical": {index[k]: v for k, v in self.vertical.items()},
            "fisher_masks": (
                {index[k]: v for k, v in self.fisher.masks.items()} if self.fisher else {}
            ),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the partition must match)."""
        counts = state["counts"]
        if counts.numel() != self.partition.num_layers:
            raise ValueError(
                f"The checkpoint's SL-SAM state has {counts.numel()} layers but the model has"
                f" {self.partition.num_layers}."
            )
        self.selection.load_state_dict(state["selection"])
        self.schedule.load_state_dict(state.get("schedule", {}))
        self.counts = counts.clone().to(torch.int64)
        n = self.partition.num_layers
        self.norm_sums = state.get("norm_sums", torch.zeros(n)).clone().double()
        self.norm_counts = state.get("norm_counts", torch.zeros(n)).clone().to(torch.int64)
        self.num_steps = int(state["num_steps"])
        self.num_skipped = int(state["num_skipped"])
        self.kind_counts = dict(state.get("kind_counts", {}))
        self.active_ratio_sum = float(state["active_ratio_sum"])
        tensors = self._tensors()

        def restore(saved: dict[int, Tensor]) -> dict[int, Tensor]:
            return {id(tensors[i]): v.to(tensors[i].device) for i, v in saved.items()}

        self.last_grad = restore(state.get("last_grad", {}))
        self.vertical = restore(state.get("vertical", {}))
        if self.fisher is not None and state.get("fisher_masks"):
            self.fisher.masks = restore(state["fisher_masks"])

    def _tensors(self) -> list[Tensor]:
        return list(self.partition.always_active) + list(self.partition.flat_params)

    def _tensor_index(self) -> dict[int, int]:
        return {id(t): i for i, t in enumerate(self._tensors())}


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

    def scalars(self) -> list[Tensor]:
        """The pass's loss and a finiteness probe of its gradients."""
        return [self.output.loss, self.norms.sum()]


def _as_output(value: Tensor | PassOutput) -> PassOutput:
    return value if isinstance(value, PassOutput) else PassOutput(value, None)
