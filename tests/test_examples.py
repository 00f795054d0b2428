"""The examples run, and their configs say what their names say."""

from __future__ import annotations

import importlib.util
import os

import pytest
import yaml

from lightning_slsam.cli import main

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_trains_with_and_without_sl_sam(tmp_path):
    quickstart = _load("quickstart")
    slsam = quickstart.main(["--max-epochs", "3", "--root", str(tmp_path / "a")])
    adamw = quickstart.main(["--adamw", "--max-epochs", "3", "--root", str(tmp_path / "b")])
    assert slsam["val_acc"] > 0.6 and adamw["val_acc"] > 0.6  # chance is 0.1
    assert 0 < slsam["mean_active_ratio"] < 2.0
    assert "mean_active_ratio" not in adamw


@pytest.mark.parametrize(
    ("config", "callbacks"),
    [("minilm_rotten_tomatoes_sam.yaml", [1.0]), ("minilm_rotten_tomatoes_adamw.yaml", [])],
)
def test_example_configs_parse(config, callbacks, capsys):
    path = os.path.join(EXAMPLES, "configs", config)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", path, "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    sam = [
        cb["init_args"]["layer_ratio"]
        for cb in printed["trainer"]["callbacks"] or []
        if cb["class_path"].endswith("SparseLayerSAM")
    ]
    assert sam == callbacks
    assert printed["model"]["class_path"] == "lightning_slsam.tasks.text.TextClassifier"
