"""The one pass loop every front-end uses: forward/backward over a step's micro-batches
(:class:`PassRunner`).

>>> import torch
>>> w = torch.nn.Parameter(torch.tensor(2.0))
>>> x = [torch.tensor([1.0, 3.0]), torch.tensor([5.0])]  # two micro-batches
>>> def loss(batch):  # per-sample losses: a 1-D tensor
...     return read_output(w * batch)
>>> passes = PassRunner(x, loss, torch.Tensor.backward, scale=0.5)
>>> out = passes()
>>> out.loss, w.grad  # (mean([2, 6]) + 10) / 2; its gradient (2 + 5) / 2
(tensor(7.), tensor(3.5000))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["OUTPUT_KEYS", "PER_SAMPLE_NEEDED", "LossOutput", "PassOutput", "PassRunner",
           "batch_size", "batch_subset", "first_tensor", "loss_scale_reader", "skip_with_scaler",
           "split_per_sample", "subset_batch"]  # fmt: skip


#: The error for a loss without the per-sample losses ESAM needs (raised before any backward).
PER_SAMPLE_NEEDED = (
    "ESAM's data selection (data_ratio < 1) needs per-sample losses, but the loss is a"
    " scalar: return them from training_step (or compute_loss) as a 1-D tensor, e.g."
    " F.cross_entropy(logits, y, reduction='none') (it is averaged for the update), or as"
    " {'loss': ..., 'per_sample_loss': ...}; or set data_ratio=1.0 to turn the selection off."
)


#: What a training step may return besides its loss (ESAM, SAF, MESA read them).
OUTPUT_KEYS = ("per_sample_loss", "logits", "index")


class LossOutput(NamedTuple):
    """One micro-batch's loss as the pass loop takes it (:func:`read_output`).

    Attributes:
        loss: the scalar loss to back-propagate.
        per_sample: each sample's loss, detached (``None``: not given).
        logits: the output logits, ``[batch, ..., classes]``, with their graph (or ``None``).
        index: each sample's position in the training set, ``[batch]`` (``None``: not given).
    """

    loss: Tensor
    per_sample: Tensor | None = None
    logits: Tensor | None = None
    index: Tensor | None = None


def read_output(output: Any, error: type[Exception] = ValueError) -> LossOutput:
    """A training step's return value: a tensor is the loss (1-D: per-sample losses, averaged);
    a mapping holds ``"loss"`` and maybe :data:`OUTPUT_KEYS`. ``error``: raised otherwise.

    >>> read_output(torch.tensor([1.0, 3.0])).loss
    tensor(2.)
    >>> out = read_output({"loss": torch.tensor(0.5), "logits": torch.zeros(2, 3),
    ...                    "index": torch.tensor([4, 7])})
    >>> out.loss, out.logits.shape, out.index.tolist()
    (tensor(0.5000), torch.Size([2, 3]), [4, 7])
    """
    mapping = isinstance(output, Mapping)
    loss = output.get("loss") if mapping else output
    per_sample = output.get("per_sample_loss") if mapping else None
    if isinstance(loss, Tensor) and per_sample is None:
        loss, per_sample = split_per_sample(loss)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else ""
        raise error(
            "The training step must return the loss: a scalar tensor, a 1-D tensor of"
            f" per-sample losses, or a dict with key 'loss'. It returned"
            f" {type(output).__name__}{shape}."
        )
    logits = output.get("logits") if mapping else None
    index = output.get("index") if mapping else None
    return LossOutput(
        loss.reshape(()),
        per_sample.detach().reshape(-1) if per_sample is not None else None,
        logits,
        index.reshape(-1) if isinstance(index, Tensor) else None,
    )


def split_per_sample(loss: Tensor) -> tuple[Tensor, Tensor | None]:
    """The loss and detached per-sample losses (1-D: their mean; else the loss, ``None``).

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
    """What one pass returns.

    Attributes:
        loss: the detached loss, summed over the scaled micro-batch losses.
        per_sample: detached per-sample losses per micro-batch (``None``: none, or skipped).
        logits: the detached logits per micro-batch, with ``keep_logits``; else empty.
    """

    loss: Tensor
    per_sample: list[Tensor | None]
    logits: list[Tensor | None] = field(default_factory=list)


class PassRunner:
    """Forward/backward passes over one step's micro-batches.

    Args:
        micro_batches: the step's micro-batches (one without accumulation).
        loss: ``loss(batch)`` returns one micro-batch's :class:`LossOutput`.
        backward: back-propagates a loss (``Tensor.backward``, ``manual_backward``, ...).
        scale: multiplies each micro-batch's loss (default 1; ``1 / k`` for ``k`` accumulated).
        size: samples in a micro-batch (default :func:`batch_size`).
        subset: ``subset(batch, index)`` cuts a micro-batch (default :func:`batch_subset`).
        needs_per_sample: a loss without per-sample losses raises ``error`` (default ``False``).
        error: the exception class of that error (default ``ValueError``).
        term_scale: multiplies a method's :attr:`extra_loss` term before ``scale`` (default 1).

    A call runs one pass: ``subsets[i]`` cuts micro-batch ``i`` (empty: skipped),
    ``backward=False`` runs forwards only, ``loss_scale`` multiplies every loss, ``keep_logits``
    keeps the logits. :attr:`number`: 1 in the first full pass, 2 in others, 0 between. A method
    sets :attr:`needs` (its name, the :data:`OUTPUT_KEYS` it reads) and :attr:`extra_loss`.
    """

    def __init__(self, micro_batches: Sequence[Any],
                 loss: Callable[[Any], tuple[Tensor, Tensor | None]],
                 backward: Callable[[Tensor], Any], *, scale: float = 1.0,
                 size: Callable[[Any], int] | None = None,
                 subset: Callable[[Any, Tensor], Any] | None = None, needs_per_sample: bool = False,
                 error: type[Exception] = ValueError, term_scale: float = 1.0) -> None:  # fmt: skip
        self.micro_batches = list(micro_batches)
        self.loss, self.backward, self.scale = loss, backward, float(scale)
        self.size = size if size is not None else batch_size
        self.subset = subset if subset is not None else batch_subset
        self.needs_per_sample, self.error = needs_per_sample, error
        self.term_scale = float(term_scale)
        self.needs: tuple[str, tuple[str, ...]] | None = None
        self.extra_loss: Callable[[int, LossOutput], Tensor | None] | None = None
        self.number = 0
        self._full_passes = 0

    @property
    def batch_sizes(self) -> list[int]:
        """Samples in each micro-batch."""
        return [self.size(batch) for batch in self.micro_batches]

    def __call__(self, subsets: list[Tensor] | None = None, backward: bool = True,
                 loss_scale: float = 1.0, keep_logits: bool = False) -> PassOutput:  # fmt: skip
        full = subsets is None and backward
        self.number = 1 if full and self._full_passes == 0 else 2
        self._full_passes += full
        scale = self.scale * loss_scale
        total: Tensor | None = None
        per_sample: list[Tensor | None] = []
        logits: list[Tensor | None] = []
        try:
            for i, batch in enumerate(self.micro_batches):
                if subsets is not None:
                    index = subsets[i]
                    if index.numel() == 0:
                        per_sample.append(None)
                        continue
                    batch = self.subset(batch, index)
                with torch.set_grad_enabled(backward and torch.is_grad_enabled()):
                    out = self.loss(batch)
                    loss = out.loss
                    if out.per_sample is None and self.needs_per_sample:
                        raise self.error(PER_SAMPLE_NEEDED)  # before any backward pass
                    if self.needs is not None:
                        self._check_outputs(out)
                    if self.extra_loss is not None and backward:
                        term = self.extra_loss(i, out)
                        if term is not None:
                            loss = loss + term * self.term_scale
                per_sample.append(out.per_sample)
                if keep_logits:
                    logits.append(out.logits.detach() if out.logits is not None else None)
                if scale != 1.0:
                    loss = loss * scale
                # No trainable tensor reached the loss: nothing to back-propagate (norm 0).
                if backward and loss.requires_grad:
                    self.backward(loss)
                loss = loss.detach()
                total = loss if total is None else total + loss
        finally:
            self.number = 0
        return PassOutput(total if total is not None else torch.zeros(()), per_sample, logits)

    def _check_outputs(self, out: LossOutput) -> None:
        name, keys = self.needs  # type: ignore[misc]
        missing = [k for k in keys if getattr(out, k) is None]
        if missing:  # before any backward pass: nothing has changed
            meaning = {"logits": "'logits' the model's outputs",
                       "index": "'index' each sample's position in the training set",
                       "per_sample_loss": "'per_sample_loss' each sample's loss"}  # fmt: skip
            raise self.error(
                f"{name} reads the training step's {' and '.join(repr(k) for k in keys)},"
                f" but it returned no {' and no '.join(repr(k) for k in missing)}: return"
                " {'loss': loss, " + ", ".join(f"'{k}': {k}" for k in keys) + "} from"
                f" training_step (or the loss function), {', '.join(meaning[k] for k in keys)}."
            )


def skip_with_scaler(optimizer: Any) -> None:
    """Make a gradient scaler skip and back off on a skipped step (an infinite gradient)."""
    param = next(p for g in optimizer.param_groups for p in g["params"])
    param.grad = torch.full_like(param, float("inf"))


def loss_scale_reader(scaler: Any) -> Callable[[], Tensor] | None:
    """The scaler's loss scale as a device tensor, without a host sync (``None``: no scaler)."""
    return scaler._get_scale_async if scaler is not None else None


def batch_size(batch: Any) -> int:
    """Samples in ``batch``: its first tensor's first dimension (1 for a scalar or no tensor)."""
    first = first_tensor(batch)
    return int(first.shape[0]) if first is not None and first.dim() else 1


def batch_subset(batch: Any, index: Tensor) -> Any:
    """``batch`` restricted to the samples ``index`` (:func:`subset_batch` at its size)."""
    return subset_batch(batch, index, batch_size(batch))


def first_tensor(batch: Any) -> Tensor | None:
    """The first tensor of ``batch`` (inside dicts, lists and tuples), or ``None``."""
    if isinstance(batch, Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, (list, tuple)) or isinstance(batch, Mapping):
        for value in values:
            found = first_tensor(value)
            if found is not None:
                return found
    return None


def subset_batch(batch: Any, index: Tensor, size: int) -> Any:
    """``batch`` restricted to the samples ``index``: every tensor whose first dimension is
    ``size``, inside dicts, lists, tuples and namedtuples, is indexed along it.

    >>> subset_batch({"x": torch.arange(6).view(3, 2), "n": 7}, torch.tensor([2, 0]), 3)
    {'x': tensor([[4, 5],
            [0, 1]]), 'n': 7}
    """
    if isinstance(batch, Tensor):
        return batch[index.to(batch.device)] if batch.dim() and batch.shape[0] == size else batch
    if isinstance(batch, Mapping):
        items = {k: subset_batch(v, index, size) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(subset_batch(v, index, size) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(subset_batch(v, index, size) for v in batch)
    return batch
