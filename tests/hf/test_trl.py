"""TRL's trainers with a SAM method (``class SFT(SAMTrainerMixin, SFTTrainer)``): SFT trains,
steps its optimizer once per step, counts each token and each metric once (TRL records them
in every ``compute_loss`` call, which SAM makes once per pass), resumes bit for bit, runs
ESAM; DPO counts its metrics once too. A tiny Llama on glassllm's tokenizer, offline."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from hf_helpers import (
    classification_data,
    sentences,
    tiny_causal_lm,
    tiny_classifier,
    training_args,
)
from transformers import Trainer, TrainerCallback

from lightning_slsam.hf import STATE_FILE, SAMTrainerMixin
from lightning_slsam.methods.registry import method_spec

pytest.importorskip("trl")
pytest.importorskip("glassllm")
datasets = pytest.importorskip("datasets")

from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

VOCAB = 1024  # glassllm's tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    from examples.tasks.causal_lm import load_glassllm

    return load_glassllm("en", pretrained=False)[1]


class Recording:
    """Keeps each optimizer step's micro-batches, the pass of every loss computed
    (``sam_pass``), and counts the optimizer's updates."""

    def get_batch_samples(self, epoch_iterator, num_batches, *args, **kwargs):
        batches, items = super().get_batch_samples(epoch_iterator, num_batches, *args, **kwargs)
        self.steps_seen = [*getattr(self, "steps_seen", []), [dict(b) for b in batches]]
        return batches, items

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        passes = getattr(self, "passes_seen", [])
        self.passes_seen = [*passes, (getattr(self, "sam_pass", None), len(inputs["input_ids"]))]
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def create_optimizer(self, *args, **kwargs):
        optimizer = super().create_optimizer(*args, **kwargs)
        self.updates = 0
        optimizer.register_step_post_hook(lambda *a: setattr(self, "updates", self.updates + 1))
        return optimizer


class SFT(Recording, SAMTrainerMixin, SFTTrainer):
    pass


class PlainSFT(Recording, SFTTrainer):
    pass


class Masks(TrainerCallback):
    """Each step's active layers."""

    def __init__(self) -> None:
        self.trainer, self.seen = None, []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(self.trainer.sam_engine.last_result.active_mask.clone())


def sft(tmp_path, tokenizer, sam="slsam", cls=SFT, seed=0, resume=None, **overrides):
    values = dict(max_steps=6, per_device_train_batch_size=8, learning_rate=5e-3)
    args = SFTConfig(**{**training_args(tmp_path).to_dict(), **values, **overrides})
    masks = Masks()
    trainer = cls(
        model=tiny_causal_lm(seed, vocab_size=VOCAB), args=args, processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_dict({"text": sentences()}),
        **({} if cls is PlainSFT else {"sam": sam, "callbacks": [masks]}),
    )  # fmt: skip
    masks.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    return trainer, masks.seen


def logged(trainer, key):
    return [e[key] for e in trainer.state.log_history if "loss" in e]


def tokens_seen(trainer):
    """The tokens of the micro-batches the trainer fetched, summed step by step (a packed
    micro-batch is one row of tokens, without padding or attention mask)."""

    def tokens(batch):
        mask = batch.get("attention_mask")
        return int(mask.sum()) if mask is not None else batch["input_ids"].numel()

    counts = [sum(tokens(b) for b in step) for step in trainer.steps_seen]
    return [float(sum(counts[: i + 1])) for i in range(len(counts))]


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("packing", [False, True])
def test_sft_counts_each_token_and_metric_once_per_micro_batch(tmp_path, tokenizer, packing):
    # SAM computes each micro-batch's loss twice (current, then perturbed weights); TRL's
    # metrics come from the first pass only, so the first step logs what plain SFT logs.
    # Packed, a micro-batch is one row of sentences (TRL counts its tokens another way).
    kw = dict(max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
              packing=packing, max_length=32)  # fmt: skip
    plain, _ = sft(tmp_path / "plain", tokenizer, cls=PlainSFT, **kw)
    sam, _ = sft(tmp_path / "sam", tokenizer, sam="sam", **kw)
    assert [len(s) for s in sam.steps_seen] == [2] * 4
    assert logged(sam, "num_tokens") == tokens_seen(sam) == logged(plain, "num_tokens")
    assert tokens_seen(sam)[-1] > 100
    for key in ("loss", "entropy", "mean_token_accuracy"):
        assert logged(sam, key)[0] == pytest.approx(logged(plain, key)[0], abs=1e-6), key
    assert logged(sam, "loss")[1] != logged(plain, "loss")[1]  # SAM's first update differs
    # Every micro-batch's loss in both passes, the first pass's metrics kept.
    assert [p for p, _ in sam.passes_seen] == [1, 1, 2, 2] * 4


def test_sft_with_slsam_trains_the_drawn_layers_once_per_step(tmp_path, tokenizer):
    trainer, masks = sft(tmp_path, tokenizer, sam="slsam", max_steps=10)
    engine = trainer.sam_engine
    assert trainer.state.global_step == engine.num_steps == trainer.updates == 10
    assert engine.num_skipped == 0
    assert all(0 < int(m.sum()) < m.numel() for m in masks)  # a strict subset every step
    assert [int(m.sum()) for m in masks] == logged(trainer, "slsam/active_layers")
    state = trainer.optimizer.state
    for layer, group in enumerate(engine.partition.params):
        for p in group:
            assert (int(state[p]["step"]) if p in state else 0) == int(engine.counts[layer])
    losses = logged(trainer, "loss")
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    assert logged(trainer, "num_tokens") == tokens_seen(trainer)


def test_sft_resumes_from_a_checkpoint_bit_for_bit(tmp_path, tokenizer):
    kw = dict(max_steps=6, save_strategy="steps", save_steps=3)
    straight, masks = sft(tmp_path / "a", tokenizer, **kw)
    checkpoint = tmp_path / "a" / "checkpoint-3"
    assert (checkpoint / STATE_FILE).is_file()
    resumed, resumed_masks = sft(tmp_path / "b", tokenizer, seed=1, resume=str(checkpoint), **kw)
    assert [torch.equal(a, b) for a, b in zip(masks[3:], resumed_masks)] == [True] * 3
    a, b = weights(straight.model), weights(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(straight.sam_engine.counts, resumed.sam_engine.counts)
    assert resumed.sam_engine.num_steps == 6 and resumed.updates == 3


def test_esam_on_sft_ranks_the_samples_by_their_token_loss(tmp_path, tokenizer):
    # ESAM asks compute_loss for the outputs (return_outputs=True), which TRL 1.16 gives
    # with an extra forward for the logits and a FutureWarning.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*return_outputs=True.*", FutureWarning)
        trainer, _ = sft(tmp_path, tokenizer, sam="esam", max_steps=3)
    # Each step: the first pass, the forward at the perturbed weights that ranks the
    # samples, and the second pass on the half whose loss rose most.
    assert trainer.passes_seen == [(1, 8), (2, 8), (2, 4)] * 3
    assert trainer.sam_engine.num_steps == trainer.updates == 3
    assert logged(trainer, "num_tokens") == tokens_seen(trainer)


def test_dpo_counts_its_metrics_once_and_its_reference_runs_every_pass(tmp_path, tokenizer):
    rng = random.Random(0)
    prompts = [rng.choice(["the cat ", "a dog ", "my friend "]) for _ in range(32)]
    rows = [{"prompt": p, "chosen": "sat on the mat.", "rejected": "mat the on sat."}
            for p in prompts]  # fmt: skip
    forwards = {"policy": 0, "ref": 0}

    def run(cls, out, **sam):
        policy, ref = tiny_causal_lm(0, vocab_size=VOCAB), tiny_causal_lm(0, vocab_size=VOCAB)
        for name, model in (("policy", policy), ("ref", ref)):
            model.register_forward_hook(lambda *a, n=name: forwards.__setitem__(n, forwards[n] + 1))
        values = dict(max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2)
        args = DPOConfig(**{**training_args(out).to_dict(), **values})
        trainer = cls(model=policy, ref_model=ref, args=args, processing_class=tokenizer,
                      train_dataset=datasets.Dataset.from_list(rows), **sam)  # fmt: skip
        forwards.update(policy=0, ref=0)
        trainer.train()
        return trainer, dict(forwards)

    class DPO(SAMTrainerMixin, DPOTrainer):
        pass

    plain, plain_forwards = run(DPOTrainer, tmp_path / "plain")
    sam, sam_forwards = run(DPO, tmp_path / "sam", sam="sam")
    assert plain_forwards == {"policy": 4, "ref": 4}
    assert sam_forwards == {"policy": 8, "ref": 8}  # the reference's forward in each pass too
    assert logged(sam, "num_tokens") == logged(plain, "num_tokens")
    for key in ("rewards/margins", "rewards/accuracies", "logps/chosen"):
        assert logged(sam, key)[0] == pytest.approx(logged(plain, key)[0], abs=1e-6), key
    margins = logged(sam, "rewards/margins")
    assert margins[-1] > margins[0] + 0.1  # it learns the preference
    # ESAM's sample choice needs per-sample losses, which DPO's batch (no labels; chosen and
    # rejected as rows of one batch) does not give: said at the first step, before any update.
    with pytest.raises(ValueError, match=r"per_sample_loss.*data_ratio=1\.0"):
        run(DPO, tmp_path / "esam", sam="esam")


def test_a_trainers_own_per_call_state_is_kept_from_the_first_pass(tmp_path):
    # Any trainer that records something in compute_loss names it; SFT's and DPO's need no
    # code (the default names TRL's attributes).
    class Counting(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.samples = getattr(self, "samples", 0) + len(inputs["labels"])
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class Mine(SAMTrainerMixin, Counting):
        sam_first_pass_attributes = ("samples",)

    class Unnamed(SAMTrainerMixin, Counting):
        pass

    for cls, samples in ((Mine, 8 * 3), (Unnamed, 2 * 8 * 3)):
        trainer = cls(model=tiny_classifier(0), args=training_args(tmp_path, max_steps=3),
                      train_dataset=classification_data(), sam=method_spec("sam"))  # fmt: skip
        trainer.train()
        assert trainer.samples == samples, cls.__name__
        assert trainer.sam_pass == 0  # outside a step


def test_a_trl_trainer_without_the_attributes_restored_is_warned_about(tmp_path, tokenizer):
    # A TRL release that renamed them: said when the trainer is built.
    class Renamed(SAMTrainerMixin, SFTTrainer):
        sam_first_pass_attributes = ("_renamed_metrics",)

    args = SFTConfig(**training_args(tmp_path).to_dict())
    data = datasets.Dataset.from_dict({"text": sentences(8)})
    model = tiny_causal_lm(0, vocab_size=VOCAB)
    with pytest.warns(UserWarning, match=r"num_tokens.*once per SAM pass.*sam_first_pass_attr"):
        Renamed(model=model, args=args, processing_class=tokenizer, train_dataset=data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SFT(model=model, args=args, processing_class=tokenizer, train_dataset=data)
