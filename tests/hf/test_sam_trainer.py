"""The Hugging Face Trainer front-end (lightning_slsam.hf): SAMTrainer gives the same
numbers as a hand-written SAM loop and as the Lightning path, steps its optimizer once per
step, keeps accumulation, clipping, bf16, checkpoints, logging and DDP, trains only LoRA's
tensors, and refuses what it cannot run when it is built."""

from __future__ import annotations

import csv
import math
import os
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from hf_helpers import (
    classification_data,
    decay_groups,
    lm_data,
    tiny_causal_lm,
    tiny_classifier,
    training_args,
)
from transformers import Trainer, TrainerCallback

from lightning_slsam.hf import STATE_FILE, SAMTrainer, SAMTrainerMixin
from lightning_slsam.hf.trainer import _check_supported
from lightning_slsam.methods.registry import method_spec

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Recorder(TrainerCallback):
    """Each optimizer step's active layers (after the step)."""

    def __init__(self) -> None:
        self.trainer = None
        self.masks: list[torch.Tensor] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.masks.append(self.trainer.sam_engine.last_result.active_mask.clone())


class RecordingTrainer(SAMTrainer):
    """Keeps each optimizer step's micro-batches, to replay them elsewhere."""

    def get_batch_samples(self, epoch_iterator, num_batches, *args, **kwargs):
        batches, items = super().get_batch_samples(epoch_iterator, num_batches, *args, **kwargs)
        self.steps_seen = [*getattr(self, "steps_seen", []), [dict(b) for b in batches]]
        return batches, items


def run(tmp_path, sam="slsam", model=None, data=None, cls=RecordingTrainer, **overrides):
    recorder = Recorder()
    trainer = cls(
        model=model if model is not None else tiny_classifier(0),
        args=training_args(tmp_path, **overrides),
        train_dataset=data if data is not None else classification_data(),
        sam=sam, callbacks=[recorder],
    )  # fmt: skip
    recorder.trainer = trainer
    trainer.train()
    return trainer, recorder.masks


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def close(a, b, atol=1e-5):
    return all(torch.allclose(a[k], b[k], atol=atol, rtol=0) for k in a)


def test_sam_equals_a_hand_written_sam_and_adamw_loop_with_the_trainers_groups(tmp_path):
    clip = 0.05  # small enough to clip every step: the Trainer's clipping applies
    trainer, _ = run(tmp_path, sam="sam", max_grad_norm=clip)
    reference = tiny_classifier(0)
    decay = set(trainer.get_decay_parameter_names(reference))
    assert len(decay) < len(list(reference.parameters()))  # two real groups
    opt = torch.optim.AdamW(decay_groups(reference, decay), lr=1e-2)
    params = [p for p in reference.parameters()]
    rho = method_spec("sam").rho
    for (batch,) in trainer.steps_seen:
        reference(**batch).loss.backward()
        with torch.no_grad():
            norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
            eps = [rho * p.grad / (norm + 1e-12) for p in params]
            for p, e in zip(params, eps):
                p.add_(e)
        opt.zero_grad(set_to_none=True)
        reference(**batch).loss.backward()
        with torch.no_grad():
            for p, e in zip(params, eps):
                p.sub_(e)
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert len(trainer.steps_seen) == 4
    assert close(weights(trainer.model), weights(reference))


def test_the_optimizer_steps_once_per_step_and_only_the_active_layers(tmp_path):
    trainer, masks = run(tmp_path, sam="sam", max_steps=5)
    steps = {int(s["step"]) for s in trainer.optimizer.state.values()}
    assert steps == {5}  # one AdamW step per optimizer step, not two
    trainer, masks = run(tmp_path / "sl", sam="slsam", max_steps=6)
    engine = trainer.sam_engine
    assert all(0 < int(m.sum()) < m.numel() for m in masks)  # a strict subset every step
    state = trainer.optimizer.state
    for layer, group in enumerate(engine.partition.params):
        for p in group:
            stepped = int(state[p]["step"]) if p in state else 0
            assert stepped == int(engine.counts[layer])


def averaging_classifier():
    """BERT's classification loss ignores the token count the Trainer hands a forward that
    takes ``**kwargs``, so the Trainer would sum the micro-batches' mean losses (with or
    without SAM); a model that says so gets their average."""
    model = tiny_classifier(0)
    model.accepts_loss_kwargs = False
    return model


#: Where two runs sum the same gradients in another order (micro-batches against one batch,
#: another front-end), they step with SGD: AdamW divides each update by its gradient's root
#: mean square, so an element whose gradient is near zero turns last-bit differences into
#: weight differences of up to the learning rate (measured here under AdamW: 1.25e-5 after 4
#: steps of SAM, over the 1e-5 these tests allow). Under SGD the same runs differ by rounding.
SGD = {"optim": "sgd", "learning_rate": 0.1}


def moved(start, end):
    """How far the largest weight change went (a comparison with a tolerance far below it
    can fail)."""
    return max(float((end[k] - start[k]).abs().max()) for k in start)


@pytest.mark.kernels
@pytest.mark.parametrize("sam", ["sam", "slsam"])
def test_accumulating_2_x_8_equals_one_batch_of_16(tmp_path, sam):
    whole, whole_masks = run(tmp_path / "a", sam=sam, model=averaging_classifier(),
                             per_device_train_batch_size=16, **SGD)  # fmt: skip
    split, split_masks = run(
        tmp_path / "b", sam=sam, model=averaging_classifier(), per_device_train_batch_size=8,
        gradient_accumulation_steps=2, **SGD,
    )  # fmt: skip
    assert [len(s) for s in split.steps_seen] == [2] * 4
    assert [torch.equal(a, b) for a, b in zip(whole_masks, split_masks)] == [True] * 4
    assert close(weights(whole.model), weights(split.model), atol=1e-6)
    assert moved(weights(tiny_classifier(0)), weights(whole.model)) > 1e-3
    # The logged loss is the step's: the same under accumulation.
    losses = [[e["loss"] for e in t.state.log_history if "loss" in e] for t in (whole, split)]
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)


@pytest.mark.kernels
def test_a_causal_lm_accumulates_by_token_count_like_one_batch(tmp_path):
    # The Trainer normalises a causal LM's loss by the tokens of the whole step.
    kw = dict(sam="slsam", data=lm_data(), max_steps=3, **SGD)
    whole, _ = run(tmp_path / "a", model=tiny_causal_lm(0), per_device_train_batch_size=8, **kw)
    split, _ = run(tmp_path / "b", model=tiny_causal_lm(0), per_device_train_batch_size=4,
                   gradient_accumulation_steps=2, **kw)  # fmt: skip
    assert close(weights(whole.model), weights(split.model), atol=1e-6)
    assert moved(weights(tiny_causal_lm(0)), weights(whole.model)) > 1e-3


@pytest.mark.kernels
def test_slsam_draws_the_same_layers_as_the_lightning_path_with_the_same_seed(tmp_path):
    import lightning as L

    from lightning_slsam import SAMMixin, SparseLayerSAM

    trainer, masks = run(tmp_path, sam=method_spec("slsam", seed=7), max_steps=6, **SGD)
    decay = set(trainer.get_decay_parameter_names(trainer.model))

    class Lit(SAMMixin, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_classifier(0)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(decay_groups(self.model, decay), lr=SGD["learning_rate"])

    class Masks(L.Callback):
        def __init__(self):
            self.seen = []

        def on_train_batch_end(self, trainer, module, *args):
            self.seen.append(sam.engine.last_result.active_mask.clone())

    sam, record = SparseLayerSAM(seed=7), Masks()
    module = Lit()
    batches = [b for (b,) in trainer.steps_seen]
    lit = L.Trainer(accelerator="cpu", max_steps=6, callbacks=[sam, record], logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)  # fmt: skip
    lit.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    assert [torch.equal(a, b) for a, b in zip(masks, record.seen)] == [True] * 6
    assert close(weights(trainer.model), weights(module.model), atol=1e-6)
    assert moved(weights(tiny_classifier(0)), weights(module.model)) > 1e-3


def test_resuming_from_a_save_steps_checkpoint_is_bit_exact(tmp_path):
    straight, _ = run(tmp_path / "a", max_steps=6, save_strategy="steps", save_steps=3)
    checkpoint = tmp_path / "a" / "checkpoint-3"
    assert (checkpoint / STATE_FILE).is_file()
    resumed = RecordingTrainer(
        model=tiny_classifier(1),  # other weights: the checkpoint's are loaded
        args=training_args(tmp_path / "b", max_steps=6, save_strategy="steps", save_steps=3),
        train_dataset=classification_data(), sam="slsam",
    )  # fmt: skip
    resumed.train(resume_from_checkpoint=str(checkpoint))
    a, b = weights(straight.model), weights(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(straight.sam_engine.counts, resumed.sam_engine.counts)
    assert resumed.sam_engine.num_steps == 6
    sa, sb = straight.sam_engine.selection.state_dict(), resumed.sam_engine.selection.state_dict()
    assert sa.keys() == sb.keys()


def test_bf16_trains_and_logs_the_methods_metrics(tmp_path):
    trainer, masks = run(tmp_path, sam="slsam", bf16=True, max_steps=3)
    engine = trainer.sam_engine
    assert engine.num_steps == 3 and engine.num_skipped == 0
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 3 and all(torch.isfinite(torch.tensor(e["loss"])) for e in logs)
    for entry, mask in zip(logs, masks):
        assert entry["slsam/active_layers"] == int(mask.sum())
        assert 0 < entry["slsam/active_ratio"] < 2
    # logged to 4 decimals
    assert logs[-1]["slsam/mean_active_ratio"] == round(engine.active_ratio_sum / 3, 4)


def test_lora_trains_only_its_tensors_and_saves_with_the_adapter(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    model = get_peft_model(tiny_classifier(0), LoraConfig(
        r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS"))  # fmt: skip
    before = weights(model)
    trainer, masks = run(tmp_path, sam="slsam", model=model, max_steps=4, save_strategy="steps",
                         save_steps=4)  # fmt: skip
    engine = trainer.sam_engine
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert engine.trainable_numel == sum(p.numel() for p in model.parameters() if p.requires_grad)
    after = weights(model)
    frozen = [k for k in before if k not in trainable]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    assert any(not torch.equal(before[k], after[k]) for k in after if "lora_B" in k)
    assert all(0 < int(m.sum()) < m.numel() for m in masks)
    checkpoint = tmp_path / "checkpoint-4"
    assert (checkpoint / "adapter_model.safetensors").is_file()
    assert (checkpoint / STATE_FILE).is_file()
    loaded = PeftModel.from_pretrained(tiny_classifier(0), str(checkpoint))
    reloaded = weights(loaded)
    assert all(torch.equal(after[k], reloaded[k]) for k in after if "lora_" in k)


def test_esam_chooses_samples_from_the_heads_per_sample_losses(tmp_path):
    sizes = []

    class Sizes(RecordingTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            sizes.append(len(inputs["labels"]))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    trainer, _ = run(tmp_path, sam="esam", cls=Sizes, max_steps=3)
    # Each step: the first pass, the forward at the perturbed weights that ranks the
    # samples by their loss, and the second pass on the half whose loss rose most.
    assert sizes == [8, 8, 4] * 3
    assert trainer.sam_engine.num_steps == 3 and trainer.sam_engine.num_skipped == 0


def test_the_mixin_combines_with_another_trainer_subclass(tmp_path):
    calls = []

    class Custom(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            calls.append(len(inputs["labels"]))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class Mine(SAMTrainerMixin, Custom):
        pass

    trainer, _ = run(tmp_path, sam="sam", cls=Mine, max_steps=2)
    assert calls == [8] * 4  # the subclass's loss, in both passes of both steps
    assert int(next(iter(trainer.optimizer.state.values()))["step"]) == 2


def test_bad_input_is_refused_when_the_trainer_is_built(tmp_path):
    def build(**kw):
        return SAMTrainer(model=tiny_classifier(0), args=training_args(tmp_path),
                          train_dataset=classification_data(16), **kw)  # fmt: skip

    with pytest.raises(ValueError, match="Did you mean 'slsam'"):
        build(sam="slsamm")
    with pytest.raises(ValueError, match="plain AdamW"):
        build(sam="adamw")
    with pytest.raises(TypeError, match="method name or a MethodSpec"):
        build(sam=0.05)
    with pytest.raises(ValueError, match="layer_ratio"):
        build(sam=method_spec("slsam", layer_ratio=2.0))
    with pytest.raises(ValueError, match=r"optim='lomo'.*inside the backward"):
        SAMTrainer(model=tiny_classifier(0), args=training_args(tmp_path, optim="lomo"),
                   train_dataset=classification_data(16), sam="slsam")  # fmt: skip
    fake = SimpleNamespace(args=SimpleNamespace(n_gpu=0, fsdp="", optim="adamw_torch"),
                           is_deepspeed_enabled=True)  # fmt: skip
    with pytest.raises(ValueError, match="DeepSpeed"):
        _check_supported(fake)
    fake = SimpleNamespace(args=SimpleNamespace(n_gpu=2, fsdp="", optim="adamw_torch"))
    with pytest.raises(ValueError, match="DataParallel over 2 GPUs"):
        _check_supported(fake)

    # FSDP1 is refused naming FSDP2, the version asked for or the one accelerate set up;
    # FSDP2 passes.
    def fsdp(version, enabled):
        plugin = SimpleNamespace(fsdp_version=version)
        config = {} if version is None else {"fsdp_version": version}
        return SimpleNamespace(
            args=SimpleNamespace(n_gpu=0, fsdp="full_shard", fsdp_config=config,
                                 optim="adamw_torch"),
            is_fsdp_enabled=enabled,
            accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)),
        )  # fmt: skip

    for version, enabled in ((None, False), (1, False), (1, True)):
        with pytest.raises(ValueError, match=r"FSDP1.*'fsdp_version': 2"):
            _check_supported(fsdp(version, enabled))
    _check_supported(fsdp(2, False))
    _check_supported(fsdp(2, True))
    # The Trainer's own arguments: the version it defaults to (2 in transformers 5), or 1
    # asked for (a prefixed or a plain key).
    for config, refused in (({}, False), ({"fsdp_version": 1}, True), ({"version": 1}, True)):
        real = training_args(tmp_path, fsdp="full_shard", fsdp_config=config)
        check = SimpleNamespace(args=real, is_fsdp_enabled=False)
        if refused:
            with pytest.raises(ValueError, match=r"FSDP1.*FSDP2 shards each parameter"):
                _check_supported(check)
        else:
            _check_supported(check)
    with pytest.raises(ValueError, match=r"DeepSpeed: its ZeRO optimizer.*use FSDP2"):
        _check_supported(SimpleNamespace(args=training_args(tmp_path), is_deepspeed_enabled=True))
    # ESAM on a model whose per-sample losses SAMTrainer cannot compute.
    from transformers import BertConfig, BertForMaskedLM

    masked = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, intermediate_size=32))  # fmt: skip
    with pytest.raises(ValueError, match="per_sample_loss"):
        SAMTrainer(model=masked, args=training_args(tmp_path), train_dataset=lm_data(8),
                   sam="esam")  # fmt: skip
    # ... which esam with data_ratio=1.0 trains.
    SAMTrainer(model=masked, args=training_args(tmp_path), train_dataset=lm_data(8),
               sam=method_spec("esam", data_ratio=1.0))  # fmt: skip


def test_a_run_too_short_for_the_layer_draws_is_said_at_train_begin(tmp_path):
    # The guard rail (lightning_slsam.selection.coverage), as SparseLayerSAM says it: the
    # default's sampled layers expect 0.6 of an update per step; a resumed run counts the
    # steps left.
    from lightning_slsam.hf.trainer import _SAMCallback
    from lightning_slsam.selection.coverage import FLOOR

    trainer = SAMTrainer(model=tiny_classifier(0), args=training_args(tmp_path, max_steps=2),
                         train_dataset=classification_data(16), sam="slsam")  # fmt: skip
    [hook] = [c for c in trainer.callback_handler.callbacks if isinstance(c, _SAMCallback)]
    # Said before any other callback begins, the progress bar's first line included.
    assert trainer.callback_handler.callbacks[0] is hook
    under, at = math.floor(FLOOR / 0.6) - 1, math.ceil(FLOOR / 0.6) + 1
    for max_steps, global_step, fires in ((under, 0, True), (at, 0, False), (at + 10, 20, True)):
        state = SimpleNamespace(is_world_process_zero=True, max_steps=max_steps,
                                global_step=global_step)  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hook.on_train_begin(trainer.args, state, None)
        lines = [str(w.message) for w in caught if "full updates" in str(w.message)]
        assert len(lines) == fires, (max_steps, global_step)
    expected = r"SparseLayerSAM: each sampled layer can expect about \d+ full updates over these 2 "
    with pytest.warns(UserWarning, match=expected):
        trainer.train()


def test_the_coverage_warning_points_at_the_users_train_call(tmp_path):
    # Attributed to this file's `trainer.train()` line, not to the Trainer's callback loop.
    trainer = SAMTrainer(model=tiny_classifier(0), args=training_args(tmp_path, max_steps=2),
                         train_dataset=classification_data(16), sam="slsam")  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
        line = sys._getframe().f_lineno - 1
    [warned] = [w for w in caught if "full updates" in str(w.message)]
    assert (warned.filename, warned.lineno) == (__file__, line)


@pytest.mark.parametrize(("sam", "written"), [("slsam", True), ("sam", False), ("rst", False)])
def test_the_per_layer_record_goes_to_output_dir_where_layers_were_drawn(tmp_path, sam, written):
    trainer, masks = run(tmp_path, sam=sam, max_steps=4)
    files = sorted(f for f in os.listdir(tmp_path) if f.startswith("slsam_layer_frequency"))
    if not written:  # every layer every step: a chart of ones says nothing
        assert files == [] and trainer.sam_record is None
        return
    assert files == ["slsam_layer_frequency.csv", "slsam_layer_frequency.png"]
    assert trainer.sam_record == (str(tmp_path / files[0]), str(tmp_path / files[1]))
    with open(tmp_path / files[0]) as handle:
        rows = [r for r in csv.DictReader(handle) if r["role"] == "sampled"]
    counts = torch.stack(masks).sum(0)
    assert [int(r["activations"]) for r in rows] == counts.tolist()
