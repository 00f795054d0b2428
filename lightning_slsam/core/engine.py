"""The stateful shell around :mod:`lightning_slsam.core.step`: :class:`SAMEngine` picks each
step's kind, draws the layers, runs the step, counts and saves its state. SL-SAM from its parts
(:func:`~lightning_slsam.make_engine` builds it from a method's name):

>>> import torch
>>> from lightning_slsam.core.partition import build_partition
>>> from lightning_slsam.core.perturbation import SAMPerturbation
>>> from lightning_slsam.selection.bandit import LayerBandit
>>> _ = torch.manual_seed(0)
>>> net = torch.nn.Sequential(
...     torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> partition = build_partition(net)  # 4 layers: 2 weights, 2 biases
>>> bandit = LayerBandit(partition.num_layers, layer_ratio=0.5,
...                      generator=torch.Generator().manual_seed(0))
>>> engine = SAMEngine(partition, bandit, SAMPerturbation(rho=0.05), module=net)
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

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_slsam.core.frontend import run_step
from lightning_slsam.core.isolation import PassIsolation, RunningStats
from lightning_slsam.core.partition import LayerFreezer, LayerPartition, by_position
from lightning_slsam.core.passes import LossOutput, PassRunner, read_output
from lightning_slsam.core.perturbation import SAMPerturbation
from lightning_slsam.core.step import (
    STEP_KINDS,
    LoopHooks,
    MethodParts,
    StepContext,
    StepResult,
    commit,
    plain_step,
    sam_step,
    single_step,
)
from lightning_slsam.parallel.ddp import DDPAverager, check_same_draw
from lightning_slsam.parallel.shards import shards_of
from lightning_slsam.selection.rules import LayerSelection

__all__ = ["SAMEngine", "normalized_entropy"]


class SAMEngine:
    """Runs the steps of a method over a :class:`~lightning_slsam.core.partition.LayerPartition`.

    Args:
        partition: the layers, from :func:`~lightning_slsam.core.partition.build_partition`.
        selection: the layer-selection rule (SL-SAM's bandit, ...).
        perturbation: the ascent applied to the perturbed tensors.
        parts: the method's :class:`~lightning_slsam.core.step.MethodParts` (default: SAM).
        module: the model, whose normalisation layers' running statistics are managed.
        bn_stats: the pass whose statistics count: ``"first"`` (default), ``"second"``, ``"both"``.
        replay_dropout: the second pass replays the first pass's dropout masks (default ``False``).
        sync_first_pass: average first-pass gradients before the ascent (default; False: own).
        check_masks: under DDP, check every step that all processes drew alike (default off).
        update_scale: scale a drawn layer's update by ``min(1 / q, update_scale)`` (None: off).

    Attributes:
        counts: steps in which each layer was updated (int64, CPU).
        norm_sums, norm_counts: sum and number of each layer's first-pass gradient norms.
        num_steps: steps run, skipped ones included; ``num_skipped``: skipped ones.
        kind_counts: steps of each kind (skipped ones excluded).
        active_ratio_sum: sum over non-skipped steps of :attr:`StepResult.active_ratio`.
        last_result: the latest :class:`~lightning_slsam.core.step.StepResult`.
    """

    def __init__(self, partition: LayerPartition, selection: LayerSelection,
                 perturbation: SAMPerturbation, parts: MethodParts | None = None,
                 module: torch.nn.Module | None = None, bn_stats: str = "first",
                 replay_dropout: bool = False, sync_first_pass: bool = True,
                 check_masks: bool = False, update_scale: float | None = None) -> None:  # fmt: skip
        #: The seam to the parameters' shards (FSDP2), or whole tensors.
        self.shards = shards_of(partition.flat_params, module)
        if self.shards.sharded and not sync_first_pass:
            raise ValueError(
                "sync_first_pass=False needs each process's own first-pass gradient, but FSDP2"
                " averages every backward pass across the processes (reduce-scatter). Leave"
                " sync_first_pass=True with FSDP2, or use strategy='ddp'."
            )
        self.partition = partition  # also builds self.freezer
        self.selection = selection
        self.perturbation = perturbation
        self.parts = parts if parts is not None else MethodParts()
        self.sync_first_pass = bool(sync_first_pass)
        self.check_masks = bool(check_masks)
        self.update_scale = None if update_scale is None else float(update_scale)
        self._module = module
        running = RunningStats(module) if module is not None else None
        #: What one pass may leave behind (``None``: no running statistics, no replay).
        self.isolation = (
            PassIsolation(running, bn_stats, replay_dropout) if running or replay_dropout else None
        )
        #: Single-step SAM's gradients of the last step each tensor was trained in.
        self.last_grad: dict[int, Tensor] = {}
        #: The run's planned optimizer steps (``math.inf``: not known), set by the front-end.
        self.planned_steps: float = math.inf
        self._ddp = DDPAverager()
        self.reset_counters(partition.num_layers)

    @property
    def partition(self) -> LayerPartition:
        """The layers (a second ``fit`` may hand in a rebuilt, identical partition)."""
        return self._partition

    @partition.setter
    def partition(self, partition: LayerPartition) -> None:
        self._partition = partition
        self.freezer = LayerFreezer(partition)
        self.trainable_numel = partition.trainable_numel

    @property
    def needs_per_sample(self) -> bool:
        """Whether the steps need per-sample losses (ESAM's sample choice)."""
        return self.parts.needs_per_sample

    def step(self, loop: LoopHooks) -> StepResult:
        """Run one training step of the method with the training loop's ``loop``."""
        # FSDP2: a forward without backward (validation) may have left the root unsharded.
        self.shards.reshard()
        parts, step = self.parts, self.num_steps
        if step == 0:
            if self._module is not None:
                self.freezer.check_owned(self._module)
            if loop.optimizer is not None:
                parts.check_optimizer(loop.optimizer)
        kind = parts.kind(step)
        if kind not in STEP_KINDS:
            raise ValueError(f"The method named step kind {kind!r}; the kinds are {STEP_KINDS}.")
        ctx = StepContext(step, loop, self.freezer, self.isolation, self.shards,
                          self.planned_steps, self._module)  # fmt: skip
        if parts.needs_outputs:  # the training step's outputs, read by the method's term
            loop.forward_backward.needs = (parts.label, parts.needs_outputs)
            loop.forward_backward.extra_loss = functools.partial(parts.extra_loss, ctx)
        # A single-step method without directions yet: a plain step on every layer, not a draw.
        directions = (
            parts.directions(ctx, self.partition.flat_params, self.last_grad)
            if kind == "single" else {}
        )  # fmt: skip
        drawn = not (kind == "single" and not directions)
        if not drawn:
            kind = "plain"
        single = kind == "single" or not drawn
        keep = (single and parts.keeps_last_grads) or (kind != "sam" and parts.reads_update_grads)
        mask = self.selection.sample() if drawn else self.freezer.all.clone()
        inclusion = self.selection.inclusion() if drawn and self.update_scale else None
        if (self.check_masks or loop.check_draw) and loop.averager is not None:
            check_same_draw(mask, kind, STEP_KINDS, step, loop.averager)
        try:
            extra = parts.before_step(ctx)
            if kind == "sam":
                passed = sam_step(
                    ctx, mask, selection=self.selection, perturbation=self.perturbation,
                    parts=parts, sync_first_pass=self.sync_first_pass,
                )  # fmt: skip
            elif kind == "single":
                passed = single_step(ctx, mask, perturbation=self.perturbation,
                                     directions=directions, keep=keep,
                                     fresh=parts.fresh_directions)  # fmt: skip
            else:
                passed = plain_step(ctx, mask, parts=parts, reuse=kind == "reuse", keep=keep)
            skip_reason, sent, norms = commit(
                ctx, passed, inclusion, update_scale=self.update_scale, pool=self.perturbation.pool
            )
            if norms is not None:  # the update was made
                if drawn:
                    self.selection.update(passed.update_mask, norms)
                if passed.kept is not None:  # the gradients as the optimizer used them
                    params, grads = passed.kept
                    if parts.reads_update_grads:
                        read = functools.partial(parts.after_update, ctx, params, grads)
                        loop.after_update(read) if loop.after_update is not None else read()
                    if single and parts.keeps_last_grads:
                        for param, grad in zip(params, self.shards.local(grads)):
                            self.last_grad[id(param)] = grad
        finally:
            self.freezer.release()
        total = max(self.trainable_numel, 1)
        result = StepResult(
            passed.first[0], passed.active_mask, self.trainable_numel, kind,
            pass_numel=passed.pass_numel, extra_backward=extra.backward,
            allreduce_bytes=extra.allreduce_bytes + passed.allreduce_bytes + sent,
            skipped=skip_reason is not None, skip_reason=skip_reason,
            drawn=drawn, active_ratio=sum(n / total for n in passed.pass_numel),
        )  # fmt: skip
        self.count(result, passed.update_mask, norms)
        return result

    def train_step(self, compute_loss: Callable[..., Tensor], optimizer: torch.optim.Optimizer,
                   batch_size: int | None = None, *,
                   ddp: torch.nn.Module | None = None) -> StepResult:  # fmt: skip
        """One step in a plain PyTorch loop; returns its :class:`StepResult`.

        Args:
            compute_loss: the loss, once per pass (ESAM, SSAM-F: ``compute_loss(index)``).
            optimizer: the base optimizer; not stepped when the step is skipped.
            batch_size: samples in the batch (needed by ESAM and SSAM-F).
            ddp: the DDP wrapper ``compute_loss`` runs (engine on ``ddp.module``, same seed).
        """

        def loss(index: Tensor | None) -> LossOutput:
            return read_output(compute_loss() if index is None else compute_loss(index))

        def size(_: Any) -> int:
            if batch_size is None:
                raise ValueError(
                    "This method addresses single samples and needs the batch size: pass it"
                    " (train_step(..., batch_size=...))."
                )
            return batch_size

        passes = PassRunner(
            [None], loss, Tensor.backward, size=size, subset=lambda _, index: index,
            needs_per_sample=self.needs_per_sample,
        )  # fmt: skip
        zero_grad = functools.partial(optimizer.zero_grad, set_to_none=True)

        def optimizer_step(skip: bool) -> None:
            if not skip:
                optimizer.step()

        if ddp is None:
            return run_step(self, passes, zero_grad, optimizer_step, optimizer)
        averager, first = self._ddp(ddp, self._module)
        return run_step(self, passes, zero_grad, optimizer_step, optimizer, averager=averager,
                        check_draw=first, no_sync=ddp.no_sync())  # type: ignore[operator]  # fmt: skip

    def reset_counters(self, num_layers: int) -> None:
        """Start counting afresh for ``num_layers`` layers."""
        self.counts = torch.zeros(num_layers, dtype=torch.int64)
        self.norm_sums = torch.zeros(num_layers, dtype=torch.float64)
        self.norm_counts = torch.zeros(num_layers, dtype=torch.int64)
        #: Non-skipped steps run before each layer joined (0 unless it became trainable later).
        self.joined = torch.zeros(num_layers, dtype=torch.int64)
        self.num_steps = 0
        self.num_skipped = 0
        self.kind_counts: dict[str, int] = {}
        self.active_ratio_sum = 0.0
        self.last_result: StepResult | None = None

    def count(self, result: StepResult, measured: Tensor, norms: Tensor | None) -> None:
        """Count a finished step, with ``measured``'s first-pass ``norms`` (``None``: skipped)."""
        self.num_steps += 1
        if result.skipped:
            self.num_skipped += 1
        else:
            self.counts += result.active_mask.to(torch.int64)
            self.active_ratio_sum += result.active_ratio
            self.kind_counts[result.kind] = self.kind_counts.get(result.kind, 0) + 1
        if norms is not None:
            self.norm_sums += torch.where(measured, norms, 0.0)
            self.norm_counts += measured.to(torch.int64)
        self.last_result = result

    @property
    def mean_active_ratio(self) -> float:
        """Mean "Active Ratio" (summed over passes) over the non-skipped steps."""
        done = self.num_steps - self.num_skipped
        return self.active_ratio_sum / done if done else math.nan

    def layer_steps(self) -> Tensor:
        """Non-skipped steps each layer could be drawn in (int64): since it became trainable."""
        return (self.num_steps - self.num_skipped) - self.joined

    def frequencies(self) -> Tensor:
        """Fraction of the steps each layer could be drawn in that it was updated (float64)."""
        return self.counts.double() / self.layer_steps().clamp(min=1).double()

    def mean_norms(self) -> Tensor:
        """Each layer's mean first-pass gradient norm (float64; NaN for one never measured)."""
        return self.norm_sums / self.norm_counts.double()

    def never_selected(self) -> int:
        """Layers not updated in any step so far."""
        return int((self.counts == 0).sum())

    def sampled(self) -> bool:
        """Whether some layer missed a step it could be drawn in."""
        return bool((self.counts < self.layer_steps()).any())

    def step_metrics(self, result: StepResult, distributed: bool) -> dict[str, float]:
        """The metrics every front-end logs after a step (``distributed``: bytes too)."""
        total = max(result.trainable_numel, 1)
        per_pass = [n / total for n in result.pass_numel] + [0.0, 0.0]
        metrics = {
            "slsam/active_layers": float(result.active_mask.sum()),
            "slsam/active_ratio": result.active_ratio,
            "slsam/active_ratio_pass1": per_pass[0],
            "slsam/active_ratio_pass2": per_pass[1],
            "slsam/backward_passes": float(len(result.pass_numel) + result.extra_backward),
            "slsam/sam_step": float(result.kind in ("sam", "single")),
            "slsam/entropy": normalized_entropy(self.selection.probs),
            "slsam/never_selected": float(int((self.counts == 0).sum())),
            "slsam/skipped_steps": float(self.num_skipped),
        }
        if distributed:
            metrics["slsam/allreduce_bytes"] = float(result.allreduce_bytes)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """Everything to continue identically; per-tensor stores keyed by tensor position."""
        index = self.freezer.tensor_index()
        state = {
            "selection": self.selection.state_dict(),
            "counts": self.counts.clone(),
            "joined": self.joined.clone(),
            "norm_sums": self.norm_sums.clone(),
            "norm_counts": self.norm_counts.clone(),
            "num_steps": self.num_steps,
            "num_skipped": self.num_skipped,
            "kind_counts": dict(self.kind_counts),
            "active_ratio_sum": self.active_ratio_sum,
            "last_grad": {index[k]: v for k, v in self.last_grad.items()},
            **self.parts.state_dict(index),
        }
        return self._per_tensor(state, self.shards.full)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the partition must match)."""
        counts = state["counts"]
        if counts.numel() != self.partition.num_layers:
            raise ValueError(
                f"The checkpoint's SL-SAM state has {counts.numel()} layers but the model has"
                f" {self.partition.num_layers}."
            )
        self.selection.load_state_dict(state["selection"])
        self.counts = counts.clone().to(torch.int64)
        n = self.counts.numel()
        self.joined = state.get("joined", torch.zeros(n)).clone().to(torch.int64)
        self.norm_sums = state.get("norm_sums", torch.zeros(n)).clone().double()
        self.norm_counts = state.get("norm_counts", torch.zeros(n)).clone().to(torch.int64)
        self.num_steps = int(state["num_steps"])
        self.num_skipped = int(state["num_skipped"])
        self.kind_counts = dict(state.get("kind_counts", {}))
        self.active_ratio_sum = float(state["active_ratio_sum"])
        state = self._per_tensor(state, self.shards.shard)  # FSDP2: this process's shards
        tensors = self.freezer.tensors()
        self.last_grad = by_position(state.get("last_grad", {}), tensors)
        self.parts.load_state_dict(state, tensors)

    def carry_state(
        self, state: dict[str, Any], layer_names: list[str], tensor_names: list[str]
    ) -> dict[str, Any]:
        """:meth:`state_dict`'s output for ``layer_names``/``tensor_names`` mapped by name here."""
        old_layer = {name: i for i, name in enumerate(layer_names)}
        index = [old_layer.get(name, -1) for name in self.partition.names]
        done = int(state["num_steps"]) - int(state["num_skipped"])
        n = len(index)

        def per_layer(values: Tensor, fill: float) -> Tensor:
            out = torch.full((n,), fill, dtype=values.dtype)
            for i, j in enumerate(index):
                if j >= 0:
                    out[i] = values[j]
            return out

        old_tensor = {name: i for i, name in enumerate(tensor_names)}
        moved = {old_tensor[name]: k for k, name in enumerate(self.partition.tensor_names())
                 if name in old_tensor}  # fmt: skip
        carried = {
            k: {moved[i]: v for i, v in x.items() if i in moved} if _per_tensor_store(x) else x
            for k, x in state.items()
        }
        counts = state["counts"]
        joined = state.get("joined", torch.zeros_like(counts))
        carried.update(
            counts=per_layer(counts, 0),
            joined=per_layer(joined.to(torch.int64), done),
            norm_sums=per_layer(state.get("norm_sums", torch.zeros(len(counts))).double(), 0.0),
            norm_counts=per_layer(state.get("norm_counts", torch.zeros_like(counts)), 0),
            selection=self.selection.carry_state(state["selection"], index),
        )
        return carried

    def _per_tensor(self, state: dict[str, Any], convert: Callable) -> dict[str, Any]:
        """Convert the per-tensor stores: the dicts keyed by tensor position."""
        tensors = self.freezer.tensors()
        return {k: {i: convert(v, tensors[i]) for i, v in x.items()} if _per_tensor_store(x)
                else x for k, x in state.items()}  # fmt: skip


def normalized_entropy(probs: Tensor) -> float:
    """Entropy of ``probs / probs.sum()`` over ``log(N)``: 1.0 uniform, toward 0 concentrated."""
    n = probs.numel()
    if n <= 1:
        return 1.0
    q = probs.double() / probs.double().sum()
    entropy = -(q * torch.log(q.clamp_min(1e-300))).sum().item()
    return entropy / math.log(n)


def _per_tensor_store(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(i, int) and isinstance(v, torch.Tensor) for i, v in value.items()
    )
