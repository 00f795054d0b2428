"""What a training step runs its gradient passes through, and what it reports.

The training loop hands the engine a :class:`ForwardBackward` callable (the one contract
between the engine and any loop: Lightning's mixin, :meth:`SparseSAMEngine.train_step`,
or your own), and gets a :class:`StepResult` back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from lightning_slsam.parallel.ddp import GradientAverager

__all__ = [
    "PER_SAMPLE_NEEDED",
    "ForwardBackward",
    "PassOutput",
    "StepCall",
    "StepContext",
    "StepResult",
    "split_per_sample",
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


def split_per_sample(loss: Tensor) -> tuple[Tensor, Tensor | None]:
    """The one rule for a loss tensor, in every loop: a 1-D tensor holds per-sample losses,
    whose mean is the loss of the update; any other tensor is the loss itself.

    Returns the loss and the detached per-sample losses (``None`` when not given).

    >>> import torch
    >>> split_per_sample(torch.tensor([1.0, 3.0]))
    (tensor(2.), tensor([1., 3.]))
    >>> split_per_sample(torch.tensor(2.0))
    (tensor(2.), None)
    """
    if loss.dim() == 1:
        return loss.mean(), loss.detach()
    return loss, None


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


def as_output(value: Tensor | PassOutput) -> PassOutput:
    return value if isinstance(value, PassOutput) else PassOutput(value, None)
