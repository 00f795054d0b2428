"""Sharded parameters (FSDP2's ``fully_shard``): the engine's arithmetic on local shards.

Under FSDP2 every parameter, and its gradient, is a ``DTensor`` whose rows are split
across the data-parallel processes. SAM's ascent, its exact restore, LookSAM's stored
component and the update scaling are elementwise, so each process applies them to its own
shard (:func:`local`). What needs the whole tensor is a sum over its elements -- a
gradient norm, LookSAM's inner product -- and :func:`sum_over_shards` completes the local
sums of all tensors at once with one all-reduce: the perturbation norm and the per-layer
norms the bandit learns from are then the global ones, identical on every process.

Without an initialised process group no ``DTensor`` can exist, and every function here
returns its input unchanged without importing ``torch.distributed.tensor``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "ShardLayout",
    "check_shardable",
    "full_tensor",
    "local",
    "shard_layout",
    "shard_of",
    "sum_over_shards",
]


def _dtensor_type() -> type | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def local(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Each tensor's local shard (the tensor itself when it is not a ``DTensor``).

    The shard shares storage with the parameter or gradient, so in-place arithmetic on it
    changes the ``DTensor``.
    """
    dtensor = _dtensor_type()
    if dtensor is None:
        return list(tensors)
    with torch.no_grad():  # the shard itself, not an autograd view of it
        return [t.to_local() if isinstance(t, dtensor) else t for t in tensors]


class ShardLayout:
    """Which of a list of tensors are sharded, and the process group of their shards.

    Attributes:
        flags: bool ``[n]``, whether tensor ``i`` is sharded.
        group: the shards' process group.
    """

    def __init__(self, flags: list[bool], group: Any) -> None:
        self.flags = flags
        self.group = group
        self._mask: dict[torch.device, Tensor] = {}

    def mask(self, device: torch.device) -> Tensor:
        if device not in self._mask:
            self._mask[device] = torch.tensor(self.flags, dtype=torch.bool, device=device)
        return self._mask[device]


def shard_layout(tensors: Sequence[Tensor]) -> ShardLayout | None:
    """The layout of ``tensors``; ``None`` when none of them is sharded.

    Raises:
        ValueError: for a tensor sharded over a multi-dimensional mesh (tensor
            parallelism combined with FSDP), which the engine does not support.
    """
    dtensor = _dtensor_type()
    if dtensor is None:
        return None
    flags: list[bool] = []
    group = None
    for tensor in tensors:
        sharded = isinstance(tensor, dtensor) and any(p.is_shard() for p in tensor.placements)
        if sharded:
            mesh = tensor.device_mesh
            if mesh.ndim != 1:
                raise ValueError(
                    f"A parameter is sharded over a {mesh.ndim}-D device mesh {mesh}: SAM"
                    " methods support FSDP2 (fully_shard over the data-parallel mesh) with"
                    " tensor_parallel_size=1 only."
                )
            group = mesh.get_group()
        flags.append(sharded)
    return ShardLayout(flags, group) if group is not None else None


def sum_over_shards(values: Tensor, layout: ShardLayout | None) -> Tensor:
    """Complete per-tensor local sums: ``values[i]`` (a number, or a row of numbers) of a
    sharded tensor becomes the sum over all its shards (one all-reduce for all of
    ``values``); the others are kept."""
    if layout is None or values.numel() == 0:
        return values
    mask = layout.mask(values.device).view(-1, *[1] * (values.dim() - 1))
    partial = torch.where(mask, values, torch.zeros_like(values))
    dist.all_reduce(partial, group=layout.group)
    return torch.where(mask, partial, values)


def check_shardable(tensors: Sequence[Tensor], fisher: bool, sync_first_pass: bool) -> None:
    """Refuse, at construction, what the engine cannot do with FSDP2-sharded ``tensors``.

    Raises:
        ValueError: for SSAM-F's Fisher mask or ``sync_first_pass=False``, naming why.
    """
    if shard_layout(tensors) is None:
        return
    if fisher:
        raise ValueError(
            "SSAM-F does not support FSDP2-sharded parameters yet: its Fisher mask needs"
            " each sample's own gradient, and FSDP2 averages every backward pass across the"
            " processes. Use strategy='ddp' for SSAM-F."
        )
    if not sync_first_pass:
        raise ValueError(
            "sync_first_pass=False needs each process's own first-pass gradient, but FSDP2"
            " averages every backward pass across the processes (reduce-scatter). Leave"
            " sync_first_pass=True with FSDP2, or use strategy='ddp'."
        )


def full_tensor(value: Tensor, param: Tensor) -> Tensor:
    """The whole tensor of per-tensor state ``value`` kept for ``param``: gathered from
    every process when ``param`` is sharded (a collective: every process must call it in
    the same order), else ``value`` itself."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(param, dtensor):
        return value
    shard = value.to_local() if isinstance(value, dtensor) else value
    whole = dtensor.from_local(
        shard, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )
    return whole.full_tensor()


def shard_of(value: Tensor, param: Tensor) -> Tensor:
    """This process's shard of the whole tensor ``value`` for ``param`` (``value`` itself
    when ``param`` is not sharded): the inverse of :func:`full_tensor`."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(param, dtensor):
        return value
    from torch.distributed.tensor import distribute_tensor

    placed = distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
    return placed.to_local()
