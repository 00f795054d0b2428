"""How far a causal language model has moved from itself on reference text:
:class:`ForgettingProbe`.

It measures ``loss`` and ``accuracy`` (next-token cross-entropy and top-1 accuracy) and ``kl``,
the mean ``KL(p_start || p_now)`` over the ``top_k`` most likely next tokens kept at
:meth:`~ForgettingProbe.start` and the mass of the rest: exact when ``top_k`` covers the
vocabulary, else a lower bound. See docs/forgetting.md.

>>> import torch
>>> torch.manual_seed(0)
<torch._C.Generator object at ...>
>>> model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
>>> probe = ForgettingProbe(model, [torch.randint(0, 16, (4, 12))], top_k=16,
...                         forward=lambda m, batch: m(batch["input_ids"]))
>>> probe.start()
>>> probe.measure()["kl"]
0.0
>>> with torch.no_grad():
...     _ = model[1].bias.add_(torch.randn(16))
>>> probe.measure()["kl"] > 0
True
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ForgettingProbe", "reference_windows"]

#: Labels of positions that are not predicted (padding).
IGNORE_INDEX = -100

Forward = Callable[[nn.Module, dict[str, Tensor]], Any]


def _logits(output: Any) -> Tensor:
    return output.logits if hasattr(output, "logits") else output


def _default_forward(model: nn.Module, batch: dict[str, Tensor]) -> Any:
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    return model(**inputs)


def reference_windows(token_ids: Iterable[int], length: int, batch_size: int,
                      max_windows: int | None = None) -> list[Tensor]:  # fmt: skip
    """Cut a token stream into batches of non-overlapping windows of ``length`` tokens
    (``[batch_size, length]`` each; the last batch may be smaller), at most ``max_windows`` windows.

    >>> [b.shape for b in reference_windows(range(100), 10, 4, max_windows=6)]
    [torch.Size([4, 10]), torch.Size([2, 10])]
    """
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    count = ids.numel() // length
    if max_windows is not None:
        count = min(count, max_windows)
    if count == 0:
        raise ValueError(
            f"The reference text has {ids.numel()} tokens, fewer than one window of"
            f" length={length}: give more text or a shorter length."
        )
    windows = ids[: count * length].view(count, length)
    return list(windows.split(batch_size))


class ForgettingProbe:
    """Loss, accuracy and KL divergence from the start on reference text.

    Args:
        model: a causal language model.
        reference: its batches: ``[batch, length]`` token-id tensors, or dicts with
            ``input_ids`` (optionally ``attention_mask``, and ``labels`` with ``-100`` on
            positions not to predict), evaluated at every measurement.
        top_k: next tokens kept per reference position for the KL (>= 1). Default 64.
        forward: ``forward(model, batch) -> logits`` (or an output with ``.logits``);
            default ``model(input_ids=..., attention_mask=...)``.
    """

    def __init__(self, model: nn.Module, reference: list[Tensor] | list[Mapping[str, Tensor]],
                 top_k: int = 64, forward: Forward | None = None) -> None:  # fmt: skip
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"`top_k` must be an integer >= 1, got {top_k!r}.")
        batches = [self._as_batch(b) for b in reference]
        if not batches:
            raise ValueError("`reference` is empty: give at least one batch of token ids.")
        self.model, self.batches, self.top_k = model, batches, top_k
        self.forward = forward or _default_forward
        self._start: list[tuple[Tensor, Tensor, Tensor]] | None = None
        #: Seconds spent in :meth:`start` and :meth:`measure` (the probe's cost).
        self.seconds = 0.0

    @staticmethod
    def _as_batch(batch: Tensor | Mapping[str, Tensor]) -> dict[str, Tensor]:
        if isinstance(batch, Tensor):
            batch = {"input_ids": batch}
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise TypeError(
                "Each reference batch must be a tensor of token ids or a dict with"
                f" 'input_ids', got {type(batch).__name__}."
            )
        ids = batch["input_ids"]
        if ids.dim() != 2 or ids.shape[1] < 2:
            raise ValueError(
                f"Reference input_ids must be [batch, length >= 2], got {tuple(ids.shape)}."
            )
        out = dict(batch)
        if "labels" not in out:
            labels = ids.clone()
            if "attention_mask" in out:
                labels = labels.masked_fill(out["attention_mask"] == 0, IGNORE_INDEX)
            out["labels"] = labels
        return out

    @property
    def started(self) -> bool:
        return self._start is not None

    def _passes(self) -> Iterable[tuple[Tensor, Tensor, Tensor]]:
        """Per batch: the next-token log-probabilities and targets at the counted positions
        (eval mode, no gradients)."""
        model = self.model
        was_training = model.training
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        model.eval()
        try:
            with torch.no_grad():
                for batch in self.batches:
                    on_device = {k: v.to(device) for k, v in batch.items()}
                    logits = _logits(self.forward(model, on_device))[:, :-1].float()
                    targets = on_device["labels"][:, 1:]
                    keep = targets != IGNORE_INDEX
                    yield F.log_softmax(logits[keep], dim=-1), targets[keep], keep
        finally:
            model.train(was_training)

    def start(self) -> None:
        """Keep the model's current next-token distributions on the reference as the start."""
        began = time.perf_counter()
        kept = []
        for logp, _, _ in self._passes():
            k = min(self.top_k, logp.shape[-1])
            top, index = logp.topk(k, dim=-1)
            rest = _log_rest(top)
            kept.append((index.to(torch.int32).cpu(), top.cpu(), rest.cpu()))
        self._start = kept
        self.seconds += time.perf_counter() - began

    def start_state(self) -> list[tuple[Tensor, Tensor, Tensor]] | None:
        """The kept start (for a checkpoint; ``None`` before :meth:`start`)."""
        return self._start

    def load_start(self, state: list[tuple[Tensor, Tensor, Tensor]]) -> None:
        """Use a start kept by :meth:`start_state` (a resumed run)."""
        if len(state) != len(self.batches) or any(
            len(kept[0]) != int((b["labels"][:, 1:] != IGNORE_INDEX).sum())
            for kept, b in zip(state, self.batches)
        ):
            raise ValueError(
                "The forgetting probe's saved start was kept on other reference batches:"
                " resume with the same `reference`."
            )
        self._start = state

    def measure(self) -> dict[str, float]:
        """``loss``, ``accuracy`` and (after :meth:`start`) ``kl`` on the reference tokens,
        with ``tokens``, their count."""
        began = time.perf_counter()
        loss = correct = kl = 0.0
        tokens = 0
        for i, (logp, targets, _) in enumerate(self._passes()):
            loss += float(F.nll_loss(logp, targets, reduction="sum"))
            correct += float((logp.argmax(-1) == targets).sum())
            tokens += targets.numel()
            if self._start is not None:
                index, top, rest = (t.to(logp.device) for t in self._start[i])
                now_top = logp.gather(-1, index.long())
                now_rest = _log_rest(now_top)
                p_top, p_rest = top.exp(), rest.exp()
                terms = (p_top * (top - now_top)).sum(-1) + p_rest * (rest - now_rest)
                kl += float(terms.clamp(min=0).sum())
        self.seconds += time.perf_counter() - began
        n = max(tokens, 1)
        result = {"loss": loss / n, "accuracy": correct / n, "tokens": float(tokens)}
        if self._start is not None:
            result["kl"] = kl / n
        return result


def _log_rest(top: Tensor) -> Tensor:
    """``log(1 - sum(exp(top)))`` per row, floored at ``log(1e-12)``."""
    mass = top.exp().sum(-1)
    return torch.log((1.0 - mass).clamp(min=1e-12))
