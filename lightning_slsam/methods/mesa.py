"""MESA (Du et al., 2022, "Sharpness-Aware Training for Free", NeurIPS): SAM's flatness at
one gradient per step, the loss plus :func:`consistency` (times ``weight``) between the
logits the training step returns (``{"loss": loss, "logits": logits}``) and those of the
weights' moving average ``avg <- decay * avg + (1 - decay) * w`` (a forward in evaluation
mode), from ``start`` of the run on (docs/methods.md#what-each-method-does-in-one-step).

>>> import torch
>>> net = torch.nn.Linear(4, 3)
>>> engine = MESASpec(start=0.0).build_engine(net, seed=0)
>>> opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
>>> x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
>>> def loss():
...     logits = net(x)
...     return {"loss": torch.nn.functional.cross_entropy(logits, y), "logits": logits}
>>> [engine.train_step(loss, opt).kind for _ in range(2)]  # one training pass per step
['plain', 'plain']
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_slsam.core.isolation import evaluating
from lightning_slsam.core.partition import by_position
from lightning_slsam.core.passes import LossOutput
from lightning_slsam.core.perturbation import BackupPool, copy_values
from lightning_slsam.core.step import ExtraWork, MethodParts, StepContext, StepKind
from lightning_slsam.methods.options import number
from lightning_slsam.methods.spec import MethodOptions, MethodSpec, option

__all__ = ["AverageTeacher", "MESAOptions", "MESASpec", "consistency", "per_sample_consistency"]


def consistency(logits: Tensor, target: Tensor, tau: float) -> Tensor:
    """``tau^2 * KL(softmax(target / tau) || softmax(logits / tau))``, summed over the last
    dimension and averaged over the others, in float32 at least, ``target`` detached.

    >>> z = torch.tensor([[2.0, 0.0, -1.0]])
    >>> float(consistency(z, z, 5.0)) == 0.0
    True
    """
    return per_sample_consistency(logits, target, tau).mean()


def per_sample_consistency(logits: Tensor, target: Tensor, tau: float) -> Tensor:
    """:func:`consistency` of each sample (the first dimension), ``[batch]``."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    student = F.log_softmax(logits.to(dtype) / tau, dim=-1)
    teacher = F.log_softmax(target.detach().to(dtype) / tau, dim=-1)
    kl = F.kl_div(student, teacher, reduction="none", log_target=True).sum(-1)
    return kl.reshape(len(kl), -1).mean(1) * tau**2


class AverageTeacher(MethodParts):
    """MESA's parts: the average's logits before the step, the term in the training pass, the
    average moved after each update."""

    keeps_last_grads = False
    reads_update_grads = True
    needs_outputs = ("logits",)
    label = "MESA"

    def __init__(self, spec: MESASpec) -> None:
        self.weight, self.tau = spec.weight, spec.tau
        self.start, self.decay = spec.start, spec.decay
        #: Each tensor's average, by ``id`` (this process's shard under FSDP2).
        self.average: dict[int, Tensor] = {}
        self.pool = BackupPool()
        self._targets: list[Tensor | None] = []

    def kind(self, step: int) -> StepKind:
        return "plain"

    def _started(self, ctx: StepContext) -> bool:
        if self.start == 0.0:
            return True
        if math.isinf(ctx.planned):
            raise ValueError(
                f"MESA(start={self.start:g}) starts its term after a fraction of the run, whose"
                " length this training loop does not give: set `engine.planned_steps` to the"
                " run's optimizer steps (FabricSAM: `sam.engine.planned_steps = N`), or"
                " `start=0`."
            )
        return ctx.step >= self.start * ctx.planned

    def before_step(self, ctx: StepContext) -> ExtraWork:
        self._targets = []
        params = ctx.layers.partition.flat_params
        local = ctx.shards.local(params)
        if not self.average:  # the average starts at the weights
            self.average = {id(p): t.detach().clone() for p, t in zip(params, local)}
        if not self._started(ctx):
            return ExtraWork()
        backup = self.pool.copy(local)
        try:
            with torch.no_grad():
                copy_values(local, [self.average[id(p)] for p in params])
            with evaluating(ctx.module) if ctx.module is not None else nullcontext():
                out = ctx.loop.forward_backward(backward=False, keep_logits=True)
        finally:
            # FSDP2 keeps the root's parameters gathered after a forward without backward:
            # the training pass gathers the true weights anew.
            ctx.shards.reshard()
            with torch.no_grad():
                copy_values(local, backup)  # the true weights, bit for bit
        self._targets = out.logits
        return ExtraWork()

    def extra_loss(self, ctx: StepContext, i: int, output: LossOutput) -> Tensor | None:
        if i >= len(self._targets) or self._targets[i] is None or self.weight == 0.0:
            return None
        term = consistency(output.logits, self._targets[i], self.tau)  # type: ignore[arg-type]
        return self.weight * term

    def after_update(self, ctx: StepContext, params: list[Tensor], grads: list[Tensor]) -> None:
        mine = [p for p in params if id(p) in self.average]
        with torch.no_grad():
            averages = [self.average[id(p)] for p in mine]
            weights = [w.to(a.dtype) for w, a in zip(ctx.shards.local(mine), averages)]
            torch._foreach_lerp_(averages, weights, 1.0 - self.decay)

    def state_dict(self, index: dict[int, int]) -> dict[str, Any]:
        return {"mesa_average": {index[k]: v for k, v in self.average.items()}}

    def load_state_dict(self, state: dict[str, Any], tensors: list[Tensor]) -> None:
        self.average = by_position(state.get("mesa_average", {}), tensors)


@dataclass(kw_only=True, eq=False)
class MESAOptions(MethodOptions):
    """MESA's options.

    Args:
        weight: the consistency term's weight (>= 0; default 0.8; 0: plain training).
        tau: the softmax temperature (> 0; default 5).
        start: the fraction of the run's planned steps after which the term is added, in
            [0, 1) (default 0.05). Needs the run's length (Lightning and ``SAMTrainer`` give
            it; else ``engine.planned_steps``, or ``start=0``).
        decay: the average's decay per step, in [0, 1) (default 0.9998; a run of a few
            thousand steps wants about 0.99-0.999).
    """

    weight: float = option(0.8, number(0))
    tau: float = option(5.0, number(0, low_open=True))
    start: float = option(0.05, number(0, 1, high_open=True))
    decay: float = option(0.9998, number(0, 1, high_open=True))


@dataclass(kw_only=True, eq=False)
class MESASpec(MESAOptions, MethodSpec):
    """MESA: one training pass per step plus a forward at the averaged weights."""

    name: ClassVar[str] = "mesa"
    label: ClassVar[str] = "MESA"
    own_move: ClassVar[str | None] = "MESA perturbs nothing (its size is `weight`)"
    sized_by_rho: ClassVar[bool] = False

    def parts(self, generator: torch.Generator) -> MethodParts:
        return AverageTeacher(self)
