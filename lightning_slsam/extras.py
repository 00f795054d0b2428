"""The optional parts of a step, each owning its state: which pass's BatchNorm statistics
count and dropout replay (:class:`PassIsolation`), ESAM's data selection
(:class:`SharpestSamples`), SSAM-F's coordinate mask (:class:`FisherRefresh`) and
inverse-inclusion update scaling (:class:`UpdateScaling`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_slsam.layers import LayerPartition
from lightning_slsam.passes import (
    PER_SAMPLE_NEEDED,
    ForwardBackward,
    PassOutput,
    StepCall,
    as_output,
)
from lightning_slsam.perturbation import BackupPool, FisherMask
from lightning_slsam.running import RandomState, RunningStats
from lightning_slsam.selection import LayerSelection
from lightning_slsam.sharding import local, shard_layout

if TYPE_CHECKING:
    from lightning_slsam.engine import SparseSAMEngine

__all__ = ["FisherRefresh", "PassIsolation", "SharpestSamples", "UpdateScaling"]


def by_position(saved: dict[int, Tensor], tensors: list[Tensor]) -> dict[int, Tensor]:
    """Per-tensor state saved by position, keyed again by the tensors' ids."""
    return {id(tensors[i]): v.to(tensors[i].device) for i, v in saved.items()}


class PassIsolation:
    """What one pass of a SAM step may leave behind besides gradients.

    Args:
        stats: the model's running statistics (``None`` or empty: nothing to manage).
        bn_stats: which pass's BatchNorm statistics the step keeps: ``"first"``,
            ``"second"`` or ``"both"``. Extra forwards (ESAM's selection, SSAM-F's Fisher)
            never count.
        replay_dropout: the second pass replays the first pass's random streams (the same
            dropout masks).
    """

    def __init__(self, stats: RunningStats | None, bn_stats: str, replay_dropout: bool) -> None:
        self.stats = stats if stats else None
        self.bn_stats = bn_stats
        self.replay_dropout = bool(replay_dropout)

    @contextmanager
    def sam_step(self) -> Iterator[_Isolated]:
        """Context of one SAM step; snapshots taken before the first pass."""
        stats = self.stats
        yield _Isolated(
            stats,
            before=stats.snapshot() if stats and self.bn_stats == "second" else None,
            rng=RandomState() if self.replay_dropout else None,
            keep_first=self.bn_stats == "first",
        )

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """Forwards that use the running statistics and leave them untouched."""
        with self.stats.evaluating() if self.stats else nullcontext():
            yield


@dataclass
class _Isolated:
    stats: RunningStats | None
    before: list[Tensor] | None
    rng: RandomState | None
    keep_first: bool
    after_first: list[Tensor] | None = None

    def first_pass_done(self) -> None:
        if self.stats and self.keep_first:
            self.after_first = self.stats.snapshot()

    @contextmanager
    def extra_forward(self) -> Iterator[None]:
        """A forward that must leave neither statistics nor random streams changed."""
        if self.rng is not None:
            self.rng.restore()
        snapshot = self.stats.snapshot() if self.stats else None
        try:
            yield
        finally:
            if snapshot is not None:
                self.stats.restore(snapshot)  # type: ignore[union-attr]

    def second_pass_starts(self) -> None:
        if self.before is not None:
            self.stats.restore(self.before)  # type: ignore[union-attr]  # only the second counts
        if self.rng is not None:
            self.rng.restore()  # the second pass draws the first pass's dropout masks

    def step_done(self) -> None:
        if self.after_first is not None:
            self.stats.restore(self.after_first)  # type: ignore[union-attr]  # only the first counts


class SharpestSamples:
    """ESAM's sharpness-sensitive data selection: the second pass runs on the fraction
    ``data_ratio`` of each micro-batch whose loss rose most under the perturbation."""

    def __init__(self, data_ratio: float) -> None:
        self.data_ratio = float(data_ratio)

    def select(self, first: PassOutput, forward_backward: ForwardBackward) -> list[Tensor]:
        before = first.per_sample
        if not before or any(b is None for b in before):
            raise ValueError(PER_SAMPLE_NEEDED)  # a loop that does not check it earlier
        with torch.no_grad():
            after = as_output(forward_backward(backward=False)).per_sample
        subsets = []
        for b, a in zip(before, after or []):
            k = max(1, round(self.data_ratio * b.numel()))
            sharpness = a.to(b.device).float() - b.float()
            subsets.append(torch.topk(sharpness, k, sorted=False).indices.sort().values)
        return subsets


class FisherRefresh:
    """SSAM-F: refreshes the coordinate mask from per-sample gradients when it is due.

    Under FSDP2 every backward pass is averaged across the processes, so a sample's own
    gradient is taken one process at a time: every process runs its sample ``i``, and all
    but the current source scale their loss by 0 (``forward_backward(loss_scale=...)``).
    The averaged shard is then the source's gradient divided by the number of processes.
    That is ``world`` backward passes per sample; the Fisher equals the DDP one (the
    processes' sums averaged), and the mask is the top of the whole tensors.
    """

    def __init__(self, fisher: FisherMask) -> None:
        self.fisher = fisher

    def before_step(self, engine: SparseSAMEngine, call: StepCall) -> None:
        if not self.fisher.due(engine.num_steps):
            return
        sizes = list(getattr(call.forward_backward, "batch_sizes", []) or [])
        if not sizes:
            raise ValueError(
                "SSAM-F's Fisher mask needs the batch size: the forward_backward callable"
                " must have a `batch_sizes` attribute (train_step(..., batch_size=...))."
            )
        active = engine.activate(engine.freezer.all)
        shards = local(active)
        fisher = [torch.zeros_like(s, dtype=torch.float32) for s in shards]
        count = min(self.fisher.fisher_samples, sizes[0])
        layout = shard_layout(active) if engine.freezer.sharded else None
        sources: list[float | None] = [None]
        if layout is not None:
            count, sources = _sample_sources(call.forward_backward, layout.group, count,
                                             shards[0].device)  # fmt: skip
        empty = torch.zeros(0, dtype=torch.long)
        # One sample per pass: normalisation layers use their running statistics (which
        # also keeps these passes from changing them).
        with engine.isolation.evaluating():
            for i in range(count):
                for loss_scale in sources:
                    call.zero_grad()
                    subsets = [torch.tensor([i])] + [empty] * (len(sizes) - 1)
                    if loss_scale is None:
                        call.forward_backward(subsets=subsets)
                    else:
                        call.forward_backward(subsets=subsets, loss_scale=loss_scale)
                    grads = [p.grad for p in active]
                    present = [j for j, g in enumerate(grads) if g is not None]
                    squares = [local([grads[j]])[0].float().square() for j in present]
                    torch._foreach_add_([fisher[j] for j in present], squares)
                    call.result.extra_backward += 1
        call.zero_grad()
        if layout is not None:  # (g / world)^2 summed over sources, times world: the mean
            torch._foreach_mul_(fisher, float(len(sources)))
        elif call.context.averager is not None:  # the same mask on every process
            call.result.allreduce_bytes += call.context.averager.average_(fisher)
        self.fisher.set_fisher(active, fisher)

    def masks_for(self, params: list[Tensor]) -> list[Tensor]:
        return self.fisher.masks_for(params)

    def state_dict(self, index: dict[int, int]) -> dict[str, Any]:
        return {"fisher_masks": {index[k]: v for k, v in self.fisher.masks.items()}}

    def load_state_dict(self, state: dict[str, Any], tensors: list[Tensor]) -> None:
        if state.get("fisher_masks"):
            self.fisher.masks = by_position(state["fisher_masks"], tensors)


def _sample_sources(
    fb: ForwardBackward, group: Any, count: int, device: torch.device
) -> tuple[int, list[float | None]]:
    """FSDP2: the per-sample count every process can serve, and this process's loss scale
    for each source process (1 for itself, 0 for the others)."""
    if "loss_scale" not in inspect.signature(fb).parameters:
        raise ValueError(
            "SSAM-F under FSDP2 needs a forward_backward callable with a `loss_scale`"
            " argument (the loss is multiplied by it before the backward pass), to take"
            " each process's per-sample gradients in turn. SAMMixin and train_step have it."
        )
    agreed = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    rank = dist.get_rank(group)
    return int(agreed), [float(r == rank) for r in range(dist.get_world_size(group))]


class UpdateScaling:
    """Inverse-inclusion update scaling: on a step whose layers the selection drew, each
    active layer's update -- the change the optimizer made to its weights -- is multiplied
    by ``min(1 / q, limit)``, with ``q`` the probability that the layer was drawn."""

    def __init__(self, limit: float) -> None:
        self.limit = float(limit)
        self._inclusion: Tensor | None = None

    def prepare(self, selection: LayerSelection, drawn: bool) -> None:
        """Before the step: the draw's inclusion probabilities (``drawn=False``: no
        scaling this step)."""
        self._inclusion = selection.inclusion() if drawn else None

    def before_update(
        self, mask: Tensor, partition: LayerPartition, pool: BackupPool
    ) -> tuple[list[Tensor], list[Tensor], list[float]] | None:
        """The drawn tensors whose update is scaled, a copy of their weights before the
        optimizer step (in ``pool``), and each one's factor minus 1."""
        if self._inclusion is None:
            return None
        factors = (1.0 / self._inclusion.clamp(min=1e-300)).clamp(max=self.limit)
        params: list[Tensor] = []
        extra: list[float] = []
        for on, factor, group in zip(mask.tolist(), factors.tolist(), partition.params):
            if on and factor > 1.0:
                params.extend(group)
                extra.extend([factor - 1.0] * len(group))
        if not params:
            return None
        params = local(params)  # FSDP2: each process scales its own shards
        return params, pool.copy(params), extra

    @staticmethod
    @torch.no_grad()
    def apply(params: list[Tensor], before: list[Tensor], extra: list[float]) -> None:
        """``w <- w + (f - 1) * (w - w_before)``: the optimizer's change times ``f``."""
        torch._foreach_sub_(before, params)  # w_before - w
        torch._foreach_mul_(before, extra)  # (f - 1) * (w_before - w)
        torch._foreach_sub_(params, before)
