"""The setup rules every front-end shares; each hands in plain facts about its framework and
raises with its own exception type (``error``) and docs page.

>>> check_parallelism("SAMTrainer", fsdp1=True, fix="Use FSDP2.", docs="docs/huggingface.md")
Traceback (most recent call last):
...
ValueError: SAMTrainer does not support FSDP1: its flat parameters cannot be frozen or \
perturbed a layer at a time. Use FSDP2. See docs/huggingface.md.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning_slsam.core.passes import PassRunner, loss_scale_reader
from lightning_slsam.core.step import LoopHooks, StepResult
from lightning_slsam.parallel.ddp import GradientAverager

__all__ = [
    "FSDP2_STRATEGY",
    "check_parallelism",
    "check_sharded",
    "follow_trainable",
    "run_seed",
    "run_step",
]

#: Why each parallel wrapper is refused.
_WHY = {
    "DeepSpeed": "its ZeRO optimizer fixes the trained tensors when it starts, reduces and"
    " steps every one of them, drawn or not, and runs the optimizer step SAM must control",
    "FSDP1": "its flat parameters cannot be frozen or perturbed a layer at a time",
    "XLA": "XLA's lazy tensors are not supported",
    "several": "on several processes only DDP and FSDP2 run a SAM step",
}
#: Lightning's and Fabric's strategy classes (a subclass counts as its base) -> the kind.
_STRATEGY_KINDS = {
    "DeepSpeedStrategy": "DeepSpeed",
    "FSDPStrategy": "FSDP1",
    "XLAStrategy": "XLA",
    "XLAFSDPStrategy": "XLA",
}
#: The Lightning and Fabric strategy whose FSDP2 sharding (``fully_shard``) SAM runs under.
FSDP2_STRATEGY = "ModelParallelStrategy"


def check_parallelism(
    owner: str,
    *,
    classes: Collection[str] = (),
    deepspeed: bool = False,
    fsdp1: bool = False,
    several: bool = False,
    strategy: str | None = None,
    fix: str,
    docs: str,
    error: type[Exception] = ValueError,
) -> None:
    """Refuse, before anything trains, a parallel wrapper no SAM step runs inside.

    Args:
        owner: the front-end's name in the message (``SparseLayerSAM``, ``FabricSAM(...)``).
        classes: the class names of a Lightning or Fabric strategy and its bases.
        deepspeed, fsdp1: the framework runs DeepSpeed or FSDP1 (the Hugging Face Trainer).
        several: several processes under a strategy that is neither DDP nor FSDP2.
        strategy: how the message names what runs (default: ``DeepSpeed``, ``FSDP1``, ...).
        fix: what to use instead, in the framework's terms.
        docs: the docs page of the front-end.
        error: the exception class raised.
    """
    kinds = [_STRATEGY_KINDS[name] for name in sorted(classes) if name in _STRATEGY_KINDS]
    kinds += [k for k, on in (("DeepSpeed", deepspeed), ("FSDP1", fsdp1)) if on]
    order = list(_WHY)
    kind = min(kinds, key=order.index) if kinds else "several" if several else None
    if kind is not None:
        what = strategy or kind
        raise error(f"{owner} does not support {what}: {_WHY[kind]}. {fix} See {docs}.")


def check_sharded(
    owner: str,
    classes: Collection[str],
    world_size: int,
    sharded: bool,
    *,
    fix: str,
    docs: str,
    error: type[Exception] = ValueError,
) -> None:
    """Under :data:`FSDP2_STRATEGY` on several processes, raise ``error`` unless ``sharded``."""
    if FSDP2_STRATEGY in classes and world_size > 1 and not sharded:
        raise error(
            f"{owner} under {FSDP2_STRATEGY} needs the model sharded with FSDP2, but no"
            f" parameter is a sharded DTensor: {fix} See {docs}."
        )


def run_step(
    engine: Any,
    passes: PassRunner,
    zero_grad: Callable[[], None],
    optimizer_step: Callable[[bool], None],
    optimizer: Any,
    *,
    scaler: Any = None,
    averager: GradientAverager | None = None,
    check_draw: bool = False,
    after_update: Callable[[Callable[[], None]], None] | None = None,
    no_sync: AbstractContextManager[Any] | None = None,
) -> StepResult:
    """One step of ``engine`` over ``passes`` with a loop's hooks, inside ``no_sync``."""
    loop = LoopHooks(
        passes, zero_grad, optimizer_step, loss_scale_reader(scaler), averager,
        check_draw=check_draw, after_update=after_update, optimizer=optimizer,
    )  # fmt: skip
    with no_sync if no_sync is not None else nullcontext():
        return engine.step(loop)


def run_seed(
    seed: int | None, default: Callable[[], int], broadcast: Callable[[int], int] | None = None
) -> int:
    """The generators' seed: the method's ``seed``, else the framework's run seed (``default()``);
    on several processes process 0's (sent by ``broadcast``), so all draw the same layers.

    >>> run_seed(None, lambda: 42), run_seed(3, lambda: 42)
    (42, 3)
    """
    value = seed if seed is not None else default()
    return broadcast(value) if broadcast is not None else value


def follow_trainable(
    spec: Any,
    engine: Any,
    module: Any,
    warn: Callable[[str], None],
    owner: str,
    step: int,
    error: type[Exception] = ValueError,
) -> tuple[Any, str] | None:
    """``None`` if ``module``'s trainable set is unchanged, else the carried engine and a line."""
    if not engine.freezer.trainable_changed(module):
        return None
    try:
        new, change = spec.follow_trainable(engine, module, warn)
    except ValueError as err:  # no layer left to sample, a pattern matching nothing
        raise error(
            f"{owner}: the model's trainable parameters changed before step {step} and no"
            f" longer fit the layer options: {err}"
        ) from None
    return new, f"{owner}, before step {step}: {change}"
