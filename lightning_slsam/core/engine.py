"""One training step of any SAM method of the plugin, in plain PyTorch.

:class:`SparseSAMEngine` knows nothing of Lightning. A method is three parts:

* a **selection** (:mod:`lightning_slsam.selection.rules`): which layers the first pass
  computes, which the second pass computes and the optimizer updates;
* a **perturbation** (:mod:`lightning_slsam.core.perturbation`): the ascent on those layers;
* a **schedule** (:mod:`lightning_slsam.core.schedules`): what kind each step is, run by the
  step kinds (:mod:`lightning_slsam.core.step_kinds`: SAM, plain, single-step; a method
  adds its own, such as LookSAM's reuse step) and preceded by the method's hooks (SSAM-F's
  Fisher refresh).

Kinds and hooks receive a :class:`~lightning_slsam.core.step_parts.StepParts`, never the
engine. The engine is given callables and runs the step around them:
``forward_backward`` (the :class:`~lightning_slsam.core.contract.ForwardBackward` protocol),
``zero_grad()``, which sets every gradient to ``None``, and ``optimizer_step(skip)``, which
steps the base optimizer (``skip=True``: every gradient is ``None`` and nothing may
change, but per-step counters such as Lightning's ``global_step`` still advance).

Layers outside the active set are frozen for the step (:mod:`lightning_slsam.core.freezing`).
Every step synchronises with the host once, at its end: losses, a finiteness probe and the
per-layer norms travel together; a non-finite value skips the step with the weights
restored exactly and nothing else changed.

SL-SAM assembled from its parts in a plain loop (:func:`~lightning_slsam.make_engine`
does the same from a method's name and options):

>>> import torch
>>> from lightning_slsam import LayerBandit, SAMPerturbation, build_partition
>>> _ = torch.manual_seed(0)
>>> net = torch.nn.Sequential(
...     torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> partition = build_partition(net)  # 4 layers: 2 weights, 2 biases
>>> bandit = LayerBandit(partition.num_layers, layer_ratio=0.5,
...                      generator=torch.Generator().manual_seed(0))
>>> engine = SparseSAMEngine(partition, bandit, SAMPerturbation(rho=0.05), module=net)
>>> opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
>>> x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
>>> result = engine.train_step(lambda: torch.nn.functional.cross_entropy(net(x), y), opt)
>>> result.kind, result.active_mask.tolist()
('sam', [False, False, True, False])
>>> result.num_backward, result.pass_numel  # two passes, each on 2.weight alone
(2, [16, 16])
>>> all(p.requires_grad for p in net.parameters())  # unfrozen after the step
True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_slsam.core.contract import (
    ForwardBackward,
    PassOutput,
    StepCall,
    StepContext,
    StepResult,
)
from lightning_slsam.core.counters import StepCounters
from lightning_slsam.core.freezing import LayerFreezer
from lightning_slsam.core.gradient_pass import check_same_draw
from lightning_slsam.core.isolation import PassIsolation
from lightning_slsam.core.partition import LayerPartition
from lightning_slsam.core.perturbation import SAMPerturbation
from lightning_slsam.core.plain_loop import PlainLoopStep
from lightning_slsam.core.running import BN_STATS, RunningStats
from lightning_slsam.core.schedules import EveryStep, Schedule
from lightning_slsam.core.step_kinds import PlainStep, SAMStep, SingleStep, StepKind
from lightning_slsam.core.step_parts import StatefulPart, StepHook, StepParts
from lightning_slsam.core.update_scaling import UpdateScaling
from lightning_slsam.parallel.fsdp2 import (
    check_shardable,
    fsdp_modules,
    full_tensor,
    reshard,
    shard_of,
)
from lightning_slsam.selection.rules import LayerSelection

__all__ = ["PassOutput", "SparseSAMEngine", "StepContext", "StepResult"]


def default_kinds() -> dict[str, StepKind]:
    """The step kinds every engine has: ``"sam"``, ``"plain"`` and ``"single"``."""
    return {"sam": SAMStep(), "plain": PlainStep(), "single": SingleStep()}


class SparseSAMEngine(StepCounters, PlainLoopStep):
    """Runs SAM-method steps over a :class:`LayerPartition` (pure PyTorch).

    Args:
        partition: the layers, from :func:`~lightning_slsam.core.partition.build_partition`.
        selection: the layer-selection rule (a :class:`~lightning_slsam.LayerBandit` for
            SL-SAM).
        perturbation: the ascent applied to the perturbed tensors.
        schedule: the kind of each step (default: SAM on every step).
        kinds: the step kinds by name, added to (or replacing) the defaults ``"sam"``
            (:class:`~lightning_slsam.core.step_kinds.SAMStep`), ``"plain"`` and
            ``"single"``; a method's specification supplies its own
            (:meth:`~lightning_slsam.MethodSpec.step_kinds`: LookSAM's ``"reuse"``,
            ESAM's and SSAM-F's SAM steps). Every kind the schedule names must be here.
        hooks: parts run before every step's kind (SSAM-F's Fisher refresh).
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
            drawn (:meth:`~lightning_slsam.selection.rules.LayerSelection.inclusion`). A layer
            active in a fraction ``q`` of the steps then moves, in expectation, as far as
            it would if it were trained every step. Must be ``>= 1``.

    Its counters (``counts``, ``num_steps``, ``mean_active_ratio``, ``last_result``, ...)
    are :class:`~lightning_slsam.core.counters.StepCounters`'; its plain-loop step,
    ``train_step``, is :class:`~lightning_slsam.core.plain_loop.PlainLoopStep`'s. A runnable example
    is in :mod:`lightning_slsam.core.engine`'s docstring.
    """

    def __init__(
        self,
        partition: LayerPartition,
        selection: LayerSelection,
        perturbation: SAMPerturbation,
        schedule: Schedule | None = None,
        kinds: Mapping[str, StepKind] | None = None,
        hooks: Sequence[StepHook] = (),
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
        if bn_stats not in BN_STATS:
            raise ValueError(f"`bn_stats` must be one of {BN_STATS}, got {bn_stats!r}.")
        check_shardable(partition.flat_params, bool(sync_first_pass))
        self.partition = partition  # also builds self.freezer
        self.selection = selection
        self.perturbation = perturbation
        self.schedule = schedule if schedule is not None else EveryStep()
        self.bn_stats = bn_stats
        self.replay_dropout = bool(replay_dropout)
        self.sync_first_pass = bool(sync_first_pass)
        self.check_masks = bool(check_masks)
        self.dense_one_pass = bool(dense_one_pass)
        self.update_scale = None if update_scale is None else float(update_scale)
        self._module = module
        self._sharded_modules = (
            fsdp_modules(module) if module is not None and self.freezer.sharded else []
        )
        running = RunningStats(module) if module is not None else None
        self.isolation = PassIsolation(running, bn_stats, self.replay_dropout)
        #: The step kinds by name (the schedule names one per step) and the hooks run
        #: before each step; they own their state, saved with the engine's.
        self.kinds: dict[str, StepKind] = {**default_kinds(), **(kinds or {})}
        self.hooks: list[StepHook] = list(hooks)
        missing = [k for k in getattr(self.schedule, "kinds", ()) if k not in self.kinds]
        if missing:
            raise ValueError(
                f"The schedule {type(self.schedule).__name__} runs step kinds {missing} that"
                f" the engine lacks: pass them as `kinds` (it has {sorted(self.kinds)})."
            )
        self.scaling = UpdateScaling(update_scale) if update_scale is not None else None
        self.reset_counters(partition.num_layers)

    @property
    def partition(self) -> LayerPartition:
        """The layers (a second ``fit`` may hand in a rebuilt, identical partition)."""
        return self._partition

    @partition.setter
    def partition(self, partition: LayerPartition) -> None:
        self._partition = partition
        self.freezer = LayerFreezer(partition)

    # -- freezing -------------------------------------------------------------------
    def activate(self, mask: Tensor) -> list[Tensor]:
        """Make exactly the layers in ``mask`` (plus always-active tensors) trainable.

        Returns the active tensors, always-active ones first.
        """
        return self.freezer.activate(mask)

    def release(self) -> None:
        """Make every partition tensor trainable again (the state outside a step)."""
        self.freezer.release()

    def weight_flags(self, params: list[Tensor]) -> list[bool] | None:
        """ASAM's per-tensor scaling flags (``None`` unless the perturbation is adaptive)."""
        return self.freezer.weight_flags(params) if self.perturbation.adaptive else None

    # -- the step ---------------------------------------------------------------------
    def step(
        self,
        forward_backward: ForwardBackward,
        zero_grad: Callable[[], None],
        optimizer_step: Callable[[bool], None],
        context: StepContext | None = None,
    ) -> StepResult:
        """Run one training step of the configured method (``context``: gradient scaling
        and multi-process averaging, when the trainer uses them)."""
        context = context if context is not None else StepContext()
        # FSDP2: a forward without backward (validation) may have left the root unsharded.
        reshard(self._sharded_modules)
        if self.num_steps == 0 and self._module is not None:
            self.freezer.check_owned(self._module)
        name = self.schedule.kind(self.num_steps)
        kind = self.kinds.get(name)
        if kind is None:
            raise ValueError(
                f"The schedule named step kind {name!r}; the engine has {sorted(self.kinds)}."
            )
        # A kind may need every layer (single-step SAM's first step: no previous gradient
        # yet). With dense_one_pass, the kinds that run one pass (RST's plain steps,
        # LookSAM's reuse steps) train every layer too. The selection draws (and learns)
        # on the other steps only.
        forced = kind.needs_every_layer() or (self.dense_one_pass and kind.one_pass)
        mask = self.freezer.all.clone() if forced else self.selection.sample()
        if self.scaling is not None:
            self.scaling.prepare(self.selection, drawn=not forced)
        if (self.check_masks or context.check_draw) and context.averager is not None:
            check_same_draw(mask, name, self.num_steps, context.averager)
        result = StepResult(None, mask, self.partition.trainable_numel, name, drawn=not forced)
        call = StepCall(result, forward_backward, zero_grad, optimizer_step, context)
        parts = self.parts()
        try:
            for hook in self.hooks:
                hook.before_step(parts, call)
            kind.run(parts, call)
        finally:
            self.release()
        self.count(result)
        return result

    @property
    def needs_per_sample(self) -> bool:
        """Whether a step kind needs per-sample losses (ESAM's data selection)."""
        return any(kind.needs_per_sample for kind in self.kinds.values())

    def parts(self) -> StepParts:
        """What this step's kind and hooks work with
        (:class:`~lightning_slsam.core.step_parts.StepParts`)."""
        return StepParts(
            freezer=self.freezer, selection=self.selection, perturbation=self.perturbation,
            isolation=self.isolation, step=self.num_steps, sync_first_pass=self.sync_first_pass,
            scaling=self.scaling, record_norms=self.record_norms,
        )  # fmt: skip

    def _stateful(self) -> list[StatefulPart]:
        """The kinds and hooks, each once (a kind may serve under two names)."""
        return list({id(p): p for p in (*self.kinds.values(), *self.hooks)}.values())

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue identically: selection and schedule state,
        counters, and the per-tensor stores of single-step SAM, LookSAM and SSAM-F
        (indexed by the tensor's position in the partition)."""
        index = self.freezer.tensor_index()
        state = {
            "selection": self.selection.state_dict(),
            "schedule": self.schedule.state_dict(),
            **self.counters_state(),
        }
        for part in self._stateful():
            state.update(part.state_dict(index))
        return self._per_tensor(state, full_tensor)  # FSDP2: whole tensors

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
        self.load_counters(state)
        state = self._per_tensor(state, shard_of)  # FSDP2: this process's shards
        tensors = self.freezer.tensors()
        for part in self._stateful():
            part.load_state_dict(state, tensors)

    def _per_tensor(self, state: dict[str, Any], convert: Callable) -> dict[str, Any]:
        """Convert the per-tensor stores: the parts' dicts keyed by tensor position."""
        tensors = self.freezer.tensors()
        return {k: {i: convert(v, tensors[i]) for i, v in x.items()} if _per_tensor_store(x)
                else x for k, x in state.items()}  # fmt: skip


def _per_tensor_store(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(i, int) and isinstance(v, torch.Tensor) for i, v in value.items()
    )
