"""``SparseSAMEngine.train_step``: one step of a plain PyTorch training loop (optionally under
DDP), built over the engine's :meth:`~lightning_slsam.SparseSAMEngine.step`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_slsam.core.contract import (
    PER_SAMPLE_NEEDED,
    PassOutput,
    StepContext,
    StepResult,
    split_per_sample,
)
from lightning_slsam.parallel.ddp import GradientAverager, ddp_averager

__all__ = ["PlainLoopPasses", "PlainLoopStep"]


class PlainLoopPasses:
    """The ``forward_backward`` of a plain PyTorch loop (:meth:`SparseSAMEngine.train_step`).

    ``compute_loss()`` runs the forward pass on the current batch and returns the loss;
    methods that address single samples call ``compute_loss(index)`` with a tensor of
    sample indices. A 1-D loss is a vector of per-sample losses (averaged for the update).
    """

    def __init__(
        self,
        compute_loss: Callable[..., Tensor],
        batch_size: int | None,
        needs_per_sample: bool = False,
    ) -> None:
        self.compute_loss = compute_loss
        self.batch_sizes = [batch_size] if batch_size else []
        self.needs_per_sample = needs_per_sample

    def __call__(
        self, subsets: list[Tensor] | None = None, backward: bool = True, loss_scale: float = 1.0
    ) -> PassOutput:
        index = subsets[0] if subsets else None
        if index is not None and index.numel() == 0:
            return PassOutput(torch.zeros(()), [None])
        with torch.set_grad_enabled(backward and torch.is_grad_enabled()):
            loss = self.compute_loss() if index is None else self.compute_loss(index)
        loss, per_sample = split_per_sample(loss)
        if per_sample is None and self.needs_per_sample:
            raise ValueError(PER_SAMPLE_NEEDED)
        if backward and loss.requires_grad:  # False when no active layer reaches it
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
        return PassOutput(loss.detach(), [per_sample])


class PlainLoopStep:
    """The engine's step for a plain PyTorch loop (a base class of
    :class:`~lightning_slsam.SparseSAMEngine`): :meth:`train_step` builds the passes and the
    optimizer calls that :meth:`SparseSAMEngine.step` takes, on one process or under DDP."""

    _ddp: tuple[torch.nn.Module, GradientAverager] | None = None
    _module: torch.nn.Module | None
    needs_per_sample: bool
    step: Callable[..., StepResult]

    def train_step(
        self,
        compute_loss: Callable[..., Tensor],
        optimizer: torch.optim.Optimizer,
        batch_size: int | None = None,
        *,
        ddp: torch.nn.Module | None = None,
    ) -> StepResult:
        """One step in a plain PyTorch loop.

        Args:
            compute_loss: runs the forward pass on the current batch and returns the loss
                (called once per pass; back-propagation is done here). Methods that
                address single samples (ESAM's data selection, SSAM-F) call it as
                ``compute_loss(index)`` with a tensor of sample indices, and ESAM needs it
                to return per-sample losses (a 1-D tensor; it is averaged for the update).
            optimizer: the base optimizer; not stepped at all when the step is skipped.
            batch_size: samples in the batch (needed by ESAM and SSAM-F).
            ddp: when several processes train with DDP, the ``DistributedDataParallel``
                wrapper that ``compute_loss`` runs. Build the engine on the wrapped module
                (``make_engine(method, ddp.module, seed=...)``), with the same ``seed`` on
                every process. The step runs inside ``ddp.no_sync()``; the engine averages
                the active layers' gradients itself, and its first step checks that every
                process drew the same layers. (FSDP2 needs nothing: its parameters average.)
        """

        forward_backward = PlainLoopPasses(compute_loss, batch_size, self.needs_per_sample)

        def optimizer_step(skip: bool) -> None:
            if not skip:
                optimizer.step()

        def zero_grad() -> None:
            optimizer.zero_grad(set_to_none=True)

        if ddp is None:
            return self.step(forward_backward, zero_grad, optimizer_step)
        first = self._ddp is None or self._ddp[0] is not ddp
        if first:
            self._ddp = (ddp, ddp_averager(ddp, self._module))
        with ddp.no_sync():
            context = StepContext(averager=self._ddp[1], check_draw=first)
            return self.step(forward_backward, zero_grad, optimizer_step, context)
