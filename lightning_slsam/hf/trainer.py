"""SAM methods inside the Hugging Face ``Trainer``: :class:`SAMTrainer` and its mixin.

The Trainer keeps its own loop; the mixin changes what happens between fetching an
optimizer step's micro-batches and the Trainer's clipping and optimizer step:

- the Trainer fetches the micro-batches of one optimizer step at once
  (``get_batch_samples``); the mixin runs the method's whole step when the last of them
  arrives in ``training_step``: every pass (SAM's two, on the drawn layers) goes over all of
  them, so the perturbation comes from the whole accumulated gradient, as one batch of
  ``per_device_train_batch_size * gradient_accumulation_steps`` would give it;
- each micro-batch's loss is the one the Trainer's own ``training_step`` computes (its
  ``compute_loss``, the accumulation and token-count normalisation, the precision's
  autocast) and goes back through ``accelerator.backward`` (fp16's loss scaling included;
  the engine reads the scale to unscale its norms);
- the step leaves the second pass's gradients on the drawn layers and nothing else; the
  Trainer then clips them (``max_grad_norm``), steps its optimizer once (a gradient scaler
  skips on an overflow), steps its LR scheduler and zeroes the gradients, as always. Work
  due after the update (the default preset's update scaling) runs in a post-step hook of
  the optimizer;
- under DDP (``torchrun`` / ``accelerate launch``) the step runs inside ``no_sync`` and the
  engine averages the active layers' gradients itself;
- the method's state (selection, counters, generators) is written beside every checkpoint
  (``slsam_state.pt``) and read back by ``train(resume_from_checkpoint=...)``;
- ``slsam/*`` metrics go to the Trainer's reporters with each training log.

The Trainer's other features keep their meaning, FSDP2 among them (``fsdp_version: 2``: the
engine is rebuilt on the parameters the Trainer shards, and the FSDP2 seam of
:mod:`lightning_slsam.parallel` does the rest). What cannot hold is refused when the Trainer
is built: DeepSpeed (ZeRO steps its own flat partitions, layers not drawn included, and
accelerate steps it after the first pass's backward) and FSDP1 (flat parameters),
``DataParallel`` over several GPUs in one process, and the LOMO optimizers (they update
inside the backward pass).
"""

from __future__ import annotations

import copy
import functools
import math
import os
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from lightning_slsam.core.caller import warn
from lightning_slsam.core.engine import SAMEngine
from lightning_slsam.core.passes import (
    PER_SAMPLE_NEEDED,
    LossOutput,
    PassRunner,
    loss_scale_reader,
    skip_with_scaler,
    split_per_sample,
)
from lightning_slsam.core.record import fresh_stem, write_record
from lightning_slsam.core.state import apply_method_state, method_state
from lightning_slsam.core.step import LoopHooks, StepResult
from lightning_slsam.methods.registry import spec_from
from lightning_slsam.methods.spec import MethodSpec
from lightning_slsam.parallel.ddp import DDPAverager

__all__ = ["STATE_FILE", "SAMTrainer", "SAMTrainerMixin"]

#: The method's state in each checkpoint folder.
STATE_FILE = "slsam_state.pt"

#: Optimizers that update inside the backward pass, where SAM needs the gradient first.
_FUSED_OPTIMIZERS = ("lomo", "adalomo")

#: Model heads whose per-sample losses the mixin computes itself (ESAM's sample choice).
_PER_SAMPLE_HEADS = ("ForSequenceClassification", "ForImageClassification",
                     "ForTokenClassification", "ForCausalLM")  # fmt: skip


class SAMTrainerMixin:
    """Runs a SAM method of the registry inside a ``transformers.Trainer`` (or a subclass:
    list the mixin first, ``class MySFT(SAMTrainerMixin, SFTTrainer)``).

    Args:
        *args: the Trainer's positional arguments.
        sam: the method: a name of :data:`~lightning_slsam.METHODS` (``"slsam"``, what
            ``SparseLayerSAM()`` runs; ``"slsam_paper"``, the paper's SL-SAM; ``"sam"``,
            ``"rst"``, ...) or a specification with its options,
            ``method_spec("slsam", rho=0.05, layer_ratio=0.2)``
            (:func:`~lightning_slsam.methods.registry.method_spec`). Its ``seed`` defaults
            to ``TrainingArguments.seed``.
        **kwargs: the Trainer's keyword arguments.

    Attributes:
        sam_engine: the method's engine (:class:`~lightning_slsam.core.engine.
            SAMEngine`): ``last_result``, ``counts``, ``selection.probs``, ...
        sam_spec: the method's validated specification.
        sam_record: the per-layer record's CSV and PNG paths in ``output_dir``, written at
            train end where the method sampled layers (``None`` otherwise).
    """

    #: The trainer's attributes that its loss updates on every call for its logs. A SAM
    #: step computes each micro-batch's loss once per pass (SAM: twice); what a pass after
    #: the first changes in these attributes is undone, so each micro-batch is counted once,
    #: at the current weights, as without SAM. TRL's trainers (``SFTTrainer``,
    #: ``DPOTrainer``, ...) keep their logged metrics in ``_metrics`` and the tokens seen
    #: (``num_tokens``) in ``_total_train_tokens``; a subclass that records elsewhere adds its
    #: attribute names here (or checks :attr:`sam_pass` itself). Names the trainer lacks are
    #: ignored.
    sam_first_pass_attributes: tuple[str, ...] = ("_metrics", "_total_train_tokens")

    def __init__(self, *args: Any, sam: str | MethodSpec = "slsam", **kwargs: Any) -> None:
        # Checked before the Trainer is built: nothing is set up yet.
        spec = spec_from(sam, {}, owner="SAMTrainer", instead="use transformers.Trainer.")
        super().__init__(*args, **kwargs)
        trainer: Any = self
        _check_supported(trainer)
        self.sam_method = sam if isinstance(sam, str) else type(sam).name
        self.sam_spec = spec
        model = trainer.model
        seed = spec.seed if spec.seed is not None else int(trainer.args.seed)
        self._sam_seed = seed
        self.sam_engine: SAMEngine = spec.build_engine(model, seed=seed, warn=warn)
        if self.sam_engine.needs_per_sample and not _gives_per_sample(self, model):
            raise ValueError(
                f"{PER_SAMPLE_NEEDED} With SAMTrainer: {type(_base_model(model)).__name__} is"
                f" none of the heads whose per-sample losses SAMTrainer computes (models"
                f" ending in {', '.join(_PER_SAMPLE_HEADS)}); override"
                " `per_sample_loss(outputs, inputs)` to return them, or pass"
                " `sam=method_spec('esam', data_ratio=1.0)`."
            )
        self.sam_record: tuple[str, str | None] | None = None
        self._sam_window: tuple[list[Any], Any] | None = None
        self._sam_position = 0
        self._sam_model: Any = None
        self._sam_items: Any = None
        #: During a pass: what compute_loss records for the method (per-sample losses,
        #: logits); ``None`` otherwise.
        self._sam_outputs: dict[str, Tensor] | None = None
        self._sam_pending: list[Any] = []
        self._sam_hooked: Any = None
        self._sam_passes: PassRunner | None = None
        self._sam_averager = DDPAverager()
        # First, so that its train-begin warning precedes the progress bar's first line.
        trainer.callback_handler.callbacks.insert(0, _SAMCallback(self))
        _check_first_pass_attributes(self)

    @property
    def sam_pass(self) -> int:
        """The pass a SAM step is running: 1 for the first pass (at the current weights,
        over the whole batch), 2 for any later one (at perturbed weights, ESAM's ranking
        forward), 0 outside a step. A ``compute_loss`` with side effects beyond the loss
        (counters, metrics) guards them with ``if self.sam_pass <= 1``."""
        passes = getattr(self, "_sam_passes", None)
        return passes.number if passes is not None else 0

    # -- the step ----------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, *args: Any,
                          **kwargs: Any) -> Any:  # fmt: skip
        """The Trainer's fetch of one optimizer step's micro-batches, kept for the step."""
        batches, items = super().get_batch_samples(  # type: ignore[misc]
            epoch_iterator, num_batches, *args, **kwargs
        )
        self._sam_window, self._sam_position = (list(batches), items), 0
        return batches, items

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Tensor:
        """Runs the method's step once the optimizer step's last micro-batch arrives; returns
        the loss the Trainer logs (that step's first-pass loss, 0 for earlier micro-batches)."""
        window = self._sam_window
        position = self._sam_position
        if window is None or position >= len(window[0]) or window[0][position] is not inputs:
            window, position = ([inputs], num_items_in_batch), 0  # called on its own
        self._sam_position = position + 1
        if position + 1 < len(window[0]):
            return torch.zeros((), device=self.args.device)  # type: ignore[attr-defined]
        self._sam_window = None
        result = self._sam_step(model, *window)
        loss = result.loss if result.loss is not None else torch.zeros(())
        return loss.to(self.args.device)  # type: ignore[attr-defined]

    def _sam_step(self, model: Any, micro_batches: list[Any], items: Any) -> StepResult:
        trainer: Any = self
        unwrapped = trainer.accelerator.unwrap_model(model)
        engine = self._sam_engine_on(unwrapped)
        if engine.freezer.trainable_changed(unwrapped):
            # Tensors unfrozen (or frozen) since the last step: sampled from now on.
            self.sam_engine, change = self.sam_spec.follow_trainable(engine, unwrapped, warn)
            engine = self.sam_engine
            _info(f"SAMTrainer({self.sam_spec.label}), before step {engine.num_steps}: {change}")
        self._sam_hook_optimizer()
        self._sam_pending = []
        self._sam_model, self._sam_items = model, items
        # The Trainer's loss is already its share of the step (divided by the micro-batches
        # or normalised by the step's tokens): a method's added term is scaled to match.
        passes = PassRunner(
            micro_batches, self._sam_loss, trainer.accelerator.backward,
            needs_per_sample=engine.needs_per_sample, term_scale=1.0 / len(micro_batches),
        )  # fmt: skip
        self._sam_passes = passes
        scaler = getattr(trainer.accelerator, "scaler", None)
        ddp = _ddp(model)
        averager, first = self._sam_averager(ddp, unwrapped) if ddp is not None else (None, False)
        loop = LoopHooks(
            passes, functools.partial(model.zero_grad, set_to_none=True),
            functools.partial(self._sam_optimizer_step, scaler=scaler),
            loss_scale_reader(scaler), averager, check_draw=first,
            after_update=self._sam_after_update, optimizer=self.optimizer,
        )  # fmt: skip
        try:
            with ddp.no_sync() if ddp is not None else nullcontext():
                return engine.step(loop)
        finally:
            self._sam_model = self._sam_items = self._sam_passes = None

    def _sam_engine_on(self, unwrapped: Any) -> SAMEngine:
        """The engine over ``unwrapped``'s parameters. Under FSDP2 the Trainer shards the
        model (``fully_shard``) after this mixin is built, replacing every parameter: the
        engine is then rebuilt on the sharded model, keeping its state (a checkpoint's too:
        the parameters keep their names). Called at train begin and at every step (a model
        the Trainer prepares anew, as a second ``train()`` does)."""
        engine = self.sam_engine
        owned = {id(p) for p in unwrapped.parameters()}
        if all(id(p) in owned for p in engine.partition.flat_params):
            return engine
        rebuilt = self.sam_spec.build_engine(unwrapped, seed=self._sam_seed, warn=warn)
        rebuilt.load_state_dict(engine.state_dict())
        rebuilt.planned_steps = engine.planned_steps
        self.sam_engine = rebuilt
        return rebuilt

    def _sam_loss(self, batch: Any) -> LossOutput:
        """One micro-batch's loss, as the Trainer's own ``training_step`` computes it (its
        backward is taken over by the pass loop), with the per-sample losses if needed. In a
        later pass, what the call records in :attr:`sam_first_pass_attributes` is undone."""
        trainer: Any = self
        accelerator = trainer.accelerator
        taken: list[Tensor] = []
        engine = self.sam_engine
        self._sam_outputs = {} if engine.needs_per_sample or engine.parts.needs_outputs else None
        kept = self._sam_keep_first_pass_attributes() if self.sam_pass >= 2 else {}
        accelerator.backward = lambda loss, **kwargs: taken.append(loss)
        try:
            super().training_step(self._sam_model, batch, self._sam_items)  # type: ignore[misc]
        finally:
            del accelerator.backward  # the Accelerator's own method again
            for name, value in kept.items():
                setattr(self, name, value)
        recorded, self._sam_outputs = self._sam_outputs or {}, None
        loss, given = split_per_sample(taken[0])
        per_sample = given if given is not None else recorded.get("per_sample")
        return LossOutput(loss, per_sample, recorded.get("logits"), recorded.get("index"))

    def _sam_keep_first_pass_attributes(self) -> dict[str, Any]:
        """Copies of the :attr:`sam_first_pass_attributes` the trainer has."""
        missing = object()
        values = {name: getattr(self, name, missing) for name in self.sam_first_pass_attributes}
        return {name: copy.deepcopy(v) for name, v in values.items() if v is not missing}

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:  # fmt: skip
        """The Trainer's ``compute_loss``; during a pass of a method that reads more than the
        loss, also records it: per-sample losses (ESAM, :meth:`per_sample_loss`), the
        model's logits (MESA, SAF)."""
        inputs, index = _without_index(inputs)
        recording = getattr(self, "_sam_outputs", None)
        if recording is None:
            return super().compute_loss(  # type: ignore[misc]
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        loss, outputs = super().compute_loss(  # type: ignore[misc]
            model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
        )
        engine = self.sam_engine
        if engine.needs_per_sample and not (isinstance(loss, Tensor) and loss.dim() == 1):
            recording["per_sample"] = self.per_sample_loss(outputs, inputs).detach()
        if "logits" in engine.parts.needs_outputs:
            recording["logits"] = outputs["logits"]
        if index is not None:
            recording["index"] = index
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``prediction_step``, the batch's ``index`` column (SAF's) kept from
        the model."""
        inputs = _without_index(inputs)[0]
        return super().prediction_step(model, inputs, *args, **kwargs)  # type: ignore[misc]

    def _set_signature_columns_if_needed(self) -> None:
        # The Trainer drops a dataset's columns the model's forward does not take: the
        # `index` column SAF reads stays (taken out of the batch before the model sees it).
        super()._set_signature_columns_if_needed()  # type: ignore[misc]
        columns = self._signature_columns  # type: ignore[has-type]
        if "index" not in columns:
            columns.append("index")

    def per_sample_loss(self, outputs: Any, inputs: Any) -> Tensor:
        """Each sample's loss from the model's ``outputs`` on ``inputs`` (ESAM chooses the
        second pass's samples by them): cross-entropy of a classification head, the mean
        next-token loss of a causal LM (labels ``-100`` ignored). Override for other heads."""
        if "labels" not in inputs:  # a trainer computing its own loss from other keys
            raise ValueError(
                "ESAM's data selection (data_ratio < 1) needs each sample's loss, which"
                " SAMTrainer computes from the batch's `labels`; this batch has none (its keys:"
                f" {', '.join(map(str, inputs))}). Override `per_sample_loss(outputs, inputs)`"
                " to return them, or pass `sam=method_spec('esam', data_ratio=1.0)`."
            )
        logits, labels = outputs["logits"], inputs["labels"]
        if logits.dim() == 2 and labels.dim() == 1:
            if logits.shape[-1] == 1:  # regression
                return (logits.squeeze(-1).float() - labels.float()).pow(2)
            return torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
        if _is_causal(self.model):  # type: ignore[attr-defined]
            logits, labels = logits[:, :-1], labels[:, 1:]
        tokens = torch.nn.functional.cross_entropy(
            logits.float().transpose(1, 2), labels, reduction="none", ignore_index=-100
        )
        counted = (labels != -100).sum(1).clamp(min=1)
        return tokens.sum(1) / counted

    # -- the update, made by the Trainer after the step ---------------------------------
    def _sam_optimizer_step(self, skip: bool, scaler: Any) -> None:
        """The Trainer steps the optimizer after ``training_step``; a skipped step leaves
        every gradient ``None`` (nothing moves), and makes a gradient scaler back off."""
        if skip and scaler is not None:
            skip_with_scaler(_inner_optimizer(self.optimizer))  # type: ignore[attr-defined]

    def _sam_after_update(self, work: Any) -> None:
        self._sam_pending.append(work)

    def _sam_hook_optimizer(self) -> None:
        optimizer = _inner_optimizer(self.optimizer)  # type: ignore[attr-defined]
        if optimizer is None or self._sam_hooked is optimizer:
            return
        optimizer.register_step_post_hook(self._sam_run_pending)
        self._sam_hooked = optimizer

    def _sam_run_pending(self, *args: Any) -> None:
        pending, self._sam_pending = self._sam_pending, []
        for work in pending:
            work()

    # -- logs and checkpoints -------------------------------------------------------------
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, with the method's ``slsam/*`` metrics of the last step beside
        each training loss."""
        engine = self.sam_engine
        if "loss" in logs and engine.last_result is not None:
            distributed = int(self.args.world_size) > 1  # type: ignore[attr-defined]
            metrics = engine.step_metrics(engine.last_result, distributed)
            done = max(engine.num_steps - engine.num_skipped, 1)
            metrics["slsam/mean_active_ratio"] = engine.active_ratio_sum / done
            logs = {**logs, **{k: round(v, 4) for k, v in metrics.items()}}
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:  # fmt: skip
        """The Trainer's ``train``; resuming reads the method's state from the checkpoint."""
        path = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(self.args.output_dir)  # type: ignore[attr-defined]
        if isinstance(path, str):
            self.load_sam_state(path)
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The Trainer's load of the optimizer's state. Under FSDP2 torch's distributed
        checkpoint loads it strictly, and holds none for a tensor the optimizer never
        updated (a sampled layer not drawn before the checkpoint): those tensors are set
        aside (``requires_grad=False``) while it loads, as the optimizer never saw them."""
        if checkpoint is None or _fsdp_version(self) != 2:
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        engine = self.sam_engine
        never = {
            name
            for names, count in zip(engine.partition.param_names, engine.counts.tolist())
            if count == 0
            for name in names
        }
        model: Any = self.model  # type: ignore[attr-defined]
        aside = [p for n, p in model.named_parameters() if n in never and p.requires_grad]
        for param in aside:
            param.requires_grad_(False)
        try:
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        finally:
            for param in aside:
                param.requires_grad_(True)

    def sam_state_dict(self) -> dict[str, Any]:
        """The method's state (what ``slsam_state.pt`` holds)."""
        engine = self.sam_engine
        return method_state(self.sam_method, self.sam_spec, engine)

    def load_sam_state(self, checkpoint: str) -> None:
        """Restore the method's state saved in the folder ``checkpoint``."""
        file = os.path.join(checkpoint, STATE_FILE)
        if not os.path.isfile(file):
            warn(
                f"{checkpoint} holds no {STATE_FILE} (saved without SAMTrainer?): the"
                f" method's selection and counters start afresh."
            )
            return
        state = torch.load(file, map_location="cpu", weights_only=False)
        apply_method_state(
            state, self.sam_engine, owner=type(self).__name__, spec=self.sam_spec, warn=warn
        )


class SAMTrainer(SAMTrainerMixin, Trainer):
    """A ``transformers.Trainer`` that trains with a SAM method of the registry.

    ``SAMTrainer(model=..., args=..., train_dataset=..., sam="slsam")``; every other
    argument is the Trainer's. See :class:`SAMTrainerMixin` for ``sam`` and
    docs/huggingface.md for a walk-through.
    """


class _SAMCallback(TrainerCallback):
    """At train begin, moves the engine to the prepared model's parameters and says when the
    run is too short for the method's layer draws (the guard rail,
    :mod:`lightning_slsam.selection.coverage`); writes the method's state into every
    checkpoint folder the Trainer saves, and at train end the per-layer record
    (``slsam_layer_frequency.csv`` and ``.png``) into ``output_dir`` where layers were drawn."""

    def __init__(self, trainer: SAMTrainerMixin) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer has prepared the model (FSDP2 has sharded it): the engine moves to its
        # parameters now, letting go of the unsharded ones before the first step.
        trainer: Any = self.trainer
        engine = trainer._sam_engine_on(trainer.accelerator.unwrap_model(trainer.model))
        engine.planned_steps = state.max_steps if state.max_steps > 0 else math.inf
        if state.is_world_process_zero and state.max_steps > 0:
            steps = state.max_steps - state.global_step
            message = self.trainer.sam_spec.coverage_warning(self.trainer.sam_engine, steps)
            if message is not None:
                warn(message)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The per-layer record (as the Lightning callback writes it), where layers were drawn.
        engine, spec = self.trainer.sam_engine, self.trainer.sam_spec
        if not state.is_world_process_zero or not engine.sampled():
            return
        self.trainer.sam_record = csv_path, chart = write_record(
            fresh_stem(args.output_dir, versioned=False), engine, engine.partition, plot=True,
            title=f"{spec.label}: how often each layer was trained",
            layer_ratio=getattr(spec, "layer_ratio", None),
        )  # fmt: skip
        _info(f"SAMTrainer({spec.label}): per-layer record {csv_path}, chart {chart}")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not args.should_save:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder):
            torch.save(self.trainer.sam_state_dict(), os.path.join(folder, STATE_FILE))


#: The route beyond one GPU that SAMTrainer runs: FSDP2 (or DDP).
_FSDP2 = ("FSDP2, TrainingArguments(fsdp='full_shard auto_wrap', fsdp_config={'fsdp_version':"
          " 2, 'transformer_layer_cls_to_wrap': [...]}) (accelerate config: `fsdp_version: 2`),"
          " or DDP (`torchrun` / `accelerate launch`, one process per GPU)")  # fmt: skip


def _check_supported(trainer: Any) -> None:
    """Refuses, before anything trains, what the method's step cannot run inside."""
    args = trainer.args
    problem = fix = None
    if getattr(trainer, "is_deepspeed_enabled", False):
        problem = (
            "DeepSpeed: ZeRO's optimizer steps one flat float32 partition of every trainable"
            " tensor (a layer not drawn gets a zero gradient, and weight decay and momentum"
            " still move it), and under the Trainer accelerate's DeepSpeedEngineWrapper.backward"
            " runs the engine's step after the backward that ends an optimizer step, so after"
            " SAM's first pass"
        )
        fix = f"FSDP2 shards each parameter on its own: use {_FSDP2}."
    elif _fsdp_version(trainer) == 1:
        problem = (
            "FSDP1: its flat parameters (use_orig_params or not) cannot be frozen or perturbed"
            " a layer at a time"
        )
        fix = f"FSDP2 shards each parameter on its own: use {_FSDP2}."
    elif int(args.n_gpu) > 1:
        problem = (f"DataParallel over {args.n_gpu} GPUs in one process: its replicas are"
                   " rebuilt every forward, outside the layers the method freezes")  # fmt: skip
        fix = f"Run one process per GPU: {_FSDP2}."
    elif str(getattr(args.optim, "value", args.optim)) in _FUSED_OPTIMIZERS:
        optim = str(getattr(args.optim, "value", args.optim))
        problem = (f"optim={optim!r}: it updates the weights inside the backward pass, before"
                   " SAM has the gradient it perturbs with")  # fmt: skip
        fix = "Use a torch optimizer (the default AdamW, or any other torch.optim optimizer)."
    if problem is not None:
        raise ValueError(f"SAMTrainer does not support {problem}. {fix}")


def _fsdp_version(trainer: Any) -> int | None:
    """The FSDP version the Trainer runs (``None``: no FSDP): accelerate's plugin's where it
    set one up, else the one the arguments ask for (1 unless ``fsdp_version`` says 2)."""
    if getattr(trainer, "is_fsdp_enabled", False):
        plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
        return int(getattr(plugin, "fsdp_version", 1) or 1)
    if not trainer.args.fsdp:
        return None
    # The plugin's arguments as the Trainer built them (its default version included), else
    # the configuration (``fsdp_`` prefixes dropped by newer Trainers; version 1 by default in
    # older ones).
    plugin_args = getattr(trainer.args, "fsdp_plugin_args", None) or {}
    config = getattr(trainer.args, "fsdp_config", None) or {}
    version = plugin_args.get("fsdp_version", config.get("version", config.get("fsdp_version")))
    return int(version or 1)


def _inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under accelerate's wrapper (whose hooks fire on each update)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _ddp(model: Any) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    return model if isinstance(model, DistributedDataParallel) else None


def _base_model(model: Any) -> Any:
    get = getattr(model, "get_base_model", None)  # PEFT
    return get() if callable(get) else model


def _is_causal(model: Any) -> bool:
    return type(_base_model(model)).__name__.endswith("ForCausalLM")


def _gives_per_sample(trainer: SAMTrainerMixin, model: Any) -> bool:
    if type(trainer).per_sample_loss is not SAMTrainerMixin.per_sample_loss:
        return True
    return type(_base_model(model)).__name__.endswith(_PER_SAMPLE_HEADS)


def _check_first_pass_attributes(trainer: SAMTrainerMixin) -> None:
    """TRL's trainers record their logged metrics in every loss call: warn when a TRL
    trainer has none of the attributes the mixin restores after a later pass (a TRL release
    that renamed them), as its metrics would then count each micro-batch once per pass."""
    names = trainer.sam_first_pass_attributes
    from_trl = any(c.__module__.split(".")[0] == "trl" for c in type(trainer).__mro__)
    if from_trl and not any(hasattr(trainer, name) for name in names):
        warn(
            f"{type(trainer).__name__} has none of the attributes {names} in which TRL's"
            " trainers record the metrics they log: its metrics (num_tokens, ...) may count"
            " each micro-batch once per SAM pass. Set `sam_first_pass_attributes` on the"
            " class to the attributes its compute_loss updates."
        )


def _info(message: str) -> None:
    from transformers.utils import logging

    logging.get_logger("lightning_slsam.hf").warning(message)


def _without_index(inputs: Any) -> tuple[Any, Tensor | None]:
    """The batch without its ``index`` column (each sample's position in the training set,
    which SAF reads and no model takes), and that column."""
    if isinstance(inputs, Mapping) and "index" in inputs:
        return {k: v for k, v in inputs.items() if k != "index"}, inputs["index"]
    return inputs, None
