"""SAM's ascent step and its exact undo, on the active tensors only.

The ascent is ``e = rho * g / ||g||`` (Foret et al., 2021). By default ``||g||`` is
one norm over every active tensor together, as SAM and the SL-SAM reference code
compute it; ``norm="layer"`` normalises each layer separately, as Algorithm 1 of the
SL-SAM paper is written (then the total perturbation has norm ``rho * sqrt(#active)``).

Restoring uses a copy of the active tensors taken before the ascent: subtracting ``e``
again is not exact in floating point, and the base optimizer must step from exactly
the weights it would have seen without SAM. Only active tensors are copied, so the
backup costs ``active ratio x`` one weight copy instead of a full one.

Everything here stays on the tensors' device (``torch._foreach_*`` kernels, no
``.item()``): the hot path never waits for the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["PERTURBATION_NORMS", "SAMPerturbation", "tensor_norms"]

PERTURBATION_NORMS = ("global", "layer")


def tensor_norms(grads: list[Tensor], device: torch.device | None = None) -> Tensor:
    """L2 norm of each tensor in ``grads`` as one float32 vector (on ``device`` if given).

    Float32 whatever the gradients' dtype: the norms feed the bandit and the perturbation
    scale, and low-precision or float64 models must not change their bookkeeping dtype.
    """
    if not grads:
        return torch.zeros(0, dtype=torch.float32, device=device)
    norms = torch.stack(torch._foreach_norm(grads)).float()
    return norms if device is None else norms.to(device)


class SAMPerturbation:
    """SAM's ascent ``w <- w + rho * g / (||g|| + eps)`` with an exact restore.

    Args:
        rho: perturbation radius (> 0). Paper default 0.01 for fine-tuning.
        norm: ``"global"`` (default; one norm over all active tensors, as SAM) or
            ``"layer"`` (one norm per layer, as Algorithm 1 of the SL-SAM paper reads).
        eps: added to the norm so a zero gradient gives a zero perturbation.
    """

    def __init__(self, rho: float, norm: str = "global", eps: float = 1e-12) -> None:
        if not (isinstance(rho, (int, float)) and rho > 0 and rho == rho and rho != float("inf")):
            raise ValueError(
                f"`rho` must be a finite number > 0 (the SAM perturbation radius), got {rho!r}."
                " The paper uses rho=0.01 for fine-tuning."
            )
        if norm not in PERTURBATION_NORMS:
            raise ValueError(
                f"`perturbation_norm` must be one of {PERTURBATION_NORMS}, got {norm!r}."
            )
        self.rho = float(rho)
        self.norm = norm
        self.eps = float(eps)

    @torch.no_grad()
    def perturb_(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        norms: Tensor,
        group_norms: Tensor | None = None,
    ) -> list[Tensor]:
        """Move ``params`` along ``grads`` in place; return the backup for :meth:`restore_`.

        Args:
            params: the active tensors that received a gradient.
            grads: their first-pass gradients (same order); overwritten with the ascent step.
            norms: per-tensor gradient norms, as from :func:`tensor_norms`.
            group_norms: for ``norm="layer"``, the norm each tensor is normalised by
                (its layer's norm), one entry per tensor.
        """
        backup = [p.detach().clone() for p in params]
        if not params:
            return backup
        # The gradients are scaled in place into the ascent step: the caller discards them
        # right after, and this saves allocating a second active-sized buffer.
        if self.norm == "global":
            scale = self.rho / (norms.square().sum().sqrt() + self.eps)
            torch._foreach_mul_(grads, scale.to(grads[0].dtype))
        else:
            if group_norms is None:
                raise ValueError("norm='layer' needs `group_norms`.")
            scales = self.rho / (group_norms + self.eps)
            torch._foreach_mul_(grads, list(scales.to(grads[0].dtype).unbind()))
        torch._foreach_add_(params, grads)
        return backup

    @staticmethod
    @torch.no_grad()
    def restore_(params: list[Tensor], backup: list[Tensor]) -> None:
        """Copy the pre-ascent values back, bit for bit."""
        if params:
            torch._foreach_copy_(params, backup)
