"""Momentum-SAM (Becker, Altrock and Risse, 2024, "Momentum-SAM: Sharpness Aware
Minimization without Computational Overhead"): one pass per step, at the weights moved
against the optimizer's momentum, ``w - rho * m / ||m||`` (one norm over every tensor; ``m``
AdamW's ``exp_avg`` as stored, or SGD's ``momentum_buffer``); the first step is plain (no
momentum yet). Departures from the authors' code: docs/methods.md#what-each-method-does-in-one-step.

>>> import torch
>>> net = torch.nn.Linear(4, 2)
>>> engine = MomentumSAMSpec().build_engine(net, seed=0)
>>> opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
>>> x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
>>> loss = lambda: torch.nn.functional.cross_entropy(net(x), y)
>>> [engine.train_step(loss, opt).kind for _ in range(3)]  # no momentum before the first
['plain', 'single', 'single']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_slsam.core.perturbation import SAMPerturbation
from lightning_slsam.core.step import MethodParts, StepContext, StepKind
from lightning_slsam.methods.options import number
from lightning_slsam.methods.spec import MethodOptions, MethodSpec, option

__all__ = ["MOMENTUM_KEYS", "MomentumParts", "MomentumSAMOptions", "MomentumSAMSpec",
           "base_optimizer", "check_momentum"]  # fmt: skip

#: The optimizer state entries that hold a momentum: Adam's family (AdamW, Adam, NAdam,
#: Adamax, Lion-style optimizers), SGD with ``momentum > 0``.
MOMENTUM_KEYS = ("exp_avg", "momentum_buffer")
_FIX = (
    "MomentumSAM moves the weights against the optimizer's momentum, so it needs an "
    "optimizer that keeps one: AdamW or Adam (their exp_avg), or SGD with momentum > 0"
)


def base_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under a framework's wrapper (Lightning's ``LightningOptimizer``,
    Fabric's and accelerate's wrappers), or ``optimizer`` itself."""
    for _ in range(4):
        inner = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def check_momentum(optimizer: Any) -> None:
    """Refuse, before any step, an optimizer that keeps no momentum (judged from its
    defaults: ``betas`` for Adam's family, ``momentum > 0`` for SGD's)."""
    base = base_optimizer(optimizer)
    defaults = getattr(base, "defaults", None)
    if defaults is None:
        return  # not a torch optimizer: the first step with state tells
    if "betas" in defaults or float(defaults.get("momentum", 0.0) or 0.0) > 0:
        return
    raise ValueError(f"{_FIX}; the training uses {type(base).__name__}({_describe(defaults)}).")


def _describe(defaults: dict[str, Any]) -> str:
    shown = {k: v for k, v in defaults.items() if k in ("lr", "momentum")}
    return ", ".join(f"{k}={v}" for k, v in shown.items())


class MomentumParts(MethodParts):
    """Every step a single-step step along minus the optimizer's momentum."""

    keeps_last_grads = False

    def kind(self, step: int) -> StepKind:
        return "single"

    def check_optimizer(self, optimizer: Any) -> None:
        check_momentum(optimizer)

    def directions(
        self, ctx: StepContext, params: Sequence[Tensor], last_grads: dict[int, Tensor]
    ) -> dict[int, Tensor]:
        """Each tensor's momentum, by ``id``, as the step moves it (each process's own
        shards under FSDP2)."""
        found = self.momentum(ctx.loop.optimizer, params)
        return dict(zip(found, ctx.shards.local(list(found.values()))))

    def momentum(self, optimizer: Any, params: Sequence[Tensor]) -> dict[int, Tensor]:
        """Each tensor's momentum, by ``id`` (the optimizer's own tensor: nothing copied);
        empty before the optimizer's first step."""
        if optimizer is None:
            raise ValueError(
                "MomentumSAM reads the optimizer's momentum, but this training loop does not"
                " hand the step its optimizer (LoopHooks.optimizer)."
            )
        base = base_optimizer(optimizer)
        state = base.state
        found: dict[int, Tensor] = {}
        for p in params:
            entry = state.get(p)
            if not entry:
                continue
            buffer = next((entry[k] for k in MOMENTUM_KEYS if entry.get(k) is not None), None)
            if buffer is None:
                raise ValueError(f"{_FIX}; {type(base).__name__}'s state holds {sorted(entry)}.")
            found[id(p)] = buffer
        return found


@dataclass(kw_only=True, eq=False)
class MomentumSAMOptions(MethodOptions):
    """Momentum-SAM's options.

    Args:
        rho: the distance moved against the normalised momentum (> 0; default 1, the
            authors' AdamW default).
    """

    rho: float = option(1.0, number(0, low_open=True, note=" (the distance against the momentum)"))


@dataclass(kw_only=True, eq=False)
class MomentumSAMSpec(MomentumSAMOptions, MethodSpec):
    """Momentum-SAM: one pass per step, ``rho`` against the optimizer's normalised momentum."""

    name: ClassVar[str] = "momentum_sam"
    label: ClassVar[str] = "MomentumSAM"
    own_move: ClassVar[str | None] = (
        "Momentum-SAM moves along the momentum with one norm over every tensor, as its authors'"
        " code"
    )

    def make_perturbation(self) -> SAMPerturbation:
        # Against the momentum: the same move as SAM's ascent, with the opposite sign.
        return SAMPerturbation(-self.rho, norm="global")

    def parts(self, generator: torch.Generator) -> MethodParts:
        return MomentumParts()
