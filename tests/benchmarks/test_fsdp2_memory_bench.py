"""The FSDP2/DDP memory benchmark's pure part (benchmarks/fsdp2_memory_report.py): medians
over runs, the max over ranks, the ratios and the goal's verdicts, the shapes' regimes, the
Trainer's route against the plain loop, merging a run into saved results, and the tables
they make; and which strategies each route runs (benchmarks/fsdp2_memory.py's plan)."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import fsdp2_memory as bench  # noqa: E402
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
    table = [line for line in text.splitlines() if line.startswith("| 2x32 | loop | ddp | sam |")]
    header = text.splitlines()[text.splitlines().index(table[0]) - 2 :][:2]
    assert header[0].count("|") == header[1].count("|") == table[0].count("|") == 17
    assert (
        "| 2x32 | loop | ddp | slsam_paper | 800 | 800, 810, 650 | 800 / 700 | - | 0.792 | 0.894 |"
        in text
    )  # no AdamW run here: no ratio to it
    assert "| 0.894 | 400 | 400 / 395 | - | 0.800 | 200 | - |" in text  # freed memory returned
    assert "| 2x32 | loop | fsdp2 | 0.883 | **missed** | 0.900 | **missed** | 0.85 |" in text
    assert "| 2x32 | loop | ddp | 0.792 | met | 0.800 | met | 0.85 |" in text
    assert "| 2x32 | loop | 2 (4) x 32 | 6, 3 + 1 | 200 / 100 | 12 | 2.0 | parameters |" in text
    assert "same layers every step: **no**" in text and text.rstrip().endswith("because")
    assert "against the plain loop" not in text  # no other route measured


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
    assert merged["shapes"]["8x128"]["route"] == "loop"  # saved before routes: the loop's


def test_results_saved_before_the_rename_read_the_paper_slsam_as_slsam_paper():
    old = {"world": 2, "shapes": {"2x32": {"batch_per_rank": 2, "seq": 32,
           "runs": {"ddp": {"sam": [_ranks(100, 100)], "slsam": [_ranks(80, 80)]}},
           "returned": {"ddp": {"slsam": _ranks(40, 40)}}}}}  # fmt: skip
    entry = report.as_shapes(old)["2x32"]
    assert list(entry["runs"]["ddp"]) == ["sam", "slsam_paper"]
    assert list(entry["returned"]["ddp"]) == ["slsam_paper"]
    assert list(old["shapes"]["2x32"]["runs"]["ddp"]) == ["sam", "slsam"]  # not changed
    goal = report.summarize(entry["runs"], entry["returned"])["goal"]["ddp"]
    assert goal["ratio"] == pytest.approx(0.8) and goal["met"]
    # Today's default SL-SAM ("slsam") beside the paper's keeps its name.
    both = {"sam": [], "slsam": [], "slsam_paper": []}
    assert list(report._renamed(both)) == ["sam", "slsam", "slsam_paper"]


def _entry(route: str, runs: dict, batch: int = 2, seq: int = 32) -> dict:
    returned = {s: {m: rs[0] for m, rs in ms.items()} for s, ms in runs.items()}
    return {"route": route, "batch_per_rank": batch, "seq": seq, "steps": 6, "repeats": 2,
            "minutes": 2.0, "cpu_minutes": 2.5, "date": "2026-01-02T03:04:05",
            "command": f"python benchmarks/fsdp2_memory.py --routes {route}",
            "summary": report.summarize(runs, returned)}  # fmt: skip


def test_the_trainer_route_beside_the_loop_ratios_to_adamw_and_its_table():
    loop = _entry("loop", {"fsdp2": {"adamw": [_ranks(200, 210)], "sam": [_ranks(230, 220)],
                                     "slsam_paper": [_ranks(190, 195)]}})  # fmt: skip
    trainer = _entry("trainer", {"fsdp2": {
        "adamw": [_ranks(300, 310), _ranks(320, 300)],  # median of maxima: 315
        "sam": [_ranks(350, 340), _ranks(340, 360)],  # 355
        "slsam_paper": [_ranks(280, 270), _ranks(290, 260)],  # 285
    }})  # fmt: skip
    rows = trainer["summary"]["rows"]["fsdp2"]
    assert rows["adamw"]["peak_mb"] == 315 and rows["sam"]["peak_mb"] == 355
    assert rows["slsam_paper"]["ratio_to_adamw"] == pytest.approx(285 / 315)
    assert rows["sam"]["ratio_to_adamw"] == pytest.approx(355 / 315)
    assert rows["slsam_paper"]["ratio_to_sam"] == pytest.approx(285 / 355)
    assert rows["adamw"]["ratio_to_adamw"] == 1.0
    assert rows["slsam_paper"]["returned_to_adamw"] == pytest.approx(280 / 310)
    assert rows["slsam_paper"]["fsdp2_over_ddp"] is None  # no DDP on this route
    assert trainer["summary"]["goal"]["fsdp2"]["ratio"] == pytest.approx(285 / 355)

    elsewhere = _entry("trainer", {"fsdp2": {"sam": [_ranks(900, 900)]}}, batch=8, seq=128)
    shapes = {"2x32": loop, "2x32 trainer": trainer, "8x128 trainer": elsewhere}
    pairs = report.against_loop(shapes)
    assert [(r["shape"], r["method"]) for r in pairs] == [
        ("2x32", "adamw"), ("2x32", "sam"), ("2x32", "slsam_paper"), ("8x128", "sam")
    ]  # fmt: skip
    slsam = pairs[2]
    assert (slsam["loop_peak_mb"], slsam["peak_mb"]) == (195, 285)
    assert slsam["peak_over_loop"] == pytest.approx(285 / 195)
    assert slsam["returned_over_loop"] == pytest.approx(280 / 195)
    assert pairs[3]["loop_peak_mb"] is None and pairs[3]["peak_over_loop"] is None  # no loop

    machine = {"cpu": "cpu", "cores": 2, "platform": "linux", "python": "3", "torch": "2",
               "cuda": None}  # fmt: skip
    result = {"shapes": shapes, "world": 2, "threads": 1, "goal": 0.85,
              "description": "a model", "machine": machine}  # fmt: skip
    text = report.render(result)
    assert (
        "| 2x32 | trainer | fsdp2 | slsam_paper | 285 | 280, 290 | 285 / 265 | 0.905 | 0.803 | - |"
        in text
    )
    assert "| 2x32 | trainer | fsdp2 | adamw | 315 | 310, 320 | 310 / 305 | 1.000 | 0.887 |" in text
    assert "| 2x32 | trainer | fsdp2 | 0.803 | met |" in text  # the goal, on this route too
    assert "| 2x32 | trainer | 2 (4) x 32 | 6, 2 + 1 |" in text
    assert (
        "| 2x32 | trainer | fsdp2 | slsam_paper | 195 | 285 | 1.462 | 195 | 280 | 1.436 |" in text
    )
    assert "| 8x128 | trainer | fsdp2 | sam | - | 900 | - | - | 900 | - |" in text
    section = text.splitlines().index(
        "## The Trainer against the plain loop: same shape, strategy and method"
    )
    header = text.splitlines()[section + 2 : section + 5]
    assert header[0].count("|") == header[1].count("|") == header[2].count("|") == 11


def test_merging_the_trainer_route_keeps_the_loop_at_the_same_shape():
    saved = {"world": 2, "shapes": {"2x32": {"minutes": 8.2}, "8x128": {"minutes": 28.4}}}
    key = report.entry_name("trainer", 2, 32)
    assert key == "2x32 trainer" and report.entry_name("loop", 2, 32) == "2x32"
    merged = report.merge(saved, {"world": 2, "shapes": {key: {"route": "trainer"}}})
    assert list(merged["shapes"]) == ["2x32", "8x128", "2x32 trainer"]
    assert merged["shapes"]["2x32"] == {"minutes": 8.2, "route": "loop"}


def test_each_route_runs_its_own_strategies():
    assert bench.plan("loop,trainer") == {"loop": ["ddp", "fsdp2"], "trainer": ["fsdp2"]}
    assert bench.plan("loop,trainer", "fsdp2") == {"loop": ["fsdp2"], "trainer": ["fsdp2"]}
    with pytest.raises(ValueError, match="trainer route runs under fsdp2 only"):
        bench.plan("trainer", "ddp")
    with pytest.raises(ValueError, match="unknown route 'lightning'"):
        bench.plan("lightning")
