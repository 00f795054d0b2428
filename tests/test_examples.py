"""The examples run, and their configs say what their names say."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest
import yaml

from lightning_slsam import METHODS, SAMCallback
from lightning_slsam.cli.command import SLSAMCLI, main

EXAMPLES = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir, "examples"))


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


CONFIGS = os.path.join(EXAMPLES, "configs")
TASK = os.path.join(CONFIGS, "tasks", "minilm_rotten_tomatoes.yaml")
METHOD_NAMES = sorted(METHODS)


def test_every_method_has_a_config():
    files = {f[: -len(".yaml")] for f in os.listdir(os.path.join(CONFIGS, "methods"))}
    assert files == set(METHOD_NAMES)


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_method_config_instantiates_its_callback(method, tmp_path):
    args = [
        "--config", TASK, "--config", os.path.join(CONFIGS, "methods", f"{method}.yaml"),
        "--model.init_args.pretrained=false", f"--trainer.default_root_dir={tmp_path}",
    ]  # fmt: skip
    cli = SLSAMCLI(
        model_class=None, datamodule_class=None, subclass_mode_model=True,
        subclass_mode_data=True, run=False, args=args,
    )  # fmt: skip
    found = [cb for cb in cli.trainer.callbacks if isinstance(cb, SAMCallback)]
    cls, preset = METHODS[method]
    if cls is None:
        assert found == []
        return
    (cb,) = found
    # each config states its method's default radius (Momentum-SAM's is a distance along
    # the momentum: 1.0, its authors' AdamW default)
    assert type(cb) is cls and cb.rho == {"momentum_sam": 1.0, "arwp": 0.001}.get(method, 0.01)
    # The options the name implies (slsam_paper's preset; the schedules are classes now).
    for option, value in preset.items():
        assert getattr(cb, option) == value, option
    assert cli.trainer.logger.name == method


def test_esam_config_trains_the_demo_task_through_the_cli(tmp_path, capsys):
    main(
        [
            "fit", "--config", TASK, "--config", os.path.join(CONFIGS, "methods", "esam.yaml"),
            "--model.init_args.pretrained=false", "--data.init_args.num_train=64",
            "--data.init_args.num_val=32", "--trainer.max_steps=3",
            "--trainer.limit_val_batches=1", f"--trainer.logger.init_args.save_dir={tmp_path}",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "ESAM mean active ratio" in out
    ratio = float(out.split("ESAM mean active ratio: ")[1].split("x")[0])
    assert 1.0 < ratio < 2.0  # half the layers in the first pass, all in the second


def test_the_fabric_example_trains_saves_and_resumes(tmp_path):
    fabric_text = _load("fabric_text")
    common = ["--num-train", "64", "--num-val", "32", "--batch-size", "8", "--out", str(tmp_path)]
    first = fabric_text.main(["--steps", "3", *common])
    assert first["steps"] == 3 and 0 < first["mean_active_ratio"] < 2.0
    import torch

    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["step"] == 3 and saved["sam"]["engine"]["num_steps"] == 3
    resumed = fabric_text.main(["--steps", "5", "--resume", str(tmp_path / "last.ckpt"), *common])
    assert resumed["steps"] == 5
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["sam"]["engine"]["num_steps"] == 5


#: The label-noise task configs and their task in docs/results/benefit/share.json.
NOISY_TASKS = {
    "mlp_noisy": "mlp_digits_noisy.yaml",
    "effnet_noisy": "efficientnet_digits_noisy.yaml",
    "vit_noisy": "vit_digits_noisy.yaml",
    "minilm_noisy": "minilm_rotten_tomatoes_noisy.yaml",
}
SHARE = os.path.join(os.path.dirname(EXAMPLES), "docs", "results", "benefit", "share.json")


def _sampler_radius(task: dict) -> float:
    """SparseLayerSAM()'s radius chosen on validation among those run at AdamW's rate."""
    rows = [
        r
        for name, r in task["rows"].items()
        if name.split(" (")[0] == "slsam" and r["lr"] == task["lr"] and r["rho"] > 1e-6
    ]
    return max(rows, key=lambda r: r["val"][0])["rho"]


@pytest.mark.parametrize("task", sorted(NOISY_TASKS))
def test_each_noisy_task_config_trains_and_advises_what_its_table_chose(task):
    # The configs once trained AdamW at 1e-3, where the table chose 3e-5 on validation, and
    # said nothing of the radii; a re-measured table must not leave its config behind.
    with open(SHARE) as handle:
        chosen = json.load(handle)[task]
    path = os.path.join(CONFIGS, "tasks", NOISY_TASKS[task])
    with open(path) as handle:
        text = handle.read()
    assert yaml.safe_load(text)["model"]["init_args"]["learning_rate"] == chosen["lr"]
    comment = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    said = re.search(
        rf"task {task}\): AdamW's learning_rate (\S+) \(below\); SAM rho (\S+); SparseLayerSAM"
        r" rho (\d+(?:\.\d+)?(?:e-?\d+)?)", comment
    )  # fmt: skip
    assert said is not None, comment
    assert [float(v) for v in said.groups()] == [
        chosen["lr"], chosen["rho"], _sampler_radius(chosen)
    ]  # fmt: skip
    assert f"--trainer.callbacks.init_args.rho={chosen['rho']:g}" in comment


def test_the_quickstart_and_the_readme_use_the_default_radius():
    from lightning_slsam import SparseLayerSAM

    root = os.path.dirname(EXAMPLES)
    pages = ["README.md", "docs/quickstart.md", "examples/quickstart.py"]
    for page in pages:
        with open(os.path.join(root, page)) as handle:
            radii = re.findall(r"SparseLayerSAM\(rho=([\d.]+)", handle.read())
        assert radii and {float(r) for r in radii} == {SparseLayerSAM().rho}, (page, radii)
