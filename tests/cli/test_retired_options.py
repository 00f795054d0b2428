"""Configs saved by earlier versions (LightningCLI writes every option into a run's
``config.yaml``) keep loading: the committed results' configs, one of each shape."""

from __future__ import annotations

import collections
import glob
from pathlib import Path

import pytest
import yaml

from lightning_slsam.cli.command import main
from lightning_slsam.cli.retired_options import RETIRED, drop_retired_options

ROOT = Path(__file__).resolve().parents[2]


def _load(path: str) -> dict:
    return yaml.safe_load(Path(path).read_text())


def _one_config_per_shape() -> list[str]:
    shapes: dict = collections.OrderedDict()
    for path in sorted(glob.glob(str(ROOT / "docs/results/**/config.yaml"), recursive=True)):
        callbacks = (_load(path).get("trainer") or {}).get("callbacks") or []
        shape = tuple(
            (c.get("class_path"), tuple(sorted(c.get("init_args") or {})))
            for c in callbacks
            if isinstance(c, dict)
        )
        shapes.setdefault(shape, path)
    return list(shapes.values())


SAVED = _one_config_per_shape()


def test_the_committed_results_hold_configs_of_every_shape():
    classes = {c["class_path"] for path in SAVED for c in _load(path)["trainer"]["callbacks"]}
    assert {"lightning_slsam.SAM", "lightning_slsam.RandomSLSAM", "lightning_slsam.SparseLayerSAM",
            "lightning_slsam.compare.RunRecorder"} <= classes  # fmt: skip


@pytest.mark.parametrize("path", SAVED, ids=lambda p: str(Path(p).relative_to(ROOT / "docs")))
def test_a_config_saved_by_an_earlier_version_parses(path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", path, "--print_config"])
    assert done.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    saved = _load(path)["trainer"]["callbacks"]
    assert [c["class_path"] for c in printed["trainer"]["callbacks"]] == [
        c["class_path"] for c in saved
    ]
    for old, new in zip(saved, printed["trainer"]["callbacks"]):
        # Every option kept its value; only the retired no-op ones are gone.
        for key, value in old.get("init_args", {}).items():
            if key in new.get("init_args", {}):
                assert new["init_args"][key] == value, (old["class_path"], key)
            else:
                assert key in RETIRED and value == RETIRED[key], (old["class_path"], key)


def test_a_retired_option_with_an_effect_is_still_an_error(tmp_path, capsys):
    config = {"trainer": {"callbacks": [{"class_path": "lightning_slsam.SAM",
              "init_args": {"schedule": None, "sam_probability": 0.3}}]}}  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    args = drop_retired_options(["fit", "--config", str(path)])
    cleaned = _load(args[2])["trainer"]["callbacks"][0]["init_args"]
    assert cleaned == {"sam_probability": 0.3}  # the no-op schedule=None went, 0.3 stays
    assert "dropped SAM.schedule" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(path)])
    assert done.value.code == 2
    assert "SAM has no option 'sam_probability'" in capsys.readouterr().err


def test_sparse_layer_sam_keeps_its_schedule_options(tmp_path):
    config = {"trainer": {"callbacks": [{"class_path": "lightning_slsam.SparseLayerSAM",
              "init_args": dict(RETIRED)}]}}  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert drop_retired_options(["fit", "--config", str(path)]) == ["fit", "--config", str(path)]
