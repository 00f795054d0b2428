"""The radius sweep's reading (examples/scripts/lm_radius.py) on hand-made run records: SAM's and
MESA's forgetting is compared with AdamW's at the point's in-domain accuracy, on AdamW's
frontier (a rate that learns less and forgets more is off it), and a difference counts only
above twice its standard error."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "scripts"))
import lm_radius  # noqa: E402


def write(folder, point, method, seed, *, final, loss_rise, kl=2.0):
    here = os.path.join(folder, point, "runs", method, f"seed{seed}")
    os.makedirs(here)
    with open(os.path.join(here, "run.json"), "w") as handle:
        json.dump({"best": final, "final": final, "active_ratio": 1.0}, handle)
    # The retention monitor's first and last measurements (BookRetention's metrics).
    rows = ["step,forgetting/loss,forgetting/accuracy,forgetting/kl,forgetting/fraction",
            "0,4.0,0.13,0.0,", f"454,{4.0 + loss_rise},0.12,{kl},", "454,,,,0.02"]  # fmt: skip
    with open(os.path.join(here, "metrics.csv"), "w") as handle:
        handle.write("\n".join(rows) + "\n")


@pytest.fixture
def sweep(tmp_path):
    folder, extra = str(tmp_path / "lm_radius"), str(tmp_path / "lm_forgetting")
    jitter = (-0.01, 0.0, 0.01)
    for seed, j in zip((42, 43, 44), jitter):
        # AdamW's frontier: 1e-3 learns less and forgets little, 3e-3 (in the other folder)
        # learns most; 1e-2 learns less than 3e-3 and forgets most: off the frontier.
        write(folder, "adamw_lr1e-3", "adamw", seed, final=0.30, loss_rise=0.30 + j)
        write(extra, "", "adamw", seed, final=0.32, loss_rise=0.50 + j)
        write(folder, "adamw_lr1e-2", "adamw", seed, final=0.31, loss_rise=0.90 + j)
        # SAM at 0.3 halfway in accuracy, forgetting 0.10 less than AdamW there (0.40).
        write(folder, "sam_rho0.3", "sam", seed, final=0.31, loss_rise=0.30 + j)
        # SAM at 0.1 forgets as AdamW there, within the seeds' noise.
        write(folder, "sam_rho0.1", "sam", seed, final=0.315, loss_rise=0.45 + 2 * j)
        # SAM at 1 learns less than any rate and forgets more than 1e-3: dominated.
        write(folder, "sam_rho1", "sam", seed, final=0.28, loss_rise=0.35 + j)
        # MESA at weight 2 a quarter of the way, forgetting 0.05 more than AdamW there (0.35).
        write(folder, "mesa_w2", "mesa", seed, final=0.305, loss_rise=0.40 + j)
        # Label smoothing 0.1 three quarters of the way, forgetting as AdamW there (0.45).
        write(folder, "smooth0.1", "adamw", seed, final=0.315, loss_rise=0.45 + j)
    write(extra, "", "sam", 42, final=0.319, loss_rise=0.49)  # rho 0.01, one seed
    # A folder that is not a point is ignored.
    os.makedirs(os.path.join(folder, "notes"))
    return folder, extra


def test_the_sweep_reads_each_point_and_joins_the_other_folders_runs(sweep):
    folder, extra = sweep
    points = lm_radius.gather(folder, extra)
    assert sorted(points) == [("adamw", 1e-3), ("adamw", 3e-3), ("adamw", 1e-2),
                              ("mesa", 2.0), ("sam", 0.01), ("sam", 0.1), ("sam", 0.3),
                              ("sam", 1.0), ("smooth", 0.1)]  # fmt: skip
    assert sorted(points[("adamw", 3e-3)]) == ["42", "43", "44"]
    rows = {(r["method"], r["setting"]): r for r in lm_radius.summarise(points)}
    row = rows[("sam", 0.3)]
    assert row["seeds"] == 3 and row["final"] == pytest.approx(0.31)
    assert row["loss_rise"] == pytest.approx(0.30)
    assert row["loss_rise_se"] == pytest.approx(0.01 / math.sqrt(3))


def test_sam_is_read_against_adamws_frontier_at_its_accuracy(sweep):
    rows = lm_radius.summarise(lm_radius.gather(*sweep))
    adamw = [r for r in rows if r["method"] == "adamw"]
    by = {(r["method"], r["setting"]): r for r in rows}
    # Halfway between 1e-3 (0.30, 0.30) and 3e-3 (0.32, 0.50): AdamW forgets 0.40 there; 1e-2
    # (0.31, 0.90) is off the frontier and not read.
    less = lm_radius.at_equal_accuracy(by[("sam", 0.3)], adamw)
    assert less["adamw_rise"] == pytest.approx(0.40)
    assert less["diff"] == pytest.approx(-0.10)
    assert less["se"] == pytest.approx(math.sqrt(0.01**2 / 3 + 2 * (0.5 * 0.01) ** 2 / 3))
    assert less["verdict"] == "forgets less" and "1e-2" not in less["between"]
    same = lm_radius.at_equal_accuracy(by[("sam", 0.1)], adamw)
    assert same["adamw_rise"] == pytest.approx(0.45)
    assert same["verdict"] == "the same, within twice the standard error"
    assert lm_radius.at_equal_accuracy(by[("sam", 1.0)], adamw)["verdict"] == "dominated by AdamW"
    one = lm_radius.at_equal_accuracy(by[("sam", 0.01)], adamw)
    assert one["verdict"] == "one seed: no reading"
    more = lm_radius.at_equal_accuracy(by[("mesa", 2.0)], adamw)
    assert more["adamw_rise"] == pytest.approx(0.35) and more["diff"] == pytest.approx(0.05)
    assert more["verdict"] == "forgets more"
    smooth = lm_radius.at_equal_accuracy(by[("smooth", 0.1)], adamw)
    assert smooth["adamw_rise"] == pytest.approx(0.45) and smooth["diff"] == pytest.approx(0.0)


def test_main_writes_the_table_and_the_plot(sweep):
    folder, extra = sweep
    text = lm_radius.main([folder, "--with", extra])
    assert "| SAM rho 0.3 | 3 | 0.3100 ± 0.0000 | 0.300 ± 0.006 |" in text
    assert "forgets less (AdamW between lr 0.001 and 0.003)" in text
    assert "| MESA weight 2 | 3 | 0.3050 ± 0.0000 | 0.400 ± 0.006 |" in text
    assert "| AdamW, label smoothing 0.1 | 3 | 0.3150 ± 0.0000 | 0.450 ± 0.006 |" in text
    assert os.path.getsize(os.path.join(folder, "radius.png")) > 1000
    with open(os.path.join(folder, "radius.md")) as handle:
        assert handle.read() == text
