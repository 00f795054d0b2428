"""The FSDP2/DDP memory benchmark's pure part (benchmarks/fsdp2_memory.py): medians over
runs, the max over ranks, the ratios and the goal's verdict, and the table they make."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import fsdp2_memory  # noqa: E402


def _ranks(*training_mb: float, masks=("01", "01")) -> list[dict]:
    return [
        {"training_mb": mb, "setup_mb": 300.0, "runtime_mb": 100.0, "masks": list(m)}
        for mb, m in zip(training_mb, masks)
    ]  # fmt: skip


def test_ratios_medians_and_goal_verdict_from_a_fake_result():
    runs = {
        "ddp": {  # 3 runs: median of each run's max over ranks
            "sam": [_ranks(990, 1000), _ranks(1010, 900), _ranks(1200, 1100)],
            "slsam": [_ranks(800, 790), _ranks(810, 700), _ranks(600, 650)],
        },
        "fsdp2": {
            "sam": [_ranks(800, 780), _ranks(820, 800)],
            "slsam": [_ranks(720, 700), _ranks(700, 710, masks=("10", "01"))],
        },
    }
    # The run with freed memory returned: each configuration's first run, halved.
    returned = {
        s: {m: [{**r, "training_mb": r["training_mb"] / 2} for r in rs[0]] for m, rs in ms.items()}
        for s, ms in runs.items()
    }
    summary = fsdp2_memory.summarize(runs, returned)
    ddp, fsdp2 = summary["rows"]["ddp"], summary["rows"]["fsdp2"]
    assert ddp["sam"]["peak_mb"] == 1010 and ddp["slsam"]["peak_mb"] == 800
    assert ddp["sam"]["per_rank_mb"] == [1010, 1000] and ddp["slsam"]["per_rank_mb"] == [800, 700]
    assert ddp["slsam"]["ratio_to_sam"] == pytest.approx(800 / 1010)
    assert fsdp2["sam"]["peak_mb"] == 810  # median of two runs: their mean
    assert fsdp2["slsam"]["ratio_to_sam"] == pytest.approx(715 / 810)
    assert fsdp2["sam"]["fsdp2_over_ddp"] == pytest.approx(810 / 1010)
    assert ddp["slsam"]["fsdp2_over_ddp"] == pytest.approx(715 / 800)
    assert ddp["sam"]["setup_mb"] == 200
    assert ddp["slsam"]["returned_mb"] == 400 and ddp["slsam"]["returned_per_rank_mb"] == [400, 395]
    assert ddp["slsam"]["returned_to_sam"] == pytest.approx(400 / 500)
    assert fsdp2["slsam"]["returned_to_sam"] == pytest.approx(360 / 400)
    assert ddp["slsam"]["masks_agree"] and not fsdp2["slsam"]["masks_agree"]
    goal = summary["goal"]
    assert goal["ddp"]["met"] and goal["ddp"]["ratio"] == pytest.approx(0.792, abs=1e-3)
    assert not goal["fsdp2"]["met"]  # 0.883 > 0.85

    result = {
        "summary": summary, "world": 2, "batch_per_rank": 8, "steps": 6, "repeats": 3,
        "threads": 1, "goal": 0.85, "description": "a model", "minutes": 1.0, "date": "today",
        "command": "python benchmarks/fsdp2_memory.py", "notes": "## Why\n\nbecause",
        "machine": {"cpu": "cpu", "cores": 2, "platform": "linux", "python": "3", "torch": "2",
                    "cuda": None},
    }  # fmt: skip
    text = fsdp2_memory.render(result)
    table = [line for line in text.splitlines() if line.startswith("| ddp | sam |")]
    header = text.splitlines()[text.splitlines().index(table[0]) - 2 :][:2]
    assert header[0].count("|") == header[1].count("|") == table[0].count("|") == 13
    assert "| ddp | slsam | 800 | 800, 810, 650 | 800 / 700 | 0.792 | 0.894 |" in text
    assert "| 0.894 | 400 | 400 / 395 | 0.800 | 200 | - |" in text  # freed memory returned
    assert "| fsdp2 | 0.883 | 0.900 | 0.85 | **missed** |" in text
    assert "| ddp | 0.792 | 0.800 | 0.85 | met |" in text
    assert "same layers every step: **no**" in text and text.rstrip().endswith("because")
