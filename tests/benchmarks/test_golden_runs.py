"""The golden-runs script's ``compare`` (benchmarks/golden_runs.py) on small hand-made
recordings: equal runs pass, a differing tensor or a missing run fails and is named. (The
matrix itself is not run here: ``record`` trains for minutes.)"""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import golden_runs  # noqa: E402


def _recording(path, runs: dict, skipped: dict | None = None) -> str:
    data = {"format": golden_runs.FORMAT, "meta": {"commit": "test"}, "runs": runs,
            "skipped": skipped or {}}  # fmt: skip
    torch.save(data, path)
    return str(path)


def _runs() -> dict:
    return {
        "plain/sam": {"model/0.weight": torch.arange(6.0).reshape(2, 3),
                      "calls/loss": torch.tensor([1.0, float("nan")])},
        "lightning/slsam": {"steps/0/active_mask": torch.tensor([True, False])},
    }  # fmt: skip


def test_equal_recordings_pass(tmp_path, capsys):
    a = _recording(tmp_path / "a.pt", _runs())
    b = _recording(tmp_path / "b.pt", _runs())
    assert golden_runs.main(["compare", a, b]) == 0
    out = capsys.readouterr().out
    assert "equal    plain/sam" in out and "equal    lightning/slsam" in out  # NaN == NaN
    # The script knows examples/methods.py's methods while it runs, and leaves the
    # package's registry as it found it.
    from lightning_slsam import METHODS

    assert "slsam_ablation" not in METHODS and "slsam_saf" not in METHODS


def test_a_differing_tensor_fails_and_names_the_run(tmp_path, capsys):
    changed = _runs()
    changed["plain/sam"]["model/0.weight"][1, 2] += 0.25
    a = _recording(tmp_path / "a.pt", _runs())
    b = _recording(tmp_path / "b.pt", changed)
    assert golden_runs.main(["compare", a, b]) == 1
    out = capsys.readouterr().out
    assert "DIFFERS  plain/sam" in out and "model/0.weight (max abs diff 0.25)" in out
    assert "equal    lightning/slsam" in out


def test_a_missing_run_fails(tmp_path, capsys):
    fewer = _runs()
    del fewer["lightning/slsam"]
    a = _recording(tmp_path / "a.pt", _runs())
    b = _recording(tmp_path / "b.pt", fewer, {"lightning/slsam": "front-end unavailable"})
    assert golden_runs.main(["compare", a, b]) == 1
    out = capsys.readouterr().out
    assert "MISSING  lightning/slsam: only in A (B: front-end unavailable)" in out
