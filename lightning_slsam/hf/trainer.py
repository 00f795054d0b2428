"""SAM methods inside the Hugging Face ``Trainer``: :class:`SAMTrainer` and its mixin.

The mixin runs the method's whole step at an optimizer step's last micro-batch, each pass over
all of the step's micro-batches with the Trainer's own loss and ``accelerator.backward``; the
Trainer then clips, steps and zeroes as always (docs/huggingface.md).
"""

from __future__ import annotations

import copy
import functools
import math
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from lightning_slsam.core.caller import warn
from lightning_slsam.core.engine import SAMEngine
from lightning_slsam.core.frontend import check_parallelism, follow_trainable, run_seed, run_step
from lightning_slsam.core.passes import (
    PER_SAMPLE_NEEDED,
    LossOutput,
    PassRunner,
    skip_with_scaler,
    split_per_sample,
)
from lightning_slsam.core.record import fresh_stem, write_record
from lightning_slsam.core.state import apply_method_state, method_state
from lightning_slsam.core.step import StepResult
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
        sam: a method name of :data:`~lightning_slsam.METHODS` (default ``"slsam"``, what
            ``SparseLayerSAM()`` runs; ``"slsam_paper"``, ``"sam"``, ...) or a specification,
            ``method_spec("slsam", rho=0.05)``; its ``seed`` defaults to
            ``TrainingArguments.seed``.
        **kwargs: the Trainer's keyword arguments.

    Attributes:
        sam_engine: the method's :class:`~lightning_slsam.core.engine.SAMEngine`
            (``last_result``, ``counts``, ``selection.probs``, ...).
        sam_spec: the method's validated specification.
        sam_record: the per-layer record's CSV and PNG paths in ``output_dir`` after a
            method that sampled layers (``None`` otherwise).
    """

    #: Attributes the loss updates for the logs (TRL's by default), undone after a later
    #: pass so each micro-batch counts once; names the trainer lacks are ignored.
    sam_first_pass_attributes: tuple[str, ...] = ("_metrics", "_total_train_tokens")

    def __init__(self, *args: Any, sam: str | MethodSpec = "slsam", **kwargs: Any) -> None:
        spec = spec_from(sam, {}, owner="SAMTrainer", instead="use transformers.Trainer.")
        super().__init__(*args, **kwargs)
        trainer: Any = self
        _check_supported(trainer)
        self.sam_method = sam if isinstance(sam, str) else type(sam).name
        self.sam_spec = spec
        model = trainer.model
        # No broadcast: every process parses the same TrainingArguments, so has the same seed.
        seed = run_seed(spec.seed, lambda: int(trainer.args.seed))
        self._sam_seed = seed
        self.sam_engine: SAMEngine = spec.build_engine(model, seed=seed, warn=warn)
        if self.sam_engine.needs_per_sample and not _gives_per_sample(self, model):
            raise ValueError(
                f"{PER_SAMPLE_NEEDED} SAMTrainer computes them for models ending in"
                f" {', '.join(_PER_SAMPLE_HEADS)}, not {type(_base_model(model)).__name__}:"
                " override `per_sample_loss(outputs, inputs)`, or pass"
                " `sam=method_spec('esam', data_ratio=1.0)`."
            )
        self.sam_record: tuple[str, str | None] | None = None
        self._sam_window: tuple[list[Any], Any] | None = None
        self._sam_position = 0
        self._sam_model: Any = None
        self._sam_items: Any = None
        #: During a pass: what compute_loss records for the method; ``None`` otherwise.
        self._sam_outputs: dict[str, Tensor] | None = None
        self._sam_pending: list[Any] = []
        self._sam_hooked: Any = None
        self._sam_passes: PassRunner | None = None
        self._sam_averager = DDPAverager()
        # First, so its train-begin warning precedes the progress bar.
        trainer.callback_handler.callbacks.insert(0, _SAMCallback(self))
        _check_first_pass_attributes(self)

    @property
    def sam_pass(self) -> int:
        """The running SAM pass: 1 at the current weights, 2 for any later one, 0 outside a
        step. Guard a ``compute_loss``'s side effects with ``if self.sam_pass <= 1``."""
        passes = getattr(self, "_sam_passes", None)
        return passes.number if passes is not None else 0

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, *args: Any,
                          **kwargs: Any) -> Any:  # fmt: skip
        """The Trainer's fetch of one optimizer step's micro-batches, kept for the step."""
        batches, items = super().get_batch_samples(  # type: ignore[misc]
            epoch_iterator, num_batches, *args, **kwargs
        )
        self._sam_window, self._sam_position = (list(batches), items), 0
        return batches, items

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Tensor:
        """Run the method's step at the optimizer step's last micro-batch; return its
        first-pass loss (0 for earlier micro-batches)."""
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
        # Tensors unfrozen (or frozen) since the last step are sampled from now on.
        name = f"SAMTrainer({self.sam_spec.label})"
        followed = follow_trainable(self.sam_spec, engine, unwrapped, warn, name, engine.num_steps)
        if followed is not None:
            self.sam_engine = engine = followed[0]
            _info(followed[1])
        self._sam_hook_optimizer()
        self._sam_pending = []
        self._sam_model, self._sam_items = model, items
        # The Trainer's loss is already its share of the step: a method's term is scaled so.
        passes = PassRunner(
            micro_batches, self._sam_loss, trainer.accelerator.backward,
            needs_per_sample=engine.needs_per_sample, term_scale=1.0 / len(micro_batches),
        )  # fmt: skip
        self._sam_passes = passes
        scaler = getattr(trainer.accelerator, "scaler", None)
        ddp = _ddp(model)
        averager, first = self._sam_averager(ddp, unwrapped) if ddp is not None else (None, False)
        try:
            return run_step(
                engine, passes, functools.partial(model.zero_grad, set_to_none=True),
                functools.partial(self._sam_optimizer_step, scaler=scaler), self.optimizer,
                scaler=scaler, averager=averager, check_draw=first,
                after_update=self._sam_after_update,
                no_sync=ddp.no_sync() if ddp is not None else None,
            )  # fmt: skip
        finally:
            self._sam_model = self._sam_items = self._sam_passes = None

    def _sam_engine_on(self, unwrapped: Any) -> SAMEngine:
        """The engine over ``unwrapped``'s parameters, rebuilt with its state when the
        Trainer replaced them (FSDP2 shards after the mixin is built)."""
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
        """One micro-batch's loss from the Trainer's own ``training_step`` (backward taken over),
        per-sample losses if needed; a later pass's :attr:`sam_first_pass_attributes` undone."""
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
        """The Trainer's ``compute_loss``, also recording what the method reads: per-sample
        losses (:meth:`per_sample_loss`), logits."""
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
        """The Trainer's ``prediction_step``, without the batch's ``index`` column."""
        inputs = _without_index(inputs)[0]
        return super().prediction_step(model, inputs, *args, **kwargs)  # type: ignore[misc]

    def _set_signature_columns_if_needed(self) -> None:
        # Keeps the `index` column SAF reads (taken out before the model sees the batch).
        super()._set_signature_columns_if_needed()  # type: ignore[misc]
        columns = self._signature_columns  # type: ignore[has-type]
        if "index" not in columns:
            columns.append("index")

    def per_sample_loss(self, outputs: Any, inputs: Any) -> Tensor:
        """Each sample's loss (ESAM's choice): cross-entropy of a classification head, the
        mean next-token loss of a causal LM (``-100`` ignored). Override for other heads."""
        if "labels" not in inputs:  # a trainer computing its own loss from other keys
            raise ValueError(
                "ESAM's data selection needs each sample's loss, taken from `labels`, which this"
                f" batch lacks (keys: {', '.join(map(str, inputs))}). Override"
                " `per_sample_loss(outputs, inputs)`, or pass"
                " `sam=method_spec('esam', data_ratio=1.0)`."
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

    def _sam_optimizer_step(self, skip: bool, scaler: Any) -> None:
        """A skipped step makes a gradient scaler back off (the Trainer steps after
        ``training_step``, and every gradient is ``None``)."""
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

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, with the last step's ``slsam/*`` metrics beside each loss."""
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
        """The Trainer's load of the optimizer's state; under FSDP2, tensors never drawn
        (with no optimizer state) are set aside while torch's strict loader runs."""
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
                f"{checkpoint} holds no {STATE_FILE} (saved without SAMTrainer?): the method's"
                " selection and counters start afresh."
            )
            return
        state = torch.load(file, map_location="cpu", weights_only=False)
        apply_method_state(
            state, self.sam_engine, owner=type(self).__name__, spec=self.sam_spec, warn=warn
        )


class SAMTrainer(SAMTrainerMixin, Trainer):
    """A ``transformers.Trainer`` that trains with a SAM method of the registry:
    ``SAMTrainer(model=..., args=..., train_dataset=..., sam="slsam")``; see
    :class:`SAMTrainerMixin` for ``sam`` and docs/huggingface.md."""


class _SAMCallback(TrainerCallback):
    """Moves the engine to the prepared model and warns of too short a run at train begin,
    saves the method's state in every checkpoint, and writes the per-layer record at the end."""

    def __init__(self, trainer: SAMTrainerMixin) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The model is prepared (FSDP2 sharded it): let go of the unsharded parameters now.
        trainer: Any = self.trainer
        engine = trainer._sam_engine_on(trainer.accelerator.unwrap_model(trainer.model))
        engine.planned_steps = state.max_steps if state.max_steps > 0 else math.inf
        if state.is_world_process_zero and state.max_steps > 0:
            steps = state.max_steps - state.global_step
            message = self.trainer.sam_spec.coverage_warning(self.trainer.sam_engine, steps)
            if message is not None:
                warn(message)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
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
    """Refuse, before anything trains, what the method's step cannot run inside."""
    check_parallelism(
        "SAMTrainer", deepspeed=getattr(trainer, "is_deepspeed_enabled", False),
        fsdp1=_fsdp_version(trainer) == 1,
        fix=f"FSDP2 shards each parameter on its own: use {_FSDP2}.", docs="docs/huggingface.md",
    )  # fmt: skip
    args = trainer.args
    problem = fix = None
    if int(args.n_gpu) > 1:
        problem = f"DataParallel over {args.n_gpu} GPUs in one process"
        fix = f"Run one process per GPU: {_FSDP2}."
    elif str(getattr(args.optim, "value", args.optim)) in _FUSED_OPTIMIZERS:
        optim = str(getattr(args.optim, "value", args.optim))
        problem = f"optim={optim!r}: it updates the weights inside the backward pass"
        fix = "Use a torch optimizer (the default AdamW, or any other torch.optim optimizer)."
    if problem is not None:
        raise ValueError(f"SAMTrainer does not support {problem}. {fix} See docs/huggingface.md.")


def _fsdp_version(trainer: Any) -> int | None:
    """The FSDP version the Trainer runs (``None``: no FSDP): accelerate's plugin's, else the
    arguments' (1 unless ``fsdp_version`` says 2)."""
    if getattr(trainer, "is_fsdp_enabled", False):
        plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
        return int(getattr(plugin, "fsdp_version", 1) or 1)
    if not trainer.args.fsdp:
        return None
    # The plugin's arguments as the Trainer built them, else the configuration (newer
    # Trainers drop the ``fsdp_`` prefixes).
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
    """Warn when a TRL trainer has none of :attr:`~SAMTrainerMixin.sam_first_pass_attributes`
    (a release that renamed them)."""
    names = trainer.sam_first_pass_attributes
    from_trl = any(c.__module__.split(".")[0] == "trl" for c in type(trainer).__mro__)
    if from_trl and not any(hasattr(trainer, name) for name in names):
        warn(
            f"{type(trainer).__name__} has none of the attributes {names}: its metrics"
            " (num_tokens, ...) may count each micro-batch once per SAM pass. Set"
            " `sam_first_pass_attributes` to the attributes its compute_loss updates."
        )


def _info(message: str) -> None:
    from transformers.utils import logging

    logging.get_logger("lightning_slsam.hf").warning(message)


def _without_index(inputs: Any) -> tuple[Any, Tensor | None]:
    """The batch without its ``index`` column (SAF's sample positions), and that column."""
    if isinstance(inputs, Mapping) and "index" in inputs:
        return {k: v for k, v in inputs.items() if k != "index"}, inputs["index"]
    return inputs, None
