"""Configs saved by earlier versions (LightningCLI writes every option into a run's
``config.yaml``) keep training what they trained, or are refused naming the option.

``tests/fixtures/saved_configs.pt`` holds, for each distinct SAM callback entry of the
committed configs, what the code that saved it trained on a small MLP
(``tests/fixtures/make_saved_config_runs.py``, made with commit f94ff83 on another
machine). Today's command upgrades each entry; the upgraded entry must draw the same layers
(the counts exactly) and train to the same weights up to the rounding of this machine's
kernels (tests/tolerance.py).
"""

from __future__ import annotations

import glob
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from helpers import loader, make_data, make_mlp
from tolerance import STORED_PROBS, assert_matches_stored, load_stored, plain, stored_run_tolerance

from lightning_slsam.cli.command import main
from lightning_slsam.cli.saved_configs import UnsupportedConfig, upgrade_configs, upgrade_entry

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))

from make_saved_config_runs import FIXTURE, key, normalized, train  # noqa: E402

pytestmark = pytest.mark.kernels  # stored references: run again under other kernels

RUNS = load_stored(FIXTURE, weights_only=False)


def _refused_option(entry: dict) -> str | None:
    """The option whose refusal an entry today's options cannot express gets (a dense
    warm-up, a floor on updates, dense one-pass steps, Random-SL-SAM's update cap of
    1/layer_ratio or 2), else ``None``."""
    args = entry["init_args"]
    for option in ("dense_warmup", "min_updates"):
        if args.get(option) not in (None, 0):
            return option
    if args.get("dense_one_pass") and args.get("schedule") in ("random", "interval"):
        return "dense_one_pass"
    random = entry["class_path"].endswith("RandomSLSAM") and args.get("scale_updates")
    if random and (args.get("max_update_scale") != 3.0 or not args.get("head_always_active")):
        return "max_update_scale"
    return None


def test_the_fixture_covers_every_committed_result_config():
    paths = glob.glob(str(ROOT / "docs/results/**/config.yaml"), recursive=True)
    assert len(paths) > 300
    earlier = 0
    for path in paths:
        callbacks = yaml.safe_load(Path(path).read_text())["trainer"]["callbacks"]
        for entry in callbacks:
            if entry["class_path"].startswith("lightning_slsam.") and not entry[
                "class_path"
            ].endswith(("RunRecorder", "BookRetention")):  # not SAM callbacks
                try:
                    changes = upgrade_entry(entry)[1]
                except UnsupportedConfig:
                    changes = ["refused"]
                if not changes:
                    continue  # saved by today's code: nothing to upgrade
                earlier += 1
                assert key(normalized(entry)) in RUNS, path
    assert earlier > 300


@pytest.mark.parametrize("name", sorted(RUNS), ids=lambda k: RUNS[k]["file"])
def test_a_saved_entry_trains_what_it_trained_or_is_refused(name):
    run = RUNS[name]
    refused = _refused_option(run["entry"])
    if refused is not None:
        with pytest.raises(UnsupportedConfig, match=f"\\({refused}="):
            upgrade_entry(run["entry"])
        return
    upgraded, _ = upgrade_entry(run["entry"])
    got = train(upgraded)
    assert torch.equal(got["counts"], run["counts"]), run["file"]  # the same draws, exactly
    # Weights within 1e-5 + 1e-4 * |w| (LookSAM: 1e-4 + 1e-3 * |w|), probabilities within
    # 1e-7: the rounding of another machine's kernels (measured in tests/tolerance.py).
    tolerance = stored_run_tolerance(upgraded["class_path"])
    assert_matches_stored(got["weights"], run["weights"], **tolerance, what=run["file"])
    assert_matches_stored(got["probs"], run["probs"], **STORED_PROBS, what=run["file"])
    # The comparison can fail: the run moved its weights 10 times farther than the tolerance.
    start = dict(make_mlp(seed=0).named_parameters())
    moved = max(float((plain(w) - start[n.removeprefix("net.")]).abs().max())
                for n, w in run["weights"].items())  # fmt: skip
    assert moved > 10 * tolerance["atol"], run["file"]


def test_most_saved_entries_train_today():
    refused = [k for k, run in RUNS.items() if _refused_option(run["entry"]) is not None]
    assert len(RUNS) == 50 and len(refused) == 10


def test_the_upgrade_names_what_changed():
    entry = {"class_path": "lightning_slsam.SparseLayerSAM", "init_args": {
        "rho": None, "preset": "paper", "bandit_loss": "rank", "head_always_active": True,
        "scale_updates": True, "max_update_scale": None, "layer_ratio": 0.2,
        "dense_warmup": None, "schedule": None, "sam_probability": 0.5}}  # fmt: skip
    new, notes = upgrade_entry(entry)
    assert new["class_path"] == "lightning_slsam.lightning.callbacks.SLSAMAblation"
    assert new["init_args"] == {
        "rho": 0.01, "preset": "paper", "layer_ratio": 0.2, "bandit_loss": "rank",
        "alpha_p": 0.03, "head_always_active": True, "max_update_scale": 5.0,
    }  # fmt: skip
    assert notes[0] == "class SparseLayerSAM -> SLSAMAblation"
    assert "dense_warmup=None" in notes and "rho: None -> 0.01" in notes
    today = {"class_path": "lightning_slsam.SparseLayerSAM", "init_args": {"rho": 0.05}}
    assert upgrade_entry(today) == (today, [])  # a config of today is left as it is


class TinyData(L.LightningDataModule):
    def train_dataloader(self):
        return loader(make_data(64), 16)


def _config(tmp_path: Path, init_args: dict) -> str:
    config = {
        "seed_everything": 0,
        "trainer": {
            "max_steps": 2, "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False, "default_root_dir": str(tmp_path),
            "callbacks": [{"class_path": "lightning_slsam.SparseLayerSAM",
                           "init_args": {**init_args, "plot": False}}],
        },
        "model": {"class_path": "helpers.LitModel",
                  "init_args": {"net": {"class_path": "torch.nn.Linear",
                                        "init_args": {"in_features": 8, "out_features": 3}}}},
        "data": {"class_path": f"{__name__}.TinyData"},
    }  # fmt: skip
    path = tmp_path / "saved.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_the_command_trains_an_upgraded_config_and_says_so(tmp_path, capsys):
    saved = {"preset": "paper", "schedule": "random", "sam_probability": 0.25,
             "dense_warmup": None, "bandit_loss": None}  # fmt: skip
    path = _config(tmp_path, saved)
    args = upgrade_configs(["fit", "--config", path])
    upgraded = yaml.safe_load(Path(args[2]).read_text())["trainer"]["callbacks"][0]
    assert upgraded["class_path"] == "lightning_slsam.SLSAMRST"
    assert upgraded["init_args"]["probability"] == 0.25
    err = capsys.readouterr().err
    assert "was saved by an earlier version" in err and "SparseLayerSAM -> SLSAMRST" in err
    main(["fit", "--config", path])
    out = capsys.readouterr().out
    assert "Run summary (SLSAMRST, 2 steps)" in out


def test_the_command_refuses_a_config_today_cannot_train(tmp_path, capsys):
    path = _config(tmp_path, {"preset": "paper", "dense_warmup": 0.3})
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", path])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "SparseLayerSAM(dense_warmup=0.3) was saved by an earlier version" in err
    assert "install the version that saved it" in err
