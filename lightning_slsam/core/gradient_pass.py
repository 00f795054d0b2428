"""One gradient pass of a step on the active tensors (with multi-process averaging when a
context gives an averager), and the check that every process drew the same layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_slsam.core.contract import (
    PassOutput,
    StepCall,
    as_output,
)
from lightning_slsam.core.freezing import LayerFreezer
from lightning_slsam.core.perturbation import tensor_norms
from lightning_slsam.core.schedules import STEP_KINDS
from lightning_slsam.parallel.ddp import GradientAverager

__all__ = ["GradientPass", "average_grads", "check_same_draw", "gradient_pass"]


@dataclass
class GradientPass:
    """One gradient pass's results (all on the device)."""

    output: PassOutput
    active: list[Tensor]
    params: list[Tensor]  # active tensors that received a gradient
    grads: list[Tensor]
    slots: Tensor  # each tensor's normalisation group
    norms: Tensor  # per-tensor gradient norms
    layer_norms: Tensor  # per-layer gradient norms

    def scalars(self) -> list[Tensor]:
        """The pass's loss and a finiteness probe of its gradients."""
        return [self.output.loss, self.norms.sum()]


def gradient_pass(
    freezer: LayerFreezer,
    call: StepCall,
    active: list[Tensor],
    mask: Tensor,
    subsets: list[Tensor] | None = None,
    sync: bool = True,
) -> GradientPass:
    """One forward/backward on the ``active`` tensors; gradients and norms kept on device.

    Under multi-process training the gradients are averaged across processes first
    (``sync``); otherwise the per-layer norms alone are.
    """
    result = call.result
    call.zero_grad()
    fb = call.forward_backward
    output = as_output(fb(subsets=subsets) if subsets else fb())
    if result.loss is None:
        result.loss = output.loss
    result.pass_numel.append(freezer.numel(mask))
    # FSDP2 has averaged sharded gradients already (reduce-scatter).
    averager = None if freezer.sharded else call.context.averager
    if averager is not None and sync:
        result.allreduce_bytes += average_grads(active, averager)
    params, grads, slots = freezer.with_grad(active)
    norms = tensor_norms(grads, output.loss.device)
    layer_norms = freezer.layer_norms(norms, slots)
    if averager is not None and not sync:
        result.allreduce_bytes += averager.average_([layer_norms])
    return GradientPass(output, active, params, grads, slots, norms, layer_norms)


@torch.no_grad()
def average_grads(active: list[Tensor], averager: GradientAverager) -> int:
    """Average the active tensors' gradients across processes.

    Every process sends every active tensor (the sets are equal on all ranks), a zero
    gradient standing in for a missing one; a presence flag per tensor travels in the
    same collective, so a tensor no process used keeps ``grad=None``, as on one process.
    """
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


def check_same_draw(mask: Tensor, kind: str, step: int, averager: GradientAverager) -> None:
    """Debug mode under DDP: every process must draw the same layers and step kind.

    Two checksums of the mask and the kind are gathered from every process (one small
    collective); on a mismatch every process raises the same error before touching a
    weight, instead of hanging in a gradient all-reduce of different tensors.
    """
    index = torch.arange(1, mask.numel() + 1, dtype=torch.int64, device=mask.device)
    bits = mask.to(torch.int64)
    code = STEP_KINDS.index(kind) if kind in STEP_KINDS else len(STEP_KINDS)
    value = torch.stack([(bits * index).sum(), (bits * (index * index % 1_000_003)).sum(),
                         bits.sum() * 8 + code])  # fmt: skip
    seen = averager.gather(value).cpu()
    differ = [rank for rank in range(len(seen)) if not torch.equal(seen[rank], seen[0])]
    if differ:
        counts = seen[:, 2] // 8
        raise RuntimeError(
            f"check_masks: at step {step} process(es) {differ} drew other layers"
            f" or another step kind than process 0 (active layers per process:"
            f" {counts.tolist()}). The processes' selection generators have diverged:"
            " keep the seed the same on every process (the callback's `seed`, whose"
            " default None takes the `seed_everything` seed of rank 0; in a plain loop,"
            " `make_engine(..., seed=...)`) and do not draw from the engine's generators"
            " yourself."
        )
