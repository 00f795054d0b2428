"""Gradient averaging across processes on the active tensors only (DDP's sync off), packed
into flat buffers, so frozen layers send nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = [
    "DDPAverager",
    "GradientAverager",
    "average_grads",
    "check_same_draw",
    "ddp_averager",
    "release_process_group",
]


class GradientAverager:
    """Averages tensors across the processes of ``group`` with coalesced all-reduces.

    Args:
        group: the process group (default: the world).
        bucket_bytes: largest flat buffer per collective (default 25 MiB, as DDP).

    Attributes:
        world_size: processes in the group.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, bucket_bytes: int = 25 * 2**20):
        self.group = group
        self.bucket_bytes = int(bucket_bytes)
        self.world_size = dist.get_world_size(group)

    @torch.no_grad()
    def average_(self, tensors: Sequence[Tensor]) -> int:
        """Replace every tensor by its mean over the processes; return the bytes sent."""
        sent = 0
        for bucket in self._buckets(tensors):
            flat = _flatten_dense_tensors(bucket)
            flat.div_(self.world_size)
            dist.all_reduce(flat, group=self.group)
            for tensor, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                tensor.copy_(synced)
            sent += flat.numel() * flat.element_size()
        return sent

    @torch.no_grad()
    def gather(self, value: Tensor) -> Tensor:
        """Every process's ``value`` (same shape everywhere), stacked in rank order."""
        out = [torch.empty_like(value) for _ in range(self.world_size)]
        dist.all_gather(out, value.contiguous(), group=self.group)
        return torch.stack(out)

    def _buckets(self, tensors: Sequence[Tensor]) -> list[list[Tensor]]:
        # Consecutive tensors of one dtype/device share a bucket: the same packing on every rank.
        buckets: list[list[Tensor]] = []
        size = 0
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            last = buckets[-1] if buckets else None
            if (
                last is None
                or size + nbytes > self.bucket_bytes
                or last[0].dtype != tensor.dtype
                or last[0].device != tensor.device
            ):
                buckets.append([tensor])
                size = nbytes
            else:
                last.append(tensor)
                size += nbytes
        return buckets


@torch.no_grad()
def average_grads(active: list[Tensor], averager: GradientAverager) -> int:
    """Average the active tensors' gradients across processes; return the bytes sent. A
    tensor no process used keeps ``grad=None`` (a presence flag travels with the zeros)."""
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


def check_same_draw(
    mask: Tensor, kind: str, kinds: Sequence[str], step: int, averager: GradientAverager
) -> None:
    """Raise on every process if any drew other layers or step kind than process 0."""
    index = torch.arange(1, mask.numel() + 1, dtype=torch.int64, device=mask.device)
    bits = mask.to(torch.int64)
    code = kinds.index(kind) if kind in kinds else len(kinds)
    value = torch.stack([(bits * index).sum(), (bits * (index * index % 1_000_003)).sum(),
                         bits.sum() * 8 + code])  # fmt: skip
    seen = averager.gather(value).cpu()
    differ = [rank for rank in range(len(seen)) if not torch.equal(seen[rank], seen[0])]
    if differ:
        counts = seen[:, 2] // 8
        raise RuntimeError(
            f"check_masks: at step {step} process(es) {differ} drew other layers"
            f" or another step kind than process 0 (active layers per process:"
            f" {counts.tolist()}). Use the same `seed` on every process (or"
            " `make_engine(..., seed=...)`) and do not draw from the engine's generators."
            " See docs/reliability.md."
        )


def ddp_averager(ddp: torch.nn.Module, module: torch.nn.Module | None) -> GradientAverager:
    """An averager over ``ddp``'s processes, once ``ddp`` is checked to wrap ``module``."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(
            "`ddp` must be the torch.nn.parallel.DistributedDataParallel wrapper that"
            f" `compute_loss` runs, got {type(ddp).__name__}."
        )
    if module is not None and module is not ddp and ddp.module is not module:
        raise ValueError(
            "`ddp` wraps another module than the one this engine was built on: build"
            " the engine on the wrapped module, `make_engine(method, ddp.module, ...)`."
        )
    return GradientAverager(ddp.process_group)


class DDPAverager:
    """The averager of the DDP wrapper the steps run in, made on its first step and kept."""

    def __init__(self) -> None:
        self._ddp: torch.nn.Module | None = None
        self._averager: GradientAverager | None = None

    def __call__(
        self, ddp: torch.nn.Module, module: torch.nn.Module | None
    ) -> tuple[GradientAverager, bool]:
        """``ddp``'s averager, and whether this is its first step (whose draw is checked)."""
        first = self._ddp is not ddp
        if first:
            self._averager = ddp_averager(ddp, module)
            self._ddp = ddp
        assert self._averager is not None
        return self._averager, first


def release_process_group() -> None:
    """Destroy the default process group a distributed run left behind.

    Call it at the end of a successful multi-process script (a live gloo group can abort it).

    Example:
        >>> import torch.distributed as dist
        >>> release_process_group()  # no group: nothing to do
        >>> dist.is_initialized()
        False
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
