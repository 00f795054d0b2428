"""SSAM-F's Fisher mask refresh (Mi et al., 2022): a hook that runs before a step when the
mask is due.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_slsam.core.contract import ForwardBackward, StepCall
from lightning_slsam.core.freezing import by_position
from lightning_slsam.core.perturbation import FisherMask
from lightning_slsam.core.step_parts import StepHook, StepParts
from lightning_slsam.parallel.fsdp2 import local, shard_layout

__all__ = ["FisherRefresh"]


class FisherRefresh(StepHook):
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

    def before_step(self, parts: StepParts, call: StepCall) -> None:
        if not self.fisher.due(parts.step):
            return
        sizes = list(getattr(call.forward_backward, "batch_sizes", []) or [])
        if not sizes:
            raise ValueError(
                "SSAM-F's Fisher mask needs the batch size: the forward_backward callable"
                " must have a `batch_sizes` attribute (train_step(..., batch_size=...))."
            )
        active = parts.activate(parts.freezer.all)
        shards = local(active)
        fisher = [torch.zeros_like(s, dtype=torch.float32) for s in shards]
        count = min(self.fisher.fisher_samples, sizes[0])
        layout = shard_layout(active) if parts.freezer.sharded else None
        sources: list[float | None] = [None]
        if layout is not None:
            count, sources = _sample_sources(call.forward_backward, layout.group, count,
                                             shards[0].device)  # fmt: skip
        empty = torch.zeros(0, dtype=torch.long)
        # One sample per pass: normalisation layers use their running statistics (which
        # also keeps these passes from changing them).
        with parts.isolation.evaluating():
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
