"""The share-of-gain table (examples/scripts/benefit.py) on hand-made run records: the
learning rate and the radius are chosen on validation however the test accuracies fall, the
share is (method - AdamW) / (SAM - AdamW), a control splits a sampler's share, and SAM's
gain is called real only above twice its standard error."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "scripts"))
import benefit  # noqa: E402


def write(folder, group, label, seed, *, lr, rho=None, cls="SAM", module="lightning_slsam", val,
          best, end, smoothing=None, **options):  # fmt: skip
    here = os.path.join(folder, group, "runs", label, f"seed{seed}")
    os.makedirs(here)
    args = {"rho": rho, **options}
    callbacks = [] if rho is None else [{"class_path": f"{module}.{cls}", "init_args": args}]
    model = {"learning_rate": lr, **({} if smoothing is None else {"label_smoothing": smoothing})}
    config = {"model": {"init_args": model}, "trainer": {"callbacks": callbacks}}
    with open(os.path.join(here, "config.yaml"), "w") as handle:
        yaml.safe_dump(config, handle)
    with open(os.path.join(here, "run.json"), "w") as handle:
        json.dump({"best": val, "report_at_best": best, "report_final": end}, handle)


@pytest.fixture
def task(tmp_path):
    folder = str(tmp_path / "toy")
    for seed, jitter in enumerate((-0.01, 0.0, 0.01)):
        # lr 1e-3 wins on validation although lr 3e-3 has the better test accuracy
        write(
            folder,
            "adamw_lr1e-3",
            "adamw",
            seed,
            lr=1e-3,
            val=0.90,
            best=0.80 + jitter,
            end=0.70 + jitter,
        )
        write(folder, "adamw_lr3e-3", "adamw", seed, lr=3e-3, val=0.85, best=0.95, end=0.95)
        # rho 0.3 wins on validation; rho 1 tests better and is not chosen
        write(
            folder,
            "sam_rho0.3",
            "sam",
            seed,
            lr=1e-3,
            rho=0.3,
            val=0.95,
            best=0.90 + jitter,
            end=0.80 + jitter,
        )
        write(folder, "sam_rho1", "sam", seed, lr=1e-3, rho=1.0, val=0.93, best=0.99, end=0.99)
        write(
            folder,
            "methods",
            "slsam",
            seed,
            lr=1e-3,
            rho=0.3,
            cls="SparseLayerSAM",
            val=0.94,
            best=0.85 + jitter,
            end=0.80 + jitter,
        )
        write(
            folder,
            "controls",
            "slsam_rho0",
            seed,
            lr=1e-3,
            rho=1e-8,
            cls="SparseLayerSAM",
            val=0.91,
            best=0.82 + jitter,
            end=0.76 + jitter,
        )
        # a sampler at a learning rate of its own, and SAM at it (not a row: SAM is chosen
        # at AdamW's learning rate)
        write(folder, "own", "slsam", seed, lr=3e-3, rho=0.3, cls="SparseLayerSAM", val=0.9,
              best=0.88, end=0.88)  # fmt: skip
        write(folder, "own", "sam", seed, lr=3e-3, rho=0.3, val=0.99, best=0.99, end=0.99)
        write(folder, "own", "slsam_rho0", seed, lr=3e-3, rho=1e-8, cls="SparseLayerSAM",
              val=0.9, best=0.86, end=0.86)  # fmt: skip
    return folder


def test_choices_are_made_on_validation_and_shares_read_on_test(task):
    table = benefit.task_table(benefit.read_runs(task))
    assert table["lr"] == 1e-3 and table["rho"] == 0.3
    assert table["best_epoch"]["gain"] == pytest.approx(0.10)
    assert table["best_epoch"]["real"]  # equal jitter: the difference's spread is tiny
    # three seeds: shown, not claimed
    assert not table["best_epoch"]["enough_seeds"]
    assert (
        "(above twice its standard error, on 3 seeds of AdamW and 3 of SAM: not a claim yet"
        " (it needs 5 each))" in benefit.render({"toy": table})
    )
    assert "says nothing" not in benefit.render({"toy": table})  # a real gain: shares stand
    rows = table["rows"]
    # rho 1 and lr 3e-3 are SAM's sweep's, not rows; a sampler's own learning rate is one
    assert set(rows) == {"sam", "slsam", "slsam_rho0", "slsam (lr 0.003)", "slsam_rho0 (lr 0.003)"}
    assert rows["slsam (lr 0.003)"]["best_epoch"]["share"][0] == pytest.approx(0.8)
    # split against its own learning rate's control
    own_alone, own_added = rows["slsam (lr 0.003)"]["split"]["best_epoch"]
    assert own_alone == pytest.approx(0.6) and own_added == pytest.approx(0.2)
    assert rows["sam"]["best_epoch"]["share"][0] == pytest.approx(1.0)
    assert rows["slsam"]["best_epoch"]["share"][0] == pytest.approx(0.5)
    assert rows["slsam"]["end"]["share"][0] == pytest.approx(1.0)
    low, high = rows["slsam"]["best_epoch"]["share"][1:]
    assert low <= 0.5 <= high
    alone, added = rows["slsam"]["split"]["best_epoch"]
    assert alone == pytest.approx(0.2) and added == pytest.approx(0.3)
    assert set(table["sweep"]) == {"AdamW lr 0.001", "AdamW lr 0.003", "SAM rho 0.3", "SAM rho 1"}


def test_a_method_sized_by_options_of_its_own_has_a_row_per_setting(task):
    # MESA at two weights (its rho is the default, not its size): two rows named by the
    # options that size it, each with its own seeds
    for seed in range(3):
        for group, weight, best in (("mesa_w0.3", 0.3, 0.85), ("mesa_w1", 1.0, 0.90)):
            write(task, group, "mesa", seed, lr=1e-3, rho=0.01, cls="MESA", val=0.9,
                  best=best, end=best, weight=weight, tau=5.0, decay=0.999, start=0.05)  # fmt: skip
    table = benefit.task_table(benefit.read_runs(task))
    rows = table["rows"]
    low, high = (
        "mesa (weight 0.3, tau 5, decay 0.999, start 0.05)",
        "mesa (weight 1, tau 5, decay 0.999, start 0.05)",
    )
    assert {low, high} <= set(rows) and rows[low]["seeds"] == rows[high]["seeds"] == 3
    assert rows[low]["best_epoch"]["share"][0] == pytest.approx(0.5)
    assert rows[high]["best_epoch"]["share"][0] == pytest.approx(1.0)
    assert f"| {high} | MESA | - | 3 |" in benefit.render({"toy": table})


def test_a_control_of_a_radius_method_is_named_by_what_it_varies(task):
    for seed in range(2):
        for group, eta in (("arwp", 0.1), ("arwp_eta0", 0.0)):
            write(task, group, "arwp", seed, lr=1e-3, rho=0.01, cls="ARWP", val=0.9, best=0.85,
                  end=0.85, growth=10.0, eta=eta)  # fmt: skip
    rows = benefit.task_table(benefit.read_runs(task))["rows"]
    assert {"arwp (rho 0.01)", "arwp (rho 0.01, eta 0)"} <= set(rows)


def test_a_smoothed_adamw_is_a_row_and_an_example_method_is_its_own_class(task):
    for seed, jitter in enumerate((-0.01, 0.0, 0.01)):
        # AdamW at the chosen rate with label smoothing (the mechanism control): a row of its
        # own; joining the baseline would move SAM's gain.
        write(task, "adamw_ls0.1", "adamw", seed, lr=1e-3, val=0.99, best=0.85 + jitter,
              end=0.75 + jitter, smoothing=0.1)  # fmt: skip
        # SAF on the bandit's draw (examples/methods.py's class): a row named by SAF's
        # options, split against the bandit's sparse updates alone (slsam_rho0).
        write(task, "slsam_saf_w3", "slsam_saf", seed, lr=1e-3, rho=0.01, cls="SLSAMSAF",
              module="examples.methods", val=0.9, best=0.86 + jitter, end=0.80 + jitter,
              weight=3.0, tau=5.0, delay=3, start_epoch=5)  # fmt: skip
    table = benefit.task_table(benefit.read_runs(task))
    assert table["best_epoch"]["gain"] == pytest.approx(0.10)  # the baseline as before
    rows = table["rows"]
    smoothed = rows["adamw (label_smoothing 0.1)"]
    assert smoothed["best_epoch"]["share"][0] == pytest.approx(0.5)
    assert smoothed["end"]["share"][0] == pytest.approx(0.5)
    saf = "slsam_saf (weight 3, tau 5, delay 3, start_epoch 5)"
    assert rows[saf]["method"] == "SLSAMSAF"
    assert rows[saf]["best_epoch"]["share"][0] == pytest.approx(0.6)
    alone, added = rows[saf]["split"]["best_epoch"]
    assert alone == pytest.approx(0.2) and added == pytest.approx(0.4)
    text = benefit.render({"toy": table})
    assert "| adamw (label_smoothing 0.1) | AdamW | - | 3 |" in text
    assert f"| {saf} | SLSAMSAF | - | 3 |" in text


def test_a_gain_within_twice_its_standard_error_is_not_called_real(tmp_path):
    folder = str(tmp_path / "flat")
    for seed, (a, s) in enumerate(((0.80, 0.70), (0.70, 0.85), (0.75, 0.78))):
        write(folder, "adamw", "adamw", seed, lr=1e-3, val=0.9, best=a, end=a)
        write(folder, "sam", "sam", seed, lr=1e-3, rho=0.1, val=0.9, best=s, end=s)
    table = benefit.task_table(benefit.read_runs(folder))
    gain = table["end"]
    assert gain["gain"] == pytest.approx(0.0267, abs=1e-3)
    assert not gain["real"] and gain["gain_se"] > gain["gain"] / 2
    text = benefit.render({"flat": table})
    assert "not above twice its standard error" in text
    assert "a share divides by a difference within the seeds' noise and says nothing" in text
    assert not math.isnan(table["rows"]["sam"]["end"]["share"][0])


def test_step_times_attach_to_rows_and_the_frontier_keeps_the_undominated(task, tmp_path):
    times = tmp_path / "times.json"
    configs = {"sam": 1.0, "slsam": 0.45, "adamw": 0.6}
    times.write_text(
        json.dumps(
            {
                "results": [
                    {"task": "toy", "configs": {k: {"ratio_to_sam": v} for k, v in configs.items()}}
                ]
            }
        )
    )
    table = benefit.task_table(benefit.read_runs(task))
    benefit.add_times("toy", table, benefit.step_times("toy", str(times)))
    rows = table["rows"]
    # a control is timed as its sampler
    assert rows["slsam"]["time"] == rows["slsam_rho0"]["time"] == 0.45
    assert rows["sam"]["time"] == 1.0 and table["adamw_time"] == 0.6
    # a radius variant and a configuration doing another's work are timed as that method;
    # a configuration nobody timed has no time
    times_of = {"slsam": 0.45, "looksam": 0.6}
    assert benefit.time_of("slsam (rho 0.1)", times_of) == 0.45
    assert benefit.time_of("slsam_unscaled", times_of) == 0.45
    assert benefit.time_of("looksam_alpha01", times_of) == 0.6
    assert benefit.time_of("rst", times_of) is None
    # a later run timing a new method beside AdamW and SAM: the method joins at its ratio
    # to AdamW measured there; what the first run timed keeps its figures
    later = tmp_path / "later.json"
    configs = {"sam": 1.0, "adamw": 0.5, "slsam": 0.9, "arwp": 0.55}
    rows_of = {k: {"ratio_to_sam": v} for k, v in configs.items()}
    later.write_text(json.dumps({"results": [{"task": "toy", "configs": rows_of}]}))
    merged = benefit.step_times("toy", str(times), str(later))
    assert merged["slsam"] == 0.45 and merged["adamw"] == 0.6
    assert merged["arwp"] / merged["adamw"] == pytest.approx(1.1)
    assert benefit.frontier([(0.6, 0.0), (0.45, 0.5), (1.0, 1.0), (0.8, 0.4)]) == [
        (0.45, 0.5),
        (1.0, 1.0),
    ]


def test_the_plot_leaves_out_a_task_where_sams_gain_is_not_real(tmp_path, monkeypatch):
    results = tmp_path / "results"
    gained, flat = str(results / "gained"), str(results / "flat")
    for seed, (a, s) in enumerate(((0.80, 0.70), (0.70, 0.85), (0.75, 0.78))):
        write(flat, "adamw", "adamw", seed, lr=1e-3, val=0.9, best=a, end=a)
        write(flat, "sam", "sam", seed, lr=1e-3, rho=0.1, val=0.9, best=s, end=s)
        jitter = 0.01 * (seed - 1)
        write(gained, "adamw", "adamw", seed, lr=1e-3, val=0.9, best=0.7 + jitter, end=0.7)
        write(gained, "sam", "sam", seed, lr=1e-3, rho=0.1, val=0.9, best=0.9 + jitter, end=0.9)
    times = tmp_path / "times.json"
    rows = [{"task": t, "configs": {"sam": {"ratio_to_sam": 1.0}}} for t in ("gained", "flat")]
    times.write_text(json.dumps({"results": rows}))
    plotted = []
    monkeypatch.setattr(benefit, "plot", lambda tables, path: plotted.append(sorted(tables)))
    tables = benefit.main(["--results", str(results), "--times", str(times)])
    assert sorted(tables) == ["flat", "gained"]  # both tabulated
    assert plotted == [["gained"]]  # only the task where SAM gains is drawn
