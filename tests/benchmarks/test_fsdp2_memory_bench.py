"""The FSDP2/DDP memory benchmark's pure part (benchmarks/fsdp2_memory_report.py): medians
over runs, the max over ranks, the ratios and the goal's verdicts, the shapes' regimes,
merging a run into saved results, and the table they make."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import fsdp2_memory_report as report  # noqa: E402


def _ranks(*training_mb: float, masks=("01", "01")) -> list[dict]:
    return [
        {"training_mb": mb, "setup_mb": 300.0, "runtime_mb": 100.0, "masks": list(m)}
        for mb, m in zip(training_mb, masks)
    ]  # fmt: skip


def test_ratios_medians_and_goal_verdict_from_a_fake_result():
    runs = {
        "ddp": {  # 3 runs: median of each run's max over ranks
            "sam": [_ranks(990, 1000), _ranks(1010, 900), _ranks(1200, 1100)],
            "slsam_paper": [_ranks(800, 790), _ranks(810, 700), _ranks(600, 650)],
        },
        "fsdp2": {
            "sam": [_ranks(800, 780), _ranks(820, 800)],
            "slsam_paper": [_ranks(720, 700), _ranks(700, 710, masks=("10", "01"))],
        },
    }
    # The run with freed memory returned: each configuration's first run, halved.
    returned = {
        s: {m: [{**r, "training_mb": r["training_mb"] / 2} for r in rs[0]] for m, rs in ms.items()}
        for s, ms in runs.items()
    }
    summary = report.summarize(runs, returned)
    ddp, fsdp2 = summary["rows"]["ddp"], summary["rows"]["fsdp2"]
    assert ddp["sam"]["peak_mb"] == 1010 and ddp["slsam_paper"]["peak_mb"] == 800
    assert ddp["sam"]["per_rank_mb"] == [1010, 1000]
    assert ddp["slsam_paper"]["per_rank_mb"] == [800, 700]
    assert ddp["slsam_paper"]["ratio_to_sam"] == pytest.approx(800 / 1010)
    assert fsdp2["sam"]["peak_mb"] == 810  # median of two runs: their mean
    assert fsdp2["slsam_paper"]["ratio_to_sam"] == pytest.approx(715 / 810)
    assert fsdp2["sam"]["fsdp2_over_ddp"] == pytest.approx(810 / 1010)
    assert ddp["slsam_paper"]["fsdp2_over_ddp"] == pytest.approx(715 / 800)
    assert ddp["sam"]["setup_mb"] == 200
    assert ddp["slsam_paper"]["returned_mb"] == 400
    assert ddp["slsam_paper"]["returned_per_rank_mb"] == [400, 395]
    assert ddp["slsam_paper"]["returned_to_sam"] == pytest.approx(400 / 500)
    assert fsdp2["slsam_paper"]["returned_to_sam"] == pytest.approx(360 / 400)
    assert ddp["slsam_paper"]["masks_agree"] and not fsdp2["slsam_paper"]["masks_agree"]
    goal = summary["goal"]
    assert goal["ddp"]["met"] and goal["ddp"]["ratio"] == pytest.approx(0.792, abs=1e-3)
    assert not goal["fsdp2"]["met"]  # 0.883 > 0.85
    assert goal["ddp"]["returned_met"] and not goal["fsdp2"]["returned_met"]  # 0.80, 0.90
    assert goal["fsdp2"]["returned_ratio"] == pytest.approx(0.9)

    machine = {"cpu": "cpu", "cores": 2, "platform": "linux", "python": "3", "torch": "2",
               "cuda": None}  # fmt: skip
    estimate = {"weights_grads_adamw_mb": {"ddp": 200.0, "fsdp2": 100.0},
                "saved_activations_mb": 12.0, "logits_mb": 2.0}  # fmt: skip
    shape = {
        "summary": summary, "batch_per_rank": 2, "seq": 32, "steps": 6, "repeats": 3,
        "minutes": 1.0, "cpu_minutes": 1.5, "date": "2026-01-02T03:04:05",
        "command": "python benchmarks/fsdp2_memory.py --shapes 2x32", "estimate": estimate,
    }  # fmt: skip
    result = {"shapes": {"2x32": shape}, "world": 2, "threads": 1, "goal": 0.85,
              "description": "a model", "machine": machine,
              "notes": "## Why\n\nbecause"}  # fmt: skip
    text = report.render(result)
    table = [line for line in text.splitlines() if line.startswith("| 2x32 | ddp | sam |")]
    header = text.splitlines()[text.splitlines().index(table[0]) - 2 :][:2]
    assert header[0].count("|") == header[1].count("|") == table[0].count("|") == 14
    assert "| 2x32 | ddp | slsam_paper | 800 | 800, 810, 650 | 800 / 700 | 0.792 | 0.894 |" in text
    assert "| 0.894 | 400 | 400 / 395 | 0.800 | 200 | - |" in text  # freed memory returned
    assert "| 2x32 | fsdp2 | 0.883 | **missed** | 0.900 | **missed** | 0.85 |" in text
    assert "| 2x32 | ddp | 0.792 | met | 0.800 | met | 0.85 |" in text
    assert "| 2x32 | 2 (4) x 32 | 6, 3 + 1 | 200 / 100 | 12 | 2.0 | parameters |" in text
    assert "same layers every step: **no**" in text and text.rstrip().endswith("because")


def test_regime_of_a_shape():
    def regime(ddp, fsdp2, saved):
        return report.regime(
            {"weights_grads_adamw_mb": {"ddp": ddp, "fsdp2": fsdp2}, "saved_activations_mb": saved}
        )

    assert regime(200, 100, 12) == "parameters"  # over twice the activations, both strategies
    assert regime(200, 100, 60) == "mixed"  # FSDP2's shard is under twice the activations
    assert regime(200, 100, 250) == "activations"  # over the weights' tensors under both


def test_merge_keeps_the_shapes_not_rerun_and_reads_the_first_format():
    old = {"batch_per_rank": 8, "steps": 6, "repeats": 2, "runs": {"ddp": {}}, "returned": {},
           "summary": {}, "command": "c", "date": "d", "minutes": 28.4, "world": 2,
           "goal": 0.85, "description": "x", "notes": "n"}  # fmt: skip
    assert list(report.as_shapes(old)) == ["8x128"]
    assert report.as_shapes(old)["8x128"]["minutes"] == 28.4
    assert "world" not in report.as_shapes(old)["8x128"]
    new = {"world": 2, "shapes": {"2x32": {"minutes": 3.0}}}
    merged = report.merge(old, new)
    assert list(merged["shapes"]) == ["8x128", "2x32"]
    assert merged["shapes"]["8x128"]["minutes"] == 28.4
    rerun = report.merge(merged, {"world": 2, "shapes": {"8x128": {"minutes": 9.0}}})
    assert list(rerun["shapes"]) == ["8x128", "2x32"]  # replaced in its place
    assert rerun["shapes"]["8x128"] == {"minutes": 9.0} and rerun["shapes"]["2x32"]["minutes"] == 3
    assert report.merge(None, new)["shapes"] == new["shapes"]
