"""SAF (Du et al., 2022, "Sharpness-Aware Training for Free", NeurIPS): SAM's flatness at
one gradient per step, the loss plus ``weight`` times the consistency term between each
sample's logits and its logits ``delay`` visits (epochs) earlier (0 without them), stored on
the CPU by ``index`` (the training step returns ``{"loss": ..., "logits": ..., "index": ...}``).

>>> import torch
>>> net = torch.nn.Linear(4, 3)
>>> engine = SAFSpec(delay=1, start_epoch=0).build_engine(net, seed=0)
>>> opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
>>> x, y, index = torch.randn(8, 4), torch.randint(0, 3, (8,)), torch.arange(8)
>>> def loss():
...     logits = net(x)
...     return {"loss": torch.nn.functional.cross_entropy(logits, y), "logits": logits,
...             "index": index}
>>> [engine.train_step(loss, opt).kind for _ in range(3)]
['plain', 'plain', 'plain']
>>> engine.parts.visits[:8].tolist()  # each sample recorded three times
[3, 3, 3, 3, 3, 3, 3, 3]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_slsam.core.passes import LossOutput
from lightning_slsam.core.step import MethodParts, StepContext, StepKind
from lightning_slsam.methods.mesa import per_sample_consistency
from lightning_slsam.methods.options import number
from lightning_slsam.methods.spec import MethodOptions, MethodSpec, option
from lightning_slsam.parallel.ddp import GradientAverager

__all__ = ["MAX_LOGITS", "PastLogits", "SAFOptions", "SAFSpec"]

#: The most numbers of one sample's logits SAF stores (``delay + 1`` times): a class
#: distribution, not a language model's vocabulary per token.
MAX_LOGITS = 16384


class PastLogits(MethodParts):
    """SAF's parts: the term against each sample's logits ``delay`` visits ago, the store."""

    keeps_last_grads = False
    needs_outputs = ("logits", "index")
    label = "SAF"

    def __init__(self, spec: SAFSpec) -> None:
        self.weight, self.tau = spec.weight, spec.tau
        self.delay, self.start_epoch = spec.delay, spec.start_epoch
        #: ``[samples, delay + 1, *logits]``: each sample's recent logits (float32, CPU).
        self.store: Tensor | None = None
        #: How often each sample was recorded (int64, CPU).
        self.visits = torch.zeros(0, dtype=torch.int64)

    def kind(self, step: int) -> StepKind:
        return "plain"

    def extra_loss(self, ctx: StepContext, i: int, output: LossOutput) -> Tensor | None:
        logits, index = output.logits, output.index
        assert logits is not None and index is not None  # the pass loop checked
        shape = tuple(logits.shape[1:])
        if math.prod(shape) > MAX_LOGITS:
            raise ValueError(
                f"SAF stores every training sample's last {self.delay + 1} logits; a sample's"
                f" logits here are {shape} ({math.prod(shape):,} numbers, over {MAX_LOGITS:,}),"
                " a language model's vocabulary per token: use MESA, whose reference is the"
                " weights' moving average and needs no store."
            )
        index = index.to(torch.int64).cpu()
        visits = self._grown(int(index.max()) + 1, shape).visits[index]
        term = None
        due = (visits >= self.delay) & (visits > self.start_epoch)
        if bool(due.any()) and self.weight != 0.0:
            past = self.store[index, (visits - self.delay) % (self.delay + 1)]  # type: ignore[index]
            past = past.to(logits.device)
            kl = per_sample_consistency(logits, past, self.tau)
            term = self.weight * (kl * due.to(kl.device, kl.dtype)).sum() / len(index)
        self._record(ctx, index, logits.detach())
        return term

    def _grown(self, samples: int, shape: tuple[int, ...]) -> PastLogits:
        """The store grown to hold ``samples`` samples of logits shaped ``shape``."""
        if self.store is None:
            self.store = torch.zeros((samples, self.delay + 1, *shape), dtype=torch.float32)
            self.visits = torch.zeros(samples, dtype=torch.int64)
        elif samples > self.store.shape[0]:
            more = samples - self.store.shape[0]
            self.store = torch.cat(
                [self.store, self.store.new_zeros((more, *self.store.shape[1:]))]
            )
            self.visits = torch.cat([self.visits, self.visits.new_zeros(more)])
        return self

    def _record(self, ctx: StepContext, index: Tensor, logits: Tensor) -> None:
        """Store the batch's logits of every process (the same store everywhere)."""
        group = _group(ctx)
        if group is not None:
            index, logits = _gather(group, index.to(logits.device), logits)
            index = index.cpu()
        self._grown(int(index.max()) + 1, tuple(logits.shape[1:]))
        slots = self.visits[index] % (self.delay + 1)
        self.store[index, slots] = logits.float().cpu()  # type: ignore[index]
        self.visits[index] += 1

    def state_dict(self, index: dict[int, int]) -> dict[str, Any]:
        return {"saf": {"store": self.store, "visits": self.visits.clone()}}

    def load_state_dict(self, state: dict[str, Any], tensors: list[Tensor]) -> None:
        saved = state.get("saf") or {}
        if saved.get("store") is not None:
            self.store, self.visits = saved["store"].clone(), saved["visits"].clone()


def _group(ctx: StepContext) -> GradientAverager | None:
    """The processes that train together (DDP's averager, FSDP2's shards), or ``None``."""
    if ctx.loop.averager is not None:
        return ctx.loop.averager
    if ctx.shards.sharded:
        return GradientAverager(ctx.shards.group(ctx.layers.partition.flat_params))
    return None


def _gather(group: GradientAverager, index: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
    """Every process's ``index`` and ``logits``, concatenated in rank order (batches of
    unequal size padded to the largest, then cut back)."""
    sizes = group.gather(torch.tensor([len(index)], device=logits.device)).view(-1).tolist()
    most = max(sizes)
    padded_index = index.new_zeros(most)
    padded_index[: len(index)] = index
    padded = logits.new_zeros((most, *logits.shape[1:]))
    padded[: len(index)] = logits
    all_index, all_logits = group.gather(padded_index), group.gather(padded)
    keep = [slice(0, n) for n in sizes]
    return (torch.cat([all_index[r][s] for r, s in enumerate(keep)]),
            torch.cat([all_logits[r][s] for r, s in enumerate(keep)]))  # fmt: skip


@dataclass(kw_only=True, eq=False)
class SAFOptions(MethodOptions):
    """SAF's options.

    Args:
        weight: the consistency term's weight (>= 0; default 0.3; 0: plain training).
        tau: the softmax temperature (> 0; default 5).
        delay: how many visits (epochs) back a sample's reference logits are, >= 1 (default 3).
        start_epoch: the visits (epochs) after which a sample gets the term, >= 0 (default
            5: the term from visit 6 on).
    """

    weight: float = option(0.3, number(0))
    tau: float = option(5.0, number(0, low_open=True))
    delay: int = option(3, number(1, integer=True))
    start_epoch: int = option(5, number(0, integer=True))


@dataclass(kw_only=True, eq=False)
class SAFSpec(SAFOptions, MethodSpec):
    """SAF: one training pass per step, plus the term against each sample's past logits."""

    name: ClassVar[str] = "saf"
    label: ClassVar[str] = "SAF"
    own_move: ClassVar[str | None] = "SAF perturbs nothing (its size is `weight`)"
    sized_by_rho: ClassVar[bool] = False

    def parts(self, generator: torch.Generator) -> MethodParts:
        return PastLogits(self)
