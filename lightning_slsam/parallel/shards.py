"""The one seam between the step and sharded parameters: :class:`Shards` for whole tensors
(one device, DDP) or :class:`FSDP2Shards` (``fully_shard``): the tensors to change in place,
norms and sums completed across shards, and whole tensors for a checkpoint.

>>> import torch
>>> seam = shards_of([torch.zeros(2)], None)
>>> type(seam).__name__, seam.sharded
('Shards', False)
>>> seam.norms([torch.tensor([3.0, 4.0]), torch.ones(4)]).tolist()
[5.0, 2.0]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "WHOLE",
    "FSDP2Shards",
    "Shards",
    "fsdp_modules",
    "reshard",
    "shards_of",
    "top_coordinates",
]


def _dtensor_type() -> type | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def fsdp_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP2 modules in ``module``, root first (``[]`` without a process group)."""
    if _dtensor_type() is None:
        return []
    from torch.distributed.fsdp import FSDPModule

    return [sub for sub in module.modules() if isinstance(sub, FSDPModule)]


def reshard(modules: Sequence[torch.nn.Module]) -> None:
    """Reshard FSDP2 ``modules`` a forward without backward left unsharded (else a no-op)."""
    for sub in modules:
        sub.reshard()  # type: ignore[operator]


class Shards:
    """Whole tensors on every process (one device, DDP). Norms are float32 (float64 stays)."""

    #: Whether parameters are FSDP2 shards (their gradients arrive averaged).
    sharded = False

    def local(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """The tensors to change in place (here: the tensors themselves)."""
        return list(tensors)

    def norms(
        self, tensors: Sequence[Tensor], device: torch.device | None = None, like: Any = None
    ) -> Tensor:
        """L2 norm of each tensor as one vector (on ``device`` if given). ``like``: the
        parameters whose sharding ``tensors`` (local shards kept as state) follow."""
        if not tensors:
            return torch.zeros(0, dtype=torch.float32, device=device)
        norms = torch.stack(torch._foreach_norm(list(tensors)))
        norms = norms.to(torch.promote_types(norms.dtype, torch.float32))
        return norms if device is None else norms.to(device)

    def sums(self, values: Tensor, tensors: Sequence[Tensor]) -> Tensor:
        """Per-tensor sums completed over shards; ``values[i]`` belongs to ``tensors[i]``."""
        return values

    def top(self, values: Sequence[Tensor], keep: int, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Masks of the ``keep`` largest coordinates of ``values`` (:func:`top_coordinates`)."""
        return top_coordinates(values, keep, None)

    def group(self, tensors: Sequence[Tensor]) -> Any:
        """The process group of ``tensors``' shards (``None``: whole tensors)."""
        return None

    def full(self, value: Tensor, param: Tensor) -> Tensor:
        """The whole tensor of per-tensor state ``value`` kept for ``param``."""
        return value

    def shard(self, value: Tensor, param: Tensor) -> Tensor:
        """This process's part of the whole tensor ``value`` kept for ``param``."""
        return value

    def local_rows(self, value: Tensor, param: Tensor) -> Tensor:
        """This process's rows of ``value`` (shaped as ``param``), cut without communicating."""
        return value

    def reshard(self) -> None:
        """Put the sharded parameters back in place after a forward without backward."""


#: The seam of whole tensors (it holds no state: one serves every engine).
WHOLE = Shards()


#: Which of a list of tensors are sharded, and the process group of their shards.
_Layout = tuple[list[bool], Any]


def _layout(tensors: Sequence[Tensor]) -> _Layout | None:
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
    return (flags, group) if group is not None else None


def _sum_over_shards(values: Tensor, layout: _Layout | None) -> Tensor:
    if layout is None or values.numel() == 0:
        return values
    flags, group = layout
    mask = torch.tensor(flags, dtype=torch.bool, device=values.device)
    mask = mask.view(-1, *[1] * (values.dim() - 1))
    partial = torch.where(mask, values, torch.zeros_like(values))
    dist.all_reduce(partial, group=group)
    return torch.where(mask, partial, values)


class FSDP2Shards(Shards):
    """Parameters sharded by FSDP2's ``fully_shard``: each process changes its own shards,
    and sums over a tensor's elements are completed across the shards.

    Args:
        modules: the FSDP2 modules of the model (:func:`fsdp_modules`).
    """

    sharded = True

    def __init__(self, modules: Sequence[torch.nn.Module]) -> None:
        self.modules = list(modules)

    def local(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        # The shard shares storage with the DTensor: in-place arithmetic changes it.
        dtensor = _dtensor_type()
        if dtensor is None:
            return list(tensors)
        with torch.no_grad():  # the shard itself, not an autograd view of it
            return [t.to_local() if isinstance(t, dtensor) else t for t in tensors]

    def norms(
        self, tensors: Sequence[Tensor], device: torch.device | None = None, like: Any = None
    ) -> Tensor:
        layout = _layout(tensors if like is None else like)
        local = self.local(tensors) if like is None else list(tensors)
        if not local:
            return torch.zeros(0, dtype=torch.float32, device=device)
        norms = torch.stack(torch._foreach_norm(local))
        norms = norms.to(torch.promote_types(norms.dtype, torch.float32))
        if layout is not None:
            norms = _sum_over_shards(norms.square(), layout).sqrt()
        return norms if device is None else norms.to(device)

    def sums(self, values: Tensor, tensors: Sequence[Tensor]) -> Tensor:
        return _sum_over_shards(values, _layout(tensors))

    def top(self, values: Sequence[Tensor], keep: int, tensors: Sequence[Tensor]) -> list[Tensor]:
        return top_coordinates(values, keep, _layout(tensors))

    def group(self, tensors: Sequence[Tensor]) -> Any:
        layout = _layout(tensors)
        return layout[1] if layout is not None else None

    def full(self, value: Tensor, param: Tensor) -> Tensor:
        dtensor = _dtensor_type()
        if dtensor is None or not isinstance(param, dtensor):
            return value
        shard = value.to_local() if isinstance(value, dtensor) else value
        whole = dtensor.from_local(
            shard, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
        return whole.full_tensor()

    def shard(self, value: Tensor, param: Tensor) -> Tensor:
        dtensor = _dtensor_type()
        if dtensor is None or not isinstance(param, dtensor):
            return value
        from torch.distributed.tensor import distribute_tensor

        placed = distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
        return placed.to_local()

    def local_rows(self, value: Tensor, param: Tensor) -> Tensor:
        dtensor = _dtensor_type()
        if dtensor is None or not isinstance(param, dtensor):
            return value
        # FSDP2 cuts dimension 0 as torch.chunk does: ceil(rows / processes) rows each.
        mesh, rows = param.device_mesh, param.to_local().shape[0]
        start = mesh.get_local_rank() * math.ceil(param.shape[0] / mesh.size())
        return value[start : start + rows]

    def reshard(self) -> None:
        reshard(self.modules)


def shards_of(params: Sequence[Tensor], module: torch.nn.Module | None) -> Shards:
    """The seam for ``params`` (a model's trainable tensors): :class:`FSDP2Shards` when any
    of them is an FSDP2 shard, else :class:`Shards`.

    Raises:
        ValueError: for a tensor sharded over a multi-dimensional mesh (unsupported).
    """
    if _layout(params) is None:
        return WHOLE
    return FSDP2Shards(fsdp_modules(module) if module is not None else [])


def top_coordinates(values: Sequence[Tensor], keep: int, layout: _Layout | None) -> list[Tensor]:
    """Bool masks of the ``keep`` largest coordinates of ``values`` (magnitudes compared),
    over all tensors and, for sharded ones, all their shards.

    Ties go by position, so the choice is the same on any number of shards.

    Example:
        >>> values = [torch.tensor([0.1, 0.9, 0.5]), torch.tensor([0.5, 0.0])]
        >>> masks = top_coordinates(values, 3, None)
        >>> [m.tolist() for m in masks]  # 0.9, then the first 0.5, then the second
        [[False, True, True], [True, False]]
    """
    device = values[0].device if values else torch.device("cpu")
    flags, group = layout if layout is not None else ([False] * len(values), None)
    world = dist.get_world_size(group) if layout is not None else 1
    rank = dist.get_rank(group) if layout is not None else 0
    # Non-negative float32 compare like their int32 bit patterns (NaN counts as largest).
    bits = [v.detach().float().abs().nan_to_num(nan=float("inf")).reshape(-1).view(torch.int32)
            for v in values]  # fmt: skip
    # A tensor every process holds whole is counted once (process 0's copy).
    counted = [b for b, sharded in zip(bits, flags) if sharded or rank == 0]
    flat = torch.cat(counted) if counted else torch.zeros(0, dtype=torch.int32, device=device)

    def reduce(counts: Tensor) -> Tensor:
        if layout is not None:
            dist.all_reduce(counts, group=group)
        return counts

    # The largest threshold t with at least `keep` coordinates >= t, 4 bits at a time.
    low = 0
    for shift, width in ((27, 4), (23, 4), (19, 4), (15, 4), (11, 4), (7, 4), (3, 4), (0, 3)):
        steps = torch.arange(1, 2**width, dtype=torch.int64, device=device)
        bounds = (low + (steps << shift)).clamp(max=2**31 - 1).to(torch.int32)
        below = torch.bucketize(flat, bounds, right=True)  # bounds <= value
        at_least = reduce(torch.bincount(below, minlength=2**width).flip(0).cumsum(0).flip(0))
        reached = (at_least[1:] >= keep).nonzero()
        if len(reached):
            low = int(bounds[int(reached[-1])])
    # Above the threshold everything is kept; the ties fill up to `keep` in position order.
    ties = [b == low for b in bits]
    mine = torch.tensor([int(t.sum()) if f or rank == 0 else 0 for t, f in zip(ties, flags)]
                         + [int((flat > low).sum())], dtype=torch.int64, device=device)  # fmt: skip
    if layout is not None:
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        table = torch.stack(gathered)  # [process, tensor + 1]
    else:
        table = mine[None]
    need = keep - int(table[:, -1].sum())
    blocks = table[:, :-1].t().reshape(-1)  # position order: tensor, then process
    before = blocks.cumsum(0) - blocks
    quota = (need - before).clamp(min=0).minimum(blocks).view(len(values), world)
    masks = []
    for i, (b, tie) in enumerate(zip(bits, ties)):
        take = int(quota[i, rank if flags[i] else 0])
        masks.append(((b > low) | (tie & (tie.cumsum(0) <= take))).view_as(values[i]))
    return masks
