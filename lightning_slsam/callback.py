"""``SparseLayerSAM``: the Lightning callback that turns a SAMMixin module into SL-SAM.

.. code-block:: python

    import lightning as L
    from lightning_slsam import SAMMixin, SparseLayerSAM

    trainer = L.Trainer(max_epochs=3, callbacks=[SparseLayerSAM(rho=0.01, layer_ratio=0.2)])
    trainer.fit(model)  # model: class Model(SAMMixin, L.LightningModule)

In a LightningCLI YAML::

    trainer:
      callbacks:
        - class_path: lightning_slsam.SparseLayerSAM
          init_args: {rho: 0.01, layer_ratio: 0.2}

The callback owns the selection state: the layer partition, the EXP3 bandit of the
SL-SAM paper (Algorithm 2), its checkpointed state, and what is logged. The mixin owns
the training step itself.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_slsam.bandit import LayerBandit, kl_projection
from lightning_slsam.engine import SparseSAMEngine, StepResult
from lightning_slsam.layers import LayerPartition, LayerSpec, build_partition, validate_layer_spec
from lightning_slsam.metrics import (
    normalized_entropy,
    plot_layer_frequency,
    write_layer_frequency_csv,
)
from lightning_slsam.mixin import SAMMixin, scheduler_configs
from lightning_slsam.perturbation import SAMPerturbation

__all__ = ["SparseLayerSAM", "estimated_stepping_batches"]

BANDIT_LOSSES = ("shifted", "paper")
_CLIP_ALGORITHMS = ("norm", "value")
_PROGRESS_BAR = {
    "sl_layers": "slsam/active_layers",
    "sl_ratio": "slsam/active_ratio",
    "sl_entropy": "slsam/entropy",
}


class SparseLayerSAM(Callback):
    """Sparse Layer SAM (SL-SAM): SAM on a bandit-sampled subset of layers each step.

    Each training step samples the active layers (independent Bernoulli draws with the
    bandit's probabilities), freezes the rest, runs SAM's two passes on the active
    layers only, steps the module's optimizer on the second-pass gradients, and feeds
    the first-pass per-layer gradient norms back to the bandit.

    Args:
        rho: SAM perturbation radius (> 0). Paper: 0.01.
        layer_ratio: expected fraction of layers active per step, ``s/N`` in (0, 1].
            Paper: 0.2 (0.25 on RTE). ``1.0`` makes every layer active: vanilla SAM.
        p_min: lower bound of every layer's probability, in (0, 1), at most
            ``layer_ratio``. Paper: 1e-3.
        alpha_p: bandit step size (>= 0). Paper: 1e-3.
        bandit_loss: ``"shifted"`` (default; the authors' released code) or ``"paper"``
            (Algorithm 2 literally, which with the paper's constants pushes every
            sampled layer to ``p_min``). See :class:`~lightning_slsam.LayerBandit`.
        perturbation_norm: ``"global"`` (default; one norm over all active tensors, as
            SAM and the released code) or ``"layer"`` (per layer, as Algorithm 1 reads).
        layers: what a layer is: ``"tensor"`` (default, paper), ``"module"``, a list
            of regular expressions (one group per distinct match) or a callable
            ``(name, param) -> key | None``.
        always_active: regular expressions of parameter names trained every step.
        always_frozen: regular expressions of parameter names never trained.
        seed: seed of the bandit's own generator; ``None`` uses ``torch.initial_seed()``
            (set by ``seed_everything``), so runs are reproducible without consuming
            the global random stream.
        gradient_clip_val: clip the update (second-pass) gradient at this value after
            unscaling; ``None`` or 0 disables. Use this instead of the Trainer flag.
        gradient_clip_algorithm: ``"norm"`` (default) or ``"value"``.
        accumulate_grad_batches: micro-batches per optimizer step (>= 1). Use this
            instead of the Trainer flag: the perturbation comes from the gradient of all
            micro-batches, then a second pass runs over all of them.
        plot: write the per-layer activation chart (PNG) at the end of fit.

    Attributes:
        layer_names: names of the sampled layers, in model order (after setup).
        probs: the bandit's current probabilities (float64, sums to ``layer_ratio * N``).
        active_mask: bool mask of the layers active in the last step.
        mean_active_ratio: mean over steps of the parameter fraction with a gradient,
            summed over both passes (the paper's "Active Ratio"; SAM is 2.0).
        frequency_csv_path, frequency_plot_path: where the end-of-fit record went.
    """

    def __init__(
        self,
        rho: float = 0.01,
        layer_ratio: float = 0.2,
        p_min: float = 1e-3,
        alpha_p: float = 1e-3,
        bandit_loss: str = "shifted",
        perturbation_norm: str = "global",
        layers: LayerSpec = "tensor",
        always_active: Sequence[str] = (),
        always_frozen: Sequence[str] = (),
        seed: int | None = None,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        accumulate_grad_batches: int = 1,
        plot: bool = True,
    ) -> None:
        super().__init__()
        self.perturbation = SAMPerturbation(rho, norm=perturbation_norm)
        if bandit_loss not in BANDIT_LOSSES:
            raise ValueError(
                f"`bandit_loss` must be one of {BANDIT_LOSSES}, got {bandit_loss!r}: 'shifted' is"
                " the released code's loss (default), 'paper' Algorithm 2 literally."
            )
        # A throw-away bandit validates the other bandit options now rather than at setup.
        probe_layers = max(1, math.ceil(1.0 / layer_ratio)) if _is_ratio(layer_ratio) else 1
        LayerBandit(probe_layers, layer_ratio, p_min, alpha_p, bandit_loss)
        validate_layer_spec(layers)
        if gradient_clip_val is not None and not (
            isinstance(gradient_clip_val, (int, float)) and gradient_clip_val >= 0
        ):
            raise ValueError(
                f"`gradient_clip_val` must be None or a number >= 0, got {gradient_clip_val!r}."
            )
        if gradient_clip_algorithm not in _CLIP_ALGORITHMS:
            raise ValueError(
                f"`gradient_clip_algorithm` must be one of {_CLIP_ALGORITHMS},"
                f" got {gradient_clip_algorithm!r}."
            )
        if not isinstance(accumulate_grad_batches, int) or accumulate_grad_batches < 1:
            raise ValueError(
                "`accumulate_grad_batches` must be an integer >= 1,"
                f" got {accumulate_grad_batches!r}."
            )
        if seed is not None and not isinstance(seed, int):
            raise ValueError(f"`seed` must be an integer or None, got {seed!r}.")
        self.rho = float(rho)
        self.layer_ratio = float(layer_ratio)
        self.p_min = float(p_min)
        self.alpha_p = float(alpha_p)
        self.bandit_loss = bandit_loss
        self.perturbation_norm = perturbation_norm
        self.layers = layers
        self.always_active = list(always_active)
        self.always_frozen = list(always_frozen)
        self.seed = seed
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.accumulate_grad_batches = accumulate_grad_batches
        self.plot = plot

        self.partition: LayerPartition | None = None
        self.engine: SparseSAMEngine | None = None
        self.frequency_csv_path: str | None = None
        self.frequency_plot_path: str | None = None
        self._pending_state: dict[str, Any] | None = None
        self._buffer: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self._fresh: StepResult | None = None

    # -- public views -------------------------------------------------------------------
    @property
    def layer_names(self) -> list[str]:
        """Names of the sampled layers (empty before setup)."""
        return list(self.partition.names) if self.partition is not None else []

    @property
    def bandit(self) -> LayerBandit:
        """The layer-selection bandit (available after setup)."""
        if self.engine is None:
            raise RuntimeError("SparseLayerSAM is not set up yet: call trainer.fit first.")
        return self.engine.selection  # type: ignore[return-value]

    @property
    def probs(self) -> Tensor:
        """Current selection probabilities (float64, one per layer)."""
        return self.bandit.probs

    @property
    def active_mask(self) -> Tensor | None:
        """Bool mask of the layers active in the last training step."""
        result = self.engine.last_result if self.engine is not None else None
        return result.active_mask if result is not None else None

    @property
    def mean_active_ratio(self) -> float:
        """The run's mean "Active Ratio" (parameter fraction, summed over the passes)."""
        return self.engine.mean_active_ratio if self.engine is not None else math.nan

    # -- setup --------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(pl_module, SAMMixin):
            raise MisconfigurationException(
                f"SparseLayerSAM needs the LightningModule to inherit SAMMixin, but"
                f" {type(pl_module).__name__} does not. Declare it as"
                f" `class {type(pl_module).__name__}(SAMMixin, L.LightningModule)`"
                " (`from lightning_slsam import SAMMixin`)."
            )
        # ModelCheckpoint warns that step checkpoints under manual optimization hold the
        # post-step weights. That is what automatic optimization saves too, and since the
        # mixin restores the unperturbed weights before stepping, it is the right state.
        warnings.filterwarnings(
            "ignore", message="Using ModelCheckpoint with manual optimization", category=UserWarning
        )
        # Lightning warns that scheduler `monitor`/`strict` keys are ignored under manual
        # optimization; the mixin honours them, so the warning would mislead.
        warnings.filterwarnings(
            "ignore", message="The lr scheduler dict contains the key", category=RuntimeWarning
        )
        if trainer.world_size > 1:
            raise MisconfigurationException(
                f"SparseLayerSAM runs on one process for now, but the Trainer uses"
                f" {trainer.world_size} ({type(trainer.strategy).__name__}). Multi-process"
                " strategies need rank-consistent layer sampling and gradient sync that are"
                " not validated yet: train on one device (devices=1)."
            )
        if str(trainer.precision) in ("16-mixed", "16", "16-true") and _has_scaler(trainer):
            raise MisconfigurationException(
                f"SparseLayerSAM does not support precision={trainer.precision!r} (a gradient"
                " scaler) yet: its first-pass gradients are scaled and an overflow must back"
                " the scaler off. Use precision='bf16-mixed' or '32-true'."
            )
        others = [cb for cb in trainer.callbacks if isinstance(cb, SparseLayerSAM)]
        if len(others) > 1:
            raise MisconfigurationException(
                f"{len(others)} SAM callbacks are attached to the Trainer; keep exactly one."
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise MisconfigurationException(
                f"SparseLayerSAM steps one optimizer, but configure_optimizers returned"
                f" {len(trainer.optimizers)}. Put all parameters in one optimizer (use"
                " parameter groups for different learning rates)."
            )
        trainer.strategy.lr_scheduler_configs = scheduler_configs(pl_module, trainer)
        partition = build_partition(pl_module, self.layers, self.always_active, self.always_frozen)
        if (
            self.engine is not None
            and self.partition is not None
            and (self.partition.signature() == partition.signature())
        ):
            self.engine.partition = partition  # a second fit() continues the same state
        else:
            self.engine = self._build_engine(partition)
        self.partition = partition
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self._apply_state(state)
        self._buffer = []

    def _build_engine(self, partition: LayerPartition) -> SparseSAMEngine:
        generator = torch.Generator()
        generator.manual_seed(self.seed if self.seed is not None else torch.initial_seed())
        try:
            bandit = LayerBandit(
                partition.num_layers,
                layer_ratio=self.layer_ratio,
                p_min=self.p_min,
                alpha_p=self.alpha_p,
                loss=self.bandit_loss,
                generator=generator,
            )
        except ValueError as err:
            raise MisconfigurationException(
                f"{err} (the model has {partition.num_layers} layers with layers={self.layers!r})"
            ) from None
        return SparseSAMEngine(partition, bandit, self.perturbation)

    # -- the step (called by SAMMixin) ------------------------------------------------------
    def _accumulate(
        self, trainer: pl.Trainer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[tuple[tuple[Any, ...], dict[str, Any]]] | None:
        """Buffer a micro-batch; return the whole group once it is complete.

        The epoch's last batch closes a partial group, as Lightning's own accumulation does.
        """
        self._buffer.append((args, kwargs))
        last = trainer.fit_loop.epoch_loop._num_ready_batches_reached()
        if len(self._buffer) < self.accumulate_grad_batches and not last:
            return None
        group, self._buffer = self._buffer, []
        return group

    def _run_step(
        self,
        pl_module: pl.LightningModule,
        forward_backward: Callable[[], Tensor],
        zero_grad: Callable[[], None],
        optimizer_step: Callable[[bool], None],
    ) -> StepResult:
        if self.engine is None:
            raise RuntimeError("SparseLayerSAM ran a step before on_fit_start.")
        result = self.engine.step(forward_backward, zero_grad, optimizer_step)
        self._fresh = result
        return result

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        # Runs inside the wrapped optimizer.step(), after mixed precision has unscaled.
        if self.gradient_clip_val:
            pl_module.clip_gradients(
                optimizer,
                gradient_clip_val=self.gradient_clip_val,
                gradient_clip_algorithm=self.gradient_clip_algorithm,
            )

    # -- logging ------------------------------------------------------------------------
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        result, self._fresh = self._fresh, None
        if result is None or self.engine is None:
            return
        per_pass = result.active_ratio_per_pass
        metrics = {
            "slsam/active_layers": float(result.active_mask.sum()),
            "slsam/active_ratio": result.active_ratio,
            "slsam/active_ratio_pass1": per_pass,
            "slsam/active_ratio_pass2": per_pass if result.num_backward >= 2 else 0.0,
            "slsam/backward_passes": float(result.num_backward),
            "slsam/entropy": normalized_entropy(self.engine.selection.probs),
            "slsam/skipped_steps": float(self.engine.num_skipped),
        }
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)
        # Short names for the progress bar only (loggers get the namespaced ones above).
        for name, key in _PROGRESS_BAR.items():
            pl_module.log(name, metrics[key], prog_bar=True, logger=False, batch_size=1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.engine is None or self.partition is None:
            return
        if trainer.is_global_zero:
            self._write_record(trainer)
        ratio = self.mean_active_ratio
        message = (
            f"SL-SAM: mean active ratio {ratio:.3f}x over both passes (SAM: 2.0x, AdamW: 1.0x),"
            f" {self.partition.num_layers} layers at layer_ratio={self.layer_ratio:g},"
            f" {self.engine.num_skipped} skipped steps."
        )
        if self.frequency_plot_path:
            message += f" Per-layer activation chart: {self.frequency_plot_path}"
        rank_zero_info(message)

    def _write_record(self, trainer: pl.Trainer) -> None:
        assert self.engine is not None and self.partition is not None
        directory = trainer.log_dir or trainer.default_root_dir
        steps = self.engine.num_steps - self.engine.num_skipped
        probs = self.engine.selection.probs
        self.frequency_csv_path = write_layer_frequency_csv(
            os.path.join(directory, "slsam_layer_frequency.csv"),
            self.partition.names,
            self.partition.numel,
            self.engine.counts,
            steps,
            probs,
        )
        if self.plot:
            self.frequency_plot_path = plot_layer_frequency(
                os.path.join(directory, "slsam_layer_frequency.png"),
                self.partition.names,
                self.engine.counts,
                steps,
                probs,
                self.layer_ratio,
            )

    # -- checkpoint state ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.engine is None or self.partition is None:
            return dict(self._pending_state or {})
        return {
            "engine": self.engine.state_dict(),
            "layer_names": self.partition.names,
            "layer_tensors": self.partition.signature(),
            "config": {
                "rho": self.rho,
                "layer_ratio": self.layer_ratio,
                "p_min": self.p_min,
                "alpha_p": self.alpha_p,
                "bandit_loss": self.bandit_loss,
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.engine is None:
            self._pending_state = state_dict  # applied once the partition exists
        else:
            self._apply_state(state_dict)

    def _apply_state(self, state: dict[str, Any]) -> None:
        assert self.engine is not None and self.partition is not None
        saved = state.get("layer_tensors")
        current = self.partition.signature()
        if saved is not None and saved != current:
            raise MisconfigurationException(
                "The checkpoint's SL-SAM state does not match this model's layers: "
                + _describe_mismatch(saved, current)
                + ". Resume with the same model and `layers` / `always_active` /"
                " `always_frozen` options, or start the SL-SAM state afresh by resuming"
                " without it."
            )
        engine_state = dict(state["engine"])
        engine_state["selection"] = self._adopt_hyperparameters(engine_state["selection"])
        self.engine.load_state_dict(engine_state)

    def _adopt_hyperparameters(self, saved: dict[str, Any]) -> dict[str, Any]:
        """The constructor's bandit options win over the checkpoint's.

        The learned distribution carries over; when ``layer_ratio`` or ``p_min`` changed it
        is KL-projected onto the new constraint set, exactly as an update would be.
        """
        wanted = {
            "layer_ratio": self.layer_ratio,
            "p_min": self.p_min,
            "alpha_p": self.alpha_p,
            "loss": self.bandit_loss,
        }
        changed = {k: (saved[k], v) for k, v in wanted.items() if saved.get(k) != v}
        if not changed:
            return saved
        rank_zero_warn(
            "Resuming SL-SAM with options that differ from the checkpoint's: "
            + ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
            + ". The new options apply from now on; the learned layer distribution is kept"
            " (projected onto the new budget where needed)."
        )
        adopted = {**saved, **wanted}
        probs = saved["probs"].double()
        budget = self.layer_ratio * probs.numel()
        adopted["probs"] = kl_projection(probs.log(), budget, self.p_min, 1.0)
        return adopted


def estimated_stepping_batches(trainer: pl.Trainer) -> float:
    """``trainer.estimated_stepping_batches``, counting SparseLayerSAM's own accumulation.

    Lightning's estimate divides by ``Trainer(accumulate_grad_batches)``, which must stay 1
    with a SAM callback; the callback's ``accumulate_grad_batches`` also merges micro-batches
    into one optimizer step. Use this to size step-based LR schedules
    (``math.inf`` when the run has no finite length).
    """
    total = trainer.estimated_stepping_batches  # also sets up the train dataloader
    sam = next((cb for cb in trainer.callbacks if isinstance(cb, SparseLayerSAM)), None)
    k = sam.accumulate_grad_batches if sam is not None else 1
    if k == 1 or not math.isfinite(total):
        return total
    batches = trainer.num_training_batches
    if not math.isfinite(batches):
        return total if trainer.max_steps != -1 else math.inf
    per_epoch = math.ceil(batches / k)  # the epoch's last batch closes a partial group
    steps = per_epoch * max(trainer.max_epochs or 1, 1)
    return min(steps, trainer.max_steps) if trainer.max_steps != -1 else steps


def _has_scaler(trainer: pl.Trainer) -> bool:
    return getattr(trainer.precision_plugin, "scaler", None) is not None


def _is_ratio(value: Any) -> bool:
    return isinstance(value, (int, float)) and 0 < value <= 1


def _describe_mismatch(saved: list[list[str]], current: list[list[str]]) -> str:
    saved_set = {name for group in saved for name in group}
    current_set = {name for group in current for name in group}
    missing = sorted(saved_set - current_set)
    added = sorted(current_set - saved_set)
    parts = [f"checkpoint has {len(saved)} layers, model has {len(current)}"]
    if missing:
        parts.append(f"missing from the model: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if added:
        parts.append(f"new in the model: {added[:5]}{' ...' if len(added) > 5 else ''}")
    if not missing and not added:
        parts.append("the same tensors are grouped into layers differently")
    return "; ".join(parts)
