"""The checks a SAM callback makes when a fit is set up, each failure a
``MisconfigurationException`` naming the fix before any weight changes, and the Lightning
warnings that do not apply to its fit."""

from __future__ import annotations

import warnings
from dataclasses import fields
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_slsam.core.frontend import FSDP2_STRATEGY, check_parallelism, check_sharded
from lightning_slsam.core.regions import (
    MIN_TORCH,
    compile_blocks_instead,
    compiled_regions,
    compiled_whole,
    repeated_blocks,
    torch_guards_requires_grad,
)
from lightning_slsam.lightning.driver import LightningOptions
from lightning_slsam.lightning.mixin import SAMMixin
from lightning_slsam.methods.options import check_choice, check_flag, check_int

__all__ = [
    "LIGHTNING_OPTIONS",
    "FitWarnings",
    "check_engine",
    "check_fit_setup",
    "check_lightning_options",
    "check_one_optimizer",
]


#: The fields of :class:`LightningOptions`, name -> (annotation, default).
LIGHTNING_OPTIONS: dict[str, tuple[Any, Any]] = {
    f.name: (f.type, f.default) for f in fields(LightningOptions)
}


#: Lightning warnings that do not apply under a SAM callback, silenced during its fit only:
#: checkpoints hold the unperturbed weights, and the driver honours `monitor` / `strict`.
_FIT_WARNINGS = (
    ("Using ModelCheckpoint with manual optimization", UserWarning),
    ("The lr scheduler dict contains the key", RuntimeWarning),
)


def check_lightning_options(
    gradient_clip_val: Any, gradient_clip_algorithm: Any, accumulate_grad_batches: Any, plot: Any
) -> dict[str, Any]:
    """The Lightning options, validated (a ``ValueError`` naming the option otherwise)."""
    clip, algorithm = check_clip(gradient_clip_val, gradient_clip_algorithm)
    return {
        "gradient_clip_val": clip,
        "gradient_clip_algorithm": algorithm,
        "accumulate_grad_batches": check_int("accumulate_grad_batches", accumulate_grad_batches, 1),
        "plot": check_flag("plot", plot),
    }


def check_clip(gradient_clip_val: Any, gradient_clip_algorithm: Any) -> tuple[Any, str]:
    """The clipping options of the callback and Fabric, validated: ``None`` or a number
    >= 0, and ``"norm"`` or ``"value"`` (a ``ValueError`` naming the option otherwise)."""
    clip = gradient_clip_val
    if clip is not None and not (isinstance(clip, (int, float)) and clip >= 0):
        raise ValueError(f"`gradient_clip_val` must be None or a number >= 0, got {clip!r}.")
    algorithm = check_choice("gradient_clip_algorithm", gradient_clip_algorithm, ("norm", "value"))
    return clip, algorithm


def _strategy_names(strategy: Any) -> set[str]:
    """The class names of ``strategy`` and its bases (a subclass counts as its base)."""
    return {cls.__name__ for cls in type(strategy).__mro__}


def check_fit_setup(callback: Any, trainer: Any, pl_module: Any) -> None:
    """The module has the mixin, the strategy is one device or DDP, one SAM callback."""
    name = type(callback).__name__
    if not isinstance(pl_module, SAMMixin):
        raise MisconfigurationException(
            f"{name} needs the LightningModule to inherit SAMMixin, but"
            f" {type(pl_module).__name__} does not. Declare it as"
            f" `class {type(pl_module).__name__}(SAMMixin, L.LightningModule)`"
            " (`from lightning_slsam import SAMMixin`)."
        )
    mro = type(pl_module).__mro__
    lightning_module = next((c for c in mro if c.__name__ == "LightningModule"), None)
    if lightning_module is not None and mro.index(lightning_module) < mro.index(SAMMixin):
        bases = ", ".join(c.__name__ for c in type(pl_module).__bases__)
        raise MisconfigurationException(
            f"{type(pl_module).__name__}({bases}) lists SAMMixin after LightningModule, whose"
            " hooks then shadow the mixin's. Put SAMMixin first: `class"
            f" {type(pl_module).__name__}(SAMMixin, L.LightningModule)`."
        )
    strategy = trainer.strategy
    bases = _strategy_names(strategy)
    label = type(strategy).__name__
    if "DeepSpeedStrategy" in bases:
        config = getattr(strategy, "config", None) or {}
        label += f" (ZeRO stage {(config.get('zero_optimization') or {}).get('stage', '?')})"
    # DeepSpeed, FSDP1 and XLA are refused on one device too: the wrapping is there anyway.
    ddp_or_fsdp2 = isinstance(strategy, DDPStrategy) or FSDP2_STRATEGY in bases
    check_parallelism(
        name, classes=bases, several=trainer.world_size > 1 and not ddp_or_fsdp2, strategy=label,
        fix="Use strategy='ddp' or 'ddp_spawn', FSDP2 through ModelParallelStrategy"
        " (fully_shard in configure_model), or a single device.",
        docs="docs/training-features.md", error=MisconfigurationException,
    )  # fmt: skip
    others = [cb for cb in trainer.callbacks if isinstance(cb, LightningOptions)]
    if len(others) > 1:
        raise MisconfigurationException(
            f"{len(others)} SAM callbacks are attached to the Trainer"
            f" ({', '.join(type(cb).__name__ for cb in others)}); keep exactly one."
        )


def check_one_optimizer(callback: Any, trainer: Any) -> None:
    if len(trainer.optimizers) != 1:
        raise MisconfigurationException(
            f"{type(callback).__name__} steps one optimizer, but configure_optimizers returned"
            f" {len(trainer.optimizers)}. Put all parameters in one optimizer (use"
            " parameter groups for different learning rates)."
        )


def check_engine(callback: Any, trainer: Any, pl_module: Any, engine: Any) -> None:
    """At fit start, with the engine built: ModelParallelStrategy needs sharded parameters,
    and layer sampling a model compiled by blocks (:func:`check_compiled_sampling`)."""
    check_sharded(
        type(callback).__name__, _strategy_names(trainer.strategy), trainer.world_size,
        engine.shards.sharded, docs="docs/training-features.md", error=MisconfigurationException,
        fix="apply fully_shard in configure_model (tensor_parallel_size=1), or use strategy='ddp'.",
    )  # fmt: skip
    if not engine.selection.always_all:
        check_compiled_sampling(type(callback).__name__, pl_module, engine)


def prepare_compiled(
    name: str, pl_module: Any, samples_layers: bool, info: Any, warn: Any = None
) -> None:
    """On a compiled model, before the layers are drawn up: ``training_step`` runs eagerly
    (``forward`` stays compiled); under layer sampling a model compiled whole has its
    repeated blocks compiled instead, each one layer (docs/training-features.md)."""
    compiled = getattr(pl_module, "_compiler_ctx", None)
    if compiled:
        pl_module.training_step = compiled["original_training_step"]
    if not samples_layers:
        return
    context = compiled.get("dynamo_ctx") if compiled else None
    if context is not None and len(repeated_blocks(pl_module)) >= 2:
        from lightning.pytorch.utilities.compile import to_uncompiled

        to_uncompiled(pl_module)
    else:
        context = None
    for region, blocks in compile_blocks_instead(pl_module, context).items():
        info(
            f"{name}: {region or type(pl_module).__name__} was compiled whole; its"
            f" {len(blocks)} blocks ({blocks[0]}, ...) are compiled instead, with the same"
            " settings, each one layer trained or frozen whole."
        )
    cached = [n for n, m in pl_module.named_modules() if getattr(m, "config", None) is not None
              and getattr(m.config, "use_cache", False) is True]  # fmt: skip
    if warn is not None and cached and compiled_regions(pl_module):
        warn(
            f"{name}: `{cached[0] or type(pl_module).__name__}.config.use_cache` is True on a"
            " model with compiled blocks, which may then recompile past torch's limit and run"
            " uncompiled: set `model.config.use_cache = False`. See docs/training-features.md."
        )


def check_compiled_sampling(name: str, pl_module: Any, engine: Any) -> None:
    """Layer sampling on a compiled model: torch must guard graphs on ``requires_grad``
    (>= 2.12), each compiled region must be one layer, and the model not compiled whole."""
    regions = compiled_regions(pl_module)
    whole = compiled_whole(pl_module)
    if not whole and not regions:
        return
    if not torch_guards_requires_grad():
        low = ".".join(map(str, MIN_TORCH))
        raise MisconfigurationException(
            f"{name} on a compiled model needs torch >= {low} (this is {torch.__version__}):"
            f" upgrade torch, or train {name} without torch.compile."
        )
    partition = engine.partition
    layer_of = {id(p): i for i, group in enumerate(partition.params) for p in group}
    spans = [
        {layer_of[id(p)] for p in pl_module.get_submodule(r).parameters() if id(p) in layer_of}
        for r in regions
    ]
    split = [r for r, layers in zip(regions, spans) if len(layers) > 1]
    if split:
        raise MisconfigurationException(
            f"{name} draws the tensors of the compiled module(s) {split} as separate layers,"
            " which recompiles them. Build the engine after compiling, or group each compiled"
            " module into one layer with `layers`."
        )
    if whole or any(len(layers) == partition.num_layers for layers in spans):
        raise MisconfigurationException(
            f"{name} freezes a different set of layers every step, and torch.compile guards"
            " on requires_grad, so a model compiled whole would recompile every step. Compile"
            " its repeated blocks instead (`for block in model.encoder.layer:"
            " block.compile()`). See docs/training-features.md."
        )


class FitWarnings:
    """Silences :data:`_FIT_WARNINGS` between :meth:`add` and :meth:`remove` only."""

    def __init__(self) -> None:
        self._filters: list[Any] = []

    def add(self) -> None:
        self.remove()
        for message, category in _FIT_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
            self._filters.append(warnings.filters[0])

    def remove(self) -> None:
        for entry in self._filters:
            if entry in warnings.filters:
                warnings.filters.remove(entry)
        self._filters = []
