"""SAM methods in a Lightning Fabric loop: :class:`FabricSAM`. See docs/fabric.md."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_slsam.core.engine import SAMEngine
from lightning_slsam.core.frontend import (
    check_parallelism,
    check_sharded,
    follow_trainable,
    run_seed,
    run_step,
)
from lightning_slsam.core.passes import (
    PassRunner,
    read_output,
    skip_with_scaler,
)
from lightning_slsam.core.regions import compile_blocks_instead, compiled_whole
from lightning_slsam.core.state import apply_method_state, method_state
from lightning_slsam.core.step import StepResult
from lightning_slsam.lightning.setup_checks import check_clip, check_compiled_sampling
from lightning_slsam.methods.registry import spec_from
from lightning_slsam.methods.spec import MethodSpec, default_seed
from lightning_slsam.parallel.ddp import GradientAverager

__all__ = ["FabricSAM"]


def _names(obj: Any) -> set[str]:
    return {cls.__name__ for cls in type(obj).__mro__}


class FabricSAM:
    """A SAM method of the registry in a Lightning Fabric loop; a whole loop, DDP, FSDP2 and
    checkpoints (``fabric.save`` with ``"sam": sam``): docs/fabric.md.

    Args:
        fabric: the launched ``lightning.fabric.Fabric``.
        model: the model returned by ``fabric.setup`` (or ``fabric.setup_module``).
        optimizer: the optimizer returned by ``fabric.setup`` (or
            ``fabric.setup_optimizers``), over the model's parameters; under FSDP2 made
            after ``fabric.setup_module`` (docs/fabric.md#fsdp2-setup-order).
        method: a method name of :data:`~lightning_slsam.METHODS` (default ``"slsam"``,
            what ``SparseLayerSAM()`` runs; ``"slsam_paper"``, ``"sam"``, ...) or a
            :class:`~lightning_slsam.methods.spec.MethodSpec`.
        gradient_clip_val: clip the update gradient with ``fabric.clip_gradients``
            (default ``None``; ``None`` or 0: no clipping).
        gradient_clip_algorithm: ``"norm"`` (default; ``max_norm``) or ``"value"``
            (``clip_val``).
        **options: the method's options (``layer_ratio``, ``rho``, ``seed``, ...); ``seed``
            defaults to rank 0's run seed (:func:`~lightning_slsam.methods.spec.default_seed`).

    Example:
        One step on one CPU device:

        >>> import lightning as L
        >>> import torch.nn.functional as F
        >>> fabric = L.Fabric(accelerator="cpu", devices=1)
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        >>> sam = FabricSAM(fabric, model, optimizer, "slsam", layer_ratio=0.5, seed=0)
        >>> x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
        >>> result = sam.step(lambda batch: F.cross_entropy(model(batch[0]), batch[1]), (x, y))
        >>> result.kind, bool(result.active_mask.all())  # two passes over a sampled subset
        ('sam', False)
    """

    def __init__(
        self,
        fabric: Any,
        model: Any,
        optimizer: Any,
        method: str | MethodSpec = "slsam",
        *,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        **options: Any,
    ) -> None:
        from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer

        if not _is_fabric(fabric):
            raise TypeError(
                f"FabricSAM takes the Fabric object first, got {type(fabric).__name__}:"
                " `FabricSAM(fabric, model, optimizer, 'slsam')`."
            )
        if not isinstance(model, _FabricModule):
            raise TypeError(
                f"FabricSAM needs the model that fabric.setup returned, got"
                f" {type(model).__name__}: `model, optimizer = fabric.setup(model, optimizer)`"
                " first, then `FabricSAM(fabric, model, optimizer, ...)`."
            )
        if not isinstance(optimizer, _FabricOptimizer):
            raise TypeError(
                f"FabricSAM needs the optimizer that fabric.setup returned, got"
                f" {type(optimizer).__name__}: `model, optimizer = fabric.setup(model,"
                " optimizer)`."
            )
        strategy = fabric.strategy
        check_parallelism(
            "FabricSAM", classes=_names(strategy), strategy=type(strategy).__name__,
            fix="Use strategy='ddp', FSDP2 through ModelParallelStrategy (fully_shard in its"
            " parallelize_fn), or one device.", docs="docs/fabric.md",
        )  # fmt: skip
        clip, algorithm = check_clip(gradient_clip_val, gradient_clip_algorithm)
        self.fabric, self.model, self.optimizer = fabric, model, optimizer
        self.gradient_clip_val, self.gradient_clip_algorithm = clip, algorithm
        self.method = method if isinstance(method, str) else type(method).name
        self.spec = spec_from(
            method, options, owner="FabricSAM",
            instead="call `fabric.backward(loss)` and `optimizer.step()`.",
        )  # fmt: skip
        broadcast = fabric.broadcast if fabric.world_size > 1 else None
        seed = run_seed(self.spec.seed, default_seed, broadcast)
        module = model.module
        if self.spec.samples_layers:  # as the callback: each compiled block one layer
            compile_blocks_instead(model._forward_module)
        self.partition = self.spec.partition(module)
        self.engine: SAMEngine = self.spec.build_engine(
            module, seed=seed, partition=self.partition, warn=_warn
        )
        self._check_parameters(module)
        if self.spec.samples_layers:
            if compiled_whole(model._forward_module):
                raise ValueError(
                    f"FabricSAM({self.spec.label}) freezes other layers every step, so a model"
                    " compiled whole without repeated blocks would recompile each time. Compile"
                    " its blocks instead (`block.compile()`) or train it uncompiled."
                )
            check_compiled_sampling(self.name, module, self.engine)
        self.ddp = fabric.world_size > 1 and "DDPStrategy" in _names(strategy)
        check_sharded(
            "FabricSAM", _names(strategy), fabric.world_size, self.engine.shards.sharded,
            fix="apply fully_shard in the strategy's parallelize_fn, or use strategy='ddp'.",
            docs="docs/fabric.md",
        )  # fmt: skip
        self.averager = GradientAverager() if fabric.world_size > 1 else None
        self._checked_draw = False

    def _check_parameters(self, module: torch.nn.Module) -> None:
        """The optimizer must update the model's current tensors (not ones FSDP2 replaced)."""
        model_params = {id(p) for p in module.parameters()}
        opt_params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if not opt_params or any(id(p) not in model_params for p in opt_params):
            raise ValueError(
                "FabricSAM: the optimizer holds tensors that are not the model's parameters:"
                " create it over `model.parameters()`; under FSDP2, after `model ="
                " fabric.setup_module(model)`, then `fabric.setup_optimizers(optimizer)`."
                " See docs/fabric.md."
            )

    def step(self, loss_fn: Callable[[Any], Tensor], *batches: Any) -> StepResult:
        """One optimizer step of the method over ``batches`` (several: accumulated).

        Args:
            loss_fn: ``loss_fn(batch)`` returns the model's loss on ``batch``: a scalar, or
                per-sample losses (1-D, averaged; ESAM needs them). Called once per pass and
                micro-batch, on a subset of the samples for ESAM and SSAM-F.
            *batches: the step's micro-batches (one for no accumulation).

        Returns:
            The step's :class:`~lightning_slsam.StepResult` (``loss``: the first pass's).
        """
        if not batches:
            raise ValueError("FabricSAM.step needs at least one batch: `sam.step(loss_fn, batch)`.")
        module = self.model.module
        # Tensors unfrozen (or frozen) since the last step are sampled from now on.
        followed = follow_trainable(
            self.spec, self.engine, module, _warn, self.name, self.engine.num_steps
        )
        if followed is not None:
            self.engine, line = followed
            self.partition = self.engine.partition
            _info(line)
        passes = PassRunner(
            batches, lambda batch: read_output(loss_fn(batch)), self.fabric.backward,
            scale=1.0 / len(batches), needs_per_sample=self.engine.needs_per_sample,
        )  # fmt: skip
        scaler = getattr(self.fabric.strategy.precision, "scaler", None)
        check_draw = self.averager is not None and not self._checked_draw
        self._checked_draw = True
        return run_step(
            self.engine, passes, self._zero_grad, lambda skip: self._optimizer_step(skip, scaler),
            self.optimizer, scaler=scaler, averager=self.averager, check_draw=check_draw,
            no_sync=self.fabric.no_backward_sync(self.model) if self.ddp else None,
        )  # fmt: skip

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self, skip: bool, scaler: Any) -> None:
        if skip:
            if scaler is not None:
                skip_with_scaler(self.optimizer)
                self.optimizer.step()
            return
        clip = self.gradient_clip_val
        if clip:
            if self.gradient_clip_algorithm == "norm":
                self.fabric.clip_gradients(
                    self.model, self.optimizer, max_norm=clip, error_if_nonfinite=False
                )
            else:
                self.fabric.clip_gradients(self.model, self.optimizer, clip_val=clip)
        self.optimizer.step()

    @property
    def name(self) -> str:
        return f"FabricSAM({self.spec.label})"

    def state_dict(self) -> dict[str, Any]:
        """The method's state (selection, counters, generators, a method's own parts)."""
        return method_state(self.method, self.spec, self.engine)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; refuses a checkpoint of other layers."""
        apply_method_state(state, self.engine, owner="FabricSAM", spec=self.spec, warn=_warn)


def _is_fabric(obj: Any) -> bool:
    from lightning.fabric import Fabric

    return isinstance(obj, Fabric)


def _warn(message: str) -> None:
    from lightning.fabric.utilities import rank_zero_warn

    rank_zero_warn(message)


def _info(message: str) -> None:
    from lightning.fabric.utilities import rank_zero_info

    rank_zero_info(message)
