"""SAM's ascent ``e = rho * g / ||g||`` on the active tensors, and its exact undo.

``adaptive=True`` is ASAM, ``e = rho * T_w^2 g / ||T_w g||``, ``T_w = |w| + eta`` for weights
(docs/methods.md). The restore copies back a pre-ascent backup: subtracting ``e`` is not exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_slsam.parallel.shards import WHOLE, Shards

__all__ = ["ASAM_ETA", "PERTURBATION_NORMS", "BackupPool", "SAMPerturbation", "copy_values",
           "group_norms", "is_weight_name"]  # fmt: skip

PERTURBATION_NORMS = ("global", "layer")
#: ASAM's ``eta`` in ``T_w = |w| + eta``: its reference value.
ASAM_ETA = 0.01


def is_weight_name(name: str) -> bool:
    """Whether ASAM scales the parameter ``name``: its last dotted part contains ``weight``."""
    return "weight" in name.rsplit(".", 1)[-1]


def group_norms(norms: Tensor, slots: Tensor, num_groups: int) -> Tensor:
    """L2 norm of each group from per-tensor norms (``slots[i]`` is tensor i's group)."""
    squares = torch.zeros(num_groups, device=norms.device, dtype=norms.dtype)
    if norms.numel():
        squares.index_add_(0, slots.to(norms.device, non_blocking=True), norms.square())
    return squares.sqrt()


class BackupPool:
    """Reused flat buffers, one per dtype and device, holding the pre-ascent copies."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def copy(self, tensors: list[Tensor]) -> list[Tensor]:
        """Views of the pool holding copies of ``tensors``."""
        need: dict[tuple[torch.dtype, torch.device], int] = {}
        for t in tensors:
            key = (t.dtype, t.device)
            need[key] = need.get(key, 0) + t.numel()
        for key, numel in need.items():
            buffer = self._buffers.get(key)
            if buffer is None or buffer.numel() < numel:
                self._buffers[key] = torch.empty(numel, dtype=key[0], device=key[1])
        offsets = dict.fromkeys(need, 0)
        views = []
        for t in tensors:
            key = (t.dtype, t.device)
            start = offsets[key]
            views.append(self._buffers[key][start : start + t.numel()].view_as(t))
            offsets[key] = start + t.numel()
        copy_values(views, [t.detach() for t in tensors])
        return views


def copy_values(dst: list[Tensor], src: list[Tensor]) -> None:
    """``dst[i].copy_(src[i])``: one foreach kernel on accelerators, a loop on the CPU."""
    if not dst:
        return
    if dst[0].device.type == "cpu":
        for d, s in zip(dst, src):
            d.copy_(s)
    else:
        torch._foreach_copy_(dst, src)


class SAMPerturbation:
    """SAM's ascent ``w <- w + e`` with an exact restore.

    Args:
        rho: perturbation radius (> 0).
        norm: ``"global"`` (default: one norm), ``"layer"`` or ``"none"`` (``rho`` ignored).
        adaptive: ASAM's weight-scaled perturbation (default ``False``).
        eta: ASAM's offset in ``T_w = |w| + eta`` (>= 0; default :data:`ASAM_ETA`).
        eps: added to the norm so a zero gradient gives a zero perturbation (default 1e-12).

    Example:
        >>> import torch
        >>> w = [torch.zeros(3), torch.ones(2)]
        >>> g = [torch.tensor([3.0, 0.0, 4.0]), torch.zeros(2)]
        >>> ascent = SAMPerturbation(rho=0.5)
        >>> norms = torch.stack([gi.norm() for gi in g])
        >>> backup = ascent.perturb_(w, g, norms)  # w += rho * g / ||g||
        >>> w[0], w[1]
        (tensor([0.3000, 0.0000, 0.4000]), tensor([1., 1.]))
        >>> ascent.restore_(w, backup)  # bit for bit
        >>> w[0], w[1]
        (tensor([0., 0., 0.]), tensor([1., 1.]))
    """

    def __init__(self, rho: float, norm: str = "global", adaptive: bool = False, eps: float = 1e-12,
                 eta: float = ASAM_ETA) -> None:  # fmt: skip
        self.rho = float(rho)
        self.norm = norm
        self.adaptive = adaptive
        self.eta = float(eta)
        self.eps = float(eps)
        self.pool = BackupPool()

    @torch.no_grad()
    def perturb_(self, params: list[Tensor], grads: list[Tensor], norms: Tensor,
                 slots: Tensor | None = None, num_groups: int | None = None, inplace: bool = True,
                 masks: list[Tensor] | None = None, scaled: list[bool] | None = None,
                 shards: Shards = WHOLE) -> list[Tensor]:  # fmt: skip
        """Move ``params`` along ``grads`` in place; return the backup for :meth:`restore_`.

        Args:
            params: the tensors to perturb.
            grads: their ascent directions (same order).
            norms: per-tensor norms of ``grads`` (``shards.norms(grads)``).
            slots: each tensor's group, for ``norm="layer"`` (default: one per tensor).
            num_groups: number of groups ``slots`` indexes into.
            inplace: scale ``grads`` into the ascent step; ``False`` leaves them intact.
            masks: per-tensor coordinate masks (SSAM-F), applied after normalisation.
            scaled: with ``adaptive``, which tensors are scaled by ``|w| + eta`` (default: all).
            shards: where the tensors' elements live (FSDP2: each process moves its own).
        """
        if not params:
            return []
        whole = params
        params, grads = shards.local(params), shards.local(grads)
        backup = self.pool.copy(params)
        step = grads if inplace else torch._foreach_mul(grads, 1.0)
        weighted: list[Tensor] = []
        if self.adaptive:
            chosen = (
                range(len(params)) if scaled is None else [i for i, f in enumerate(scaled) if f]
            )
            weighted = [step[i] for i in chosen]  # the same tensors: scaled in place below
            if weighted:
                weights = torch._foreach_abs([params[i] for i in chosen])
                torch._foreach_add_(weights, self.eta)
                torch._foreach_mul_(weighted, weights)  # T_w g
            norms = shards.norms(step, norms.device, like=whole)
        dtype = step[0].dtype
        if self.norm == "none":  # the directions are the move (ARWP's noise)
            pass
        elif self.norm == "global":
            scale = self.rho / (torch.linalg.vector_norm(norms) + self.eps)
            torch._foreach_mul_(step, scale.to(dtype))
        else:
            if slots is None:
                slots, num_groups = torch.arange(len(params)), len(params)
            per_tensor = group_norms(norms, slots, num_groups or len(params))[
                slots.to(norms.device)
            ]
            torch._foreach_mul_(step, list((self.rho / (per_tensor + self.eps)).to(dtype).unbind()))
        if weighted:
            torch._foreach_mul_(weighted, weights)  # rho * T_w^2 g / ||T_w g||
        if masks is not None:
            torch._foreach_mul_(step, masks)
        torch._foreach_add_(params, step)
        return backup

    @staticmethod
    @torch.no_grad()
    def restore_(params: list[Tensor], backup: list[Tensor], shards: Shards = WHOLE) -> None:
        """Copy the pre-ascent values back, bit for bit."""
        copy_values(shards.local(params), backup)
