"""What a training step runs its gradient passes through, and what it reports.

The training loop hands the engine a :class:`ForwardBackward` callable (the one contract
between the engine and any loop: Lightning's mixin, :meth:`SparseSAMEngine.train_step`,
or your own), and gets a :class:`StepResult` back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from lightning_slsam.distributed import GradientAverager, ddp_averager
from lightning_slsam.freezing import LayerFreezer
from lightning_slsam.perturbation import tensor_norms
from lightning_slsam.schedules import STEP_KINDS

__all__ = [
    "PER_SAMPLE_NEEDED",
    "ForwardBackward",
    "GradientPass",
    "PassOutput",
    "PlainLoopPasses",
    "PlainLoopStep",
    "StepCall",
    "StepContext",
    "StepResult",
    "average_grads",
    "check_same_draw",
    "gradient_pass",
]


#: The error for a loss without per-sample losses where ESAM's data selection needs them,
#: raised at the first pass of the first step, before its backward pass: nothing has
#: changed yet.
PER_SAMPLE_NEEDED = (
    "ESAM's data selection (data_ratio < 1) needs per-sample losses, but the loss is a"
    " scalar: return them from training_step (or compute_loss) as a 1-D tensor, e.g."
    " F.cross_entropy(logits, y, reduction='none') (it is averaged for the update), or as"
    " {'loss': ..., 'per_sample_loss': ...}; or set data_ratio=1.0 to turn the selection off."
)


@dataclass
class PassOutput:
    """What ``forward_backward`` returns when it has more than the loss to report.

    Attributes:
        loss: the detached (scalar) loss of the pass.
        per_sample: detached per-sample losses, one tensor per micro-batch, if known.
    """

    loss: Tensor
    per_sample: list[Tensor | None] | None = None


class ForwardBackward(Protocol):
    """The callable a step runs its passes through (given by the training loop).

    ``forward_backward(subsets=None, backward=True)`` computes the loss on the current
    batch (each micro-batch ``i`` restricted to the sample indices ``subsets[i]`` when
    given, skipped when that index tensor is empty), back-propagates it when ``backward``
    and returns it detached -- as a tensor, or as a :class:`PassOutput` carrying per-sample
    losses (needed by ESAM's data selection). Methods that address single samples (ESAM,
    SSAM-F) also read its ``batch_sizes`` attribute (samples per micro-batch). SSAM-F
    under FSDP2 also passes ``loss_scale`` (the loss is multiplied by it before the
    backward pass). Simple callables without arguments serve every other method.
    """

    def __call__(
        self, subsets: list[Tensor] | None = None, backward: bool = True
    ) -> Tensor | PassOutput: ...


@dataclass
class StepContext:
    """How the surrounding trainer scales gradients and talks to other processes.

    Attributes:
        grad_scale: returns the current loss scale of a gradient scaler (a tensor on the
            gradients' device) when one is in use: the per-layer norms the selection learns
            from are divided by it. Everything else SAM computes is scale-free.
        averager: averages gradients across processes (DDP); ``None`` on one process.
        check_draw: check on this step that every process drew the same layers (what
            ``check_masks`` does on every step).
    """

    grad_scale: Callable[[], Tensor] | None = None
    averager: GradientAverager | None = None
    check_draw: bool = False


@dataclass
class StepResult:
    """What happened in one step.

    Attributes:
        loss: first-pass loss, detached.
        active_mask: bool ``[num_layers]`` CPU mask of the layers the optimizer updated.
        pass_numel: parameters with a gradient in each training backward pass.
        trainable_numel: parameters that could take part (the ratios' denominator).
        kind: ``"sam"``, ``"plain"``, ``"reuse"`` or ``"single"``.
        extra_backward: backward passes outside the training passes (SSAM-F's Fisher).
        allreduce_bytes: bytes this process all-reduced across processes this step.
        skipped: whether the update was skipped; ``skip_reason`` says why.
        drawn: whether the selection drew the active set. A forced dense step (the plain
            first step of single-step SAM) is not a draw, and the selection does not learn
            from it.
    """

    loss: Tensor | None
    active_mask: Tensor
    trainable_numel: int
    kind: str
    pass_numel: list[int] = field(default_factory=list)
    extra_backward: int = 0
    allreduce_bytes: int = 0
    skipped: bool = False
    skip_reason: str | None = None
    drawn: bool = True

    @property
    def num_backward(self) -> int:
        """Backward passes run, extra ones included."""
        return len(self.pass_numel) + self.extra_backward

    @property
    def active_ratio_per_pass(self) -> list[float]:
        """Fraction of trainable parameters with a gradient, per training pass."""
        return [n / max(self.trainable_numel, 1) for n in self.pass_numel]

    @property
    def active_ratio(self) -> float:
        """The SL-SAM paper's "Active Ratio": that fraction summed over the training passes
        (plain AdamW 1.0, SAM 2.0)."""
        return sum(self.active_ratio_per_pass)


@dataclass
class StepCall:
    """One step being run: its result so far, the loop's callables and context."""

    result: StepResult
    forward_backward: ForwardBackward
    zero_grad: Callable[[], None]
    optimizer_step: Callable[[bool], None]
    context: StepContext


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


def as_output(value: Tensor | PassOutput) -> PassOutput:
    return value if isinstance(value, PassOutput) else PassOutput(value, None)


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
        per_sample = loss.detach() if loss.dim() == 1 else None
        if per_sample is None and self.needs_per_sample:
            raise ValueError(PER_SAMPLE_NEEDED)
        loss = loss.mean() if loss.dim() == 1 else loss
        if backward and loss.requires_grad:  # False when no active layer reaches it
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
        return PassOutput(loss.detach(), [per_sample])


class PlainLoopStep:
    """The engine's step for a plain PyTorch loop (a base class of
    :class:`~lightning_slsam.SparseSAMEngine`): :meth:`train_step` builds the passes and the
    optimizer calls that :meth:`SparseSAMEngine.step` takes, on one process or under DDP."""

    _ddp: tuple[torch.nn.Module, GradientAverager] | None = None
    _module: torch.nn.Module | None
    data_ratio: float
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

        forward_backward = PlainLoopPasses(compute_loss, batch_size, self.data_ratio < 1)

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
