"""The tasks' held-out splits and label noise (examples.tasks.held_out): a test split
beside validation, training labels replaced at a fixed rate by a generator of their own,
the held-out labels untouched, every value checked at construction; the recorder reads the
test metric where validation was best."""

from __future__ import annotations

import json
import os

import lightning as L
import pytest
import torch
import yaml

from examples.compare import RunRecorder
from examples.tasks.held_out import noisy_labels
from examples.tasks.text import RottenTomatoesDataModule
from examples.tasks.vision import DigitsDataModule, MLPClassifier, ViTClassifier
from lightning_slsam.cli.command import main
from lightning_slsam.demo.common import split_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_test_split_leaves_the_validation_rows_where_they_were():
    train0, val0, test0 = split_rows(1000, 3, 0.2, 0.0)
    train, val, test = split_rows(1000, 3, 0.2, 0.15)
    assert val == val0 and not test0 and len(test) == 150 and len(val) == 200
    assert set(test) <= set(train0) and sorted(train + val + test) == list(range(1000))
    assert split_rows(1000, 4, 0.2, 0.15) != (train, val, test)  # the seed moves it


def test_label_noise_replaces_its_fraction_with_a_uniform_draw_of_its_own():
    labels = torch.arange(10).repeat(500)  # 5000 labels, 10 classes
    torch.manual_seed(1)
    noisy = noisy_labels(labels, 0.4, 10, seed=0)
    torch.manual_seed(2)  # the global seed moves nothing
    assert torch.equal(noisy_labels(labels, 0.4, 10, seed=0), noisy)
    assert not torch.equal(noisy_labels(labels, 0.4, 10, seed=1), noisy)
    wrong = float((noisy != labels).float().mean())
    # 2000 labels drawn again, 9 in 10 of them land elsewhere: 0.36 (binomial sd 0.004)
    assert abs(wrong - 0.36) < 0.02
    assert torch.equal(noisy_labels(labels, 0.0, 10, seed=0), labels)
    counts = torch.bincount(noisy, minlength=10)
    assert int(counts.min()) > 400  # the draw is uniform: every class keeps its share


def test_digits_noise_reaches_the_training_labels_only():
    from sklearn.datasets import load_digits

    _, y = load_digits(return_X_y=True)
    true = torch.tensor(y)
    clean = DigitsDataModule(image_size=8, test_fraction=0.2)
    noisy = DigitsDataModule(image_size=8, test_fraction=0.2, label_noise=0.4)
    for dm in (clean, noisy):
        dm.setup("fit")
    train, val, test = split_rows(len(true), 0, 0.2, 0.2)
    assert torch.equal(clean.train_set.tensors[1], true[train])
    for dm in (clean, noisy):  # the held-out splits keep their true labels
        assert torch.equal(dm.val_set.tensors[1], true[val])
        assert torch.equal(dm.test_set.tensors[1], true[test])
    wrong = float((noisy.train_set.tensors[1] != true[train]).float().mean())
    assert 0.3 < wrong < 0.42  # 0.4 * 9/10, on 1,079 labels
    val_loader, test_loader = noisy.val_dataloader()
    assert len(test_loader.dataset) == len(test) == 359 and len(val_loader.dataset) == 359
    plain = DigitsDataModule(image_size=8)
    plain.setup("fit")
    assert isinstance(plain.val_dataloader(), torch.utils.data.DataLoader)


def test_rotten_tomatoes_noise_reaches_the_training_labels_only(tmp_path):
    rows = [(f"sentence {i} {'good' if i % 2 else 'bad'}", i % 2, "rotten_tomatoes")
            for i in range(200)]  # fmt: skip
    csv = tmp_path / "rt.csv"
    csv.write_text("text,label,source\n" + "".join(f"{t},{y},{s}\n" for t, y, s in rows))
    kw = {"csv_path": str(csv), "val_fraction": 0.2, "test_fraction": 0.2, "batch_size": 8}
    clean, noisy = RottenTomatoesDataModule(**kw), RottenTomatoesDataModule(**kw, label_noise=0.5)
    for dm in (clean, noisy):
        dm.setup("fit")
    truth = {tuple(ex["input_ids"]): ex["labels"] for ex in clean.train_dataset}
    flipped = sum(truth[tuple(ex["input_ids"])] != ex["labels"] for ex in noisy.train_dataset)
    assert 0.15 < flipped / len(noisy.train_dataset) < 0.35  # 0.5 * 1/2, on 120 labels
    for split in ("val_dataset", "test_dataset"):
        assert getattr(clean, split) == getattr(noisy, split)
    assert len(noisy.test_dataset) == 40 and len(noisy.val_dataloader()) == 2


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"label_noise": 1.0}, "`label_noise` must be in [0, 1), got 1.0"),
        ({"label_noise": -0.1}, "`label_noise` must be in [0, 1)"),
        ({"label_noise": True}, "`label_noise` must be in [0, 1)"),
        ({"test_fraction": -0.2}, "`test_fraction` must be in [0, 1)"),
        ({"test_fraction": 0.9}, "`val_fraction` + `test_fraction` must be under 1"),
    ],
)
def test_a_bad_value_is_refused_at_construction_naming_the_range(kwargs, words):
    for build in (DigitsDataModule, RottenTomatoesDataModule):
        with pytest.raises(ValueError) as err:
            build(**kwargs)
        assert words in str(err.value)


def test_the_recorder_reads_the_test_metric_where_validation_was_best(tmp_path):
    L.seed_everything(0)
    path = tmp_path / "run.json"
    recorder = RunRecorder(str(path), report="test_acc")
    dm = DigitsDataModule(batch_size=64, image_size=8, test_fraction=0.2, label_noise=0.3)
    trainer = L.Trainer(max_epochs=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[recorder])  # fmt: skip
    trainer.fit(MLPClassifier(hidden=[64]), dm)
    record = json.loads(path.read_text())
    assert len(record["values"]) == len(record["reported"]) == 4
    at = record["values"].index(record["best"])
    assert record["report_at_best"] == record["reported"][at]
    assert record["report_final"] == record["reported"][-1]
    assert 0.5 < record["report_final"] <= 1 and record["reported"] != record["values"]
    # Without a test split there is nothing to report: said at the first validation.
    missing = RunRecorder(str(tmp_path / "no.json"), report="test_acc")
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[missing])  # fmt: skip
    with pytest.raises(RuntimeError, match="give the data module a test split"):
        trainer.fit(MLPClassifier(hidden=[8]), DigitsDataModule(image_size=8))


def test_the_saved_config_records_the_noise_and_the_split(tmp_path, capsys):
    config = {
        "seed_everything": 0,
        "trainer": {
            "max_epochs": 1, "enable_progress_bar": False, "enable_checkpointing": False,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": str(tmp_path), "name": "noisy"}},
        },
        "model": {"class_path": "examples.tasks.vision.MLPClassifier",
                  "init_args": {"hidden": [16]}},
        "data": {"class_path": "examples.tasks.vision.DigitsDataModule",
                 "init_args": {"image_size": 8}},
    }  # fmt: skip
    path = tmp_path / "noisy.yaml"
    path.write_text(yaml.safe_dump(config))
    main(["fit", "--config", str(path), "--data.label_noise=0.25", "--data.test_fraction=0.2"])
    saved = yaml.safe_load((tmp_path / "noisy" / "version_0" / "config.yaml").read_text())
    assert saved["data"]["init_args"]["label_noise"] == 0.25
    assert saved["data"]["init_args"]["test_fraction"] == 0.2
    assert "test_acc" in (tmp_path / "noisy" / "version_0" / "metrics.csv").read_text()


@pytest.mark.parametrize(("name", "noise", "test"), [
    ("mlp_digits_noisy", 0.4, 0.2),
    ("efficientnet_digits_noisy", 0.4, 0.2),
    ("minilm_rotten_tomatoes_noisy", 0.6, 0.1),  # two classes: 60% redrawn, 30% wrong
    ("vit_digits_noisy", 0.4, 0.2),
])  # fmt: skip
def test_the_benefit_task_configs_parse_with_their_noise_and_test_split(name, noise, test, capsys):
    path = os.path.join(ROOT, "examples", "configs", "tasks", f"{name}.yaml")
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", path, "--print_config"])
    assert stop.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["init_args"]["label_noise"] == noise
    assert printed["data"]["init_args"]["test_fraction"] == test


def test_the_vit_is_a_transformer_from_scratch_that_learns_digits():
    L.seed_everything(0)
    vit = ViTClassifier(learning_rate=3e-3)
    blocks = vit.model.blocks
    assert len(blocks) == 4 and blocks[0].attn.num_heads == 4
    assert vit.model.patch_embed.num_patches == 16  # 16 px in 4x4 patches
    assert 0.13e6 < sum(p.numel() for p in vit.parameters()) < 0.15e6
    dm = DigitsDataModule(batch_size=32, image_size=16, test_fraction=0.2)
    trainer = L.Trainer(max_epochs=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(vit, dm)
    # 0.50 here after 3 epochs, 0.69 after 10 with 40% wrong labels; chance is 0.1
    assert float(trainer.callback_metrics["val_acc"]) > 0.3


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"image_size": 18}, "`image_size` (18) must be a multiple of `patch_size` (4)"),
    ({"width": 66}, "`width` (66) must be a multiple of `heads` (4)"),
    ({"depth": 0}, "depth"),
    ({"image_size": 2}, "image_size"),
])  # fmt: skip
def test_a_bad_vit_shape_is_refused_naming_the_parameter(kwargs, words):
    with pytest.raises(ValueError) as err:
        ViTClassifier(**kwargs)
    assert words in str(err.value)


def test_the_training_sets_yield_each_samples_index_and_the_steps_return_it(tmp_path):
    # SAF finds each sample's past logits by its position in the training set.
    digits = DigitsDataModule(image_size=8, batch_size=64)
    digits.setup("fit")
    seen = torch.cat([batch[2] for batch in digits.train_dataloader()])
    assert sorted(seen.tolist()) == list(range(len(digits.train_set)))  # each once an epoch
    images, labels, index = next(iter(digits.train_dataloader()))
    assert torch.equal(digits.train_set.tensors[1][index], labels)
    out = MLPClassifier(in_features=192, hidden=[16]).training_step((images, labels, index), 0)
    assert out["logits"].shape == (64, 10) and torch.equal(out["index"], index)
    assert out["loss"].shape == (64,)  # per-sample losses, for ESAM
    rows = [(f"sentence {i}", i % 2, "rotten_tomatoes") for i in range(60)]
    csv = tmp_path / "rt.csv"
    csv.write_text("text,label,source\n" + "".join(f"{t},{y},{s}\n" for t, y, s in rows))
    text = RottenTomatoesDataModule(csv_path=str(csv), val_fraction=0.2, batch_size=8)
    text.setup("fit")
    batches = list(text.train_dataloader())
    assert sorted(torch.cat([b["index"] for b in batches]).tolist()) == list(range(48))
    assert all("index" not in b for b in text.val_dataloader())  # the training set's only


def test_label_smoothing_smooths_the_training_loss_and_is_checked():
    # The control for a method that penalises confident predictions (SAF, MESA): AdamW with
    # the training labels smoothed; 0 is the plain loss.
    import torch.nn.functional as F

    torch.manual_seed(0)
    images, labels = torch.rand(6, 3, 8, 8), torch.randint(0, 10, (6,))
    plain = MLPClassifier(hidden=[8])
    smooth = MLPClassifier(hidden=[8], label_smoothing=0.3)
    smooth.load_state_dict(plain.state_dict())
    logits = plain(images)
    batch = (images, labels, torch.arange(6))
    assert torch.equal(plain.training_step(batch, 0)["loss"],
                       F.cross_entropy(logits, labels, reduction="none"))  # fmt: skip
    expected = F.cross_entropy(logits, labels, reduction="none", label_smoothing=0.3)
    torch.testing.assert_close(smooth.training_step(batch, 0)["loss"], expected, rtol=0, atol=0)
    for bad in (1.0, -0.1, "0.1"):
        with pytest.raises(ValueError, match="`label_smoothing` must be a number in"):
            ViTClassifier(label_smoothing=bad)
