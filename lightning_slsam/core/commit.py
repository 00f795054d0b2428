"""The end of every training step: one host transfer, then the update or a skip.

Every step kind ends here, through
:meth:`~lightning_slsam.core.step_parts.StepParts.commit`. The losses, a finiteness probe
of each pass and the per-layer gradient norms travel to the host together; a
non-finite value anywhere (on any process) skips the step with the weights restored exactly
and the optimizer, the selection and the counters unchanged.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_slsam.core.contract import StepCall
from lightning_slsam.core.partition import LayerPartition
from lightning_slsam.core.perturbation import BackupPool
from lightning_slsam.core.update_scaling import UpdateScaling
from lightning_slsam.selection.rules import LayerSelection

__all__ = ["finish_step"]


def finish_step(
    call: StepCall,
    first: list[Tensor],
    second: list[Tensor],
    layer_norms: Tensor,
    update_mask: Tensor,
    *,
    step: int,
    selection: LayerSelection,
    scaling: UpdateScaling | None,
    partition: LayerPartition,
    pool: BackupPool,
    record_norms: Callable[[Tensor, Tensor], None],
) -> bool:
    """Transfer, then update (stepping the optimizer, scaling the update, feeding the
    norms to the counters and to the selection when it drew the step) or skip; whether
    the update was made.

    ``first`` / ``second``: scalars (loss, gradient-norm probe) of each pass;
    ``layer_norms``: the first pass's per-layer norms, which the selection learns from;
    ``step``: the step's index (for the warning); ``pool``: the perturbation's buffers,
    free once its backup is restored (update scaling keeps the weights before the update
    there); ``record_norms``: the counters' record of a committed step.
    """
    result, context = call.result, call.context
    device = layer_norms.device
    scalars = torch.stack([s.detach().float().reshape(()).to(device) for s in (*first, *second)])
    if context.averager is not None:
        # Every process must take the same decision: one non-finite value anywhere
        # makes the mean non-finite everywhere.
        result.allreduce_bytes += context.averager.average_([scalars])
    if context.grad_scale is not None:
        # The selection learns from true gradient norms, not loss-scaled ones.
        layer_norms = layer_norms / context.grad_scale().to(device).float()
    host = torch.cat([scalars, layer_norms.float()]).cpu()
    finite = torch.isfinite(host)
    k1, k = len(first), len(scalars)
    where = " in the first pass" if second else ""
    if not bool(finite[:k1].all()) or not bool(finite[k:].all()):
        reason = f"non-finite loss or gradient{where}"
    elif not bool(finite[k1:k].all()):
        reason = "non-finite loss or gradient in the second pass"
    else:
        # The perturbation's backup was restored before this point: its pool is free.
        scaled = (
            scaling.before_update(result.active_mask, partition, pool)
            if scaling is not None
            else None
        )
        call.optimizer_step(False)
        if scaled is not None:
            UpdateScaling.apply(*scaled)
        norms = host[k:].double()
        record_norms(update_mask, norms)
        if result.drawn:
            selection.update(update_mask, norms)
        return True
    result.skipped = True
    result.skip_reason = reason
    call.zero_grad()
    warnings.warn(
        f"SL-SAM skipped step {step}: {reason}. Weights, optimizer state and"
        " layer selection are unchanged.",
        RuntimeWarning,
        stacklevel=5,
    )
    call.optimizer_step(True)
    return False
