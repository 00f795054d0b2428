"""The GPU benchmark (benchmarks/gpu.py): its smoke run on the CPU prints and writes every
method's row with the figures each method must have, its budget stops it cleanly with what
it measured written, and its counters count what they claim to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu  # noqa: E402

from lightning_slsam import make_engine  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    # One thread (the test workers share the cores) and a budget no slow machine reaches:
    # the budget's stop is tested on its own, below, with a fake clock.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    script = os.path.join(ROOT, "benchmarks", "gpu.py")
    done = subprocess.run(
        [sys.executable, script, "--smoke", "--budget", "3000", "--out", str(out)],
        capture_output=True, text=True, timeout=3300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "smoke-cpu.json") as handle:
        result = json.load(handle)
    return done.stdout, result, (out / "smoke-cpu.md").read_text()


def test_the_smoke_run_prints_and_writes_every_methods_row_for_every_model(smoke):
    stdout, result, table = smoke
    assert list(result["models"]) == gpu.SMOKE_MODELS
    for text in (stdout, table):
        for model in gpu.SMOKE_MODELS:
            section = text.split(f"## {model}:")[1].split("## ")[0]
            rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
            assert [row.split(" | ")[0].strip("| ") for row in rows] == gpu.METHODS
            assert not any("not measured" in row for row in rows)


def test_every_row_holds_the_figures_its_method_must_have(smoke):
    _, result, _ = smoke
    for model, entry in result["models"].items():
        rows = entry["methods"]
        for method, row in rows.items():
            assert row["mean_s"] > 0 and row["enough"], (model, method)
            assert row["peak_mib"] is None and row["syncs_per_step"] is None  # no GPU here
            assert (row["bookkeeping_ms"] is None) == (method == "adamw")
        assert rows["adamw"]["active_ratio"] == 1.0
        assert rows["sam"]["active_ratio"] == pytest.approx(2.0)
        assert rows["s2sam"]["active_ratio"] == pytest.approx(1.0)
        for sparse in ("slsam_paper", "slsam", "sl_s2sam", "slsam_depth"):
            assert 0 < rows[sparse]["active_ratio"] < rows["sam"]["active_ratio"], sparse
        # LookSAM over whole intervals from a SAM step: one SAM step in five.
        looksam = rows["looksam"]
        assert looksam["kinds"]["reuse"] == 4 * looksam["kinds"]["sam"]
        assert set(rows["rst"]["kinds"]) == {"sam", "plain"}
        assert rows["rst"]["steps"] >= 20


def test_the_paper_ratios_are_the_papers_tables():
    # Table 1 (DeiT-Small), Table 4 (RoBERTa CoLA / MNLI), Table 6 (Llama-3.2-3B): the
    # tables' seconds and memory of SL-SAM over AdaSAM's, to 4 decimals.
    expected = {
        "deit_small": (0.8572, 0.9165), "roberta_base": (0.8319, 0.9345),
        "roberta_base_512": (0.7425, 0.8001), "llama_3b": (0.7947, 0.9239),
    }  # fmt: skip
    for model, (time_ratio, memory_ratio) in expected.items():
        got = gpu.paper_ratios(model, "slsam_paper")
        assert (round(got[0], 4), round(got[1], 4)) == (time_ratio, memory_ratio), model
    assert round(gpu.paper_ratios("deit_small", "adamw")[0], 4) == 0.5122
    assert gpu.paper_ratios("llama_1b", "slsam_paper") == (None, None)
    assert gpu.paper_ratios("llama_3b", "looksam") == (None, None)


def test_the_most_important_figures_come_first():
    order = gpu.plan(gpu.GPU_MODELS, gpu.METHODS)
    assert order[:8] == [(m, me) for m in ("deit_small", "llama_3b") for me in gpu.LEAD_METHODS]
    assert order[8:14] == [("deit_small", m) for m in gpu.METHODS if m not in gpu.LEAD_METHODS]
    assert len(order) == len(set(order)) == len(gpu.GPU_MODELS) * len(gpu.METHODS)


def test_the_budget_stops_the_run_cleanly_with_every_measurement_written(monkeypatch, tmp_path):
    """A fake clock: each measurement takes 40 s. With 200 s, the run starts what fits,
    writes the table after each, names the rest as not measured, and ends inside the budget."""
    now = [0.0]
    monkeypatch.setattr(gpu.time, "perf_counter", lambda: now[0])
    written = []

    def fake_measure(model, method, **kwargs):
        now[0] += 40.0
        row = {"mean_s": 0.1 if method != "sam" else 0.2, "steps": 20, "kinds": {},
               "enough": True, "peak_mib": None, "bookkeeping_ms": None, "active_ratio": 1.0,
               "syncs_per_step": None}  # fmt: skip
        return f"{model} (fake)", row

    real_write = gpu.write
    monkeypatch.setattr(gpu, "measure", fake_measure)
    monkeypatch.setattr(
        gpu,
        "write",
        lambda result, out, slug: (written.append(now[0]), real_write(result, out, slug)),
    )
    result = gpu.main(["--smoke", "--budget", "200", "--out", str(tmp_path)])
    measured = [(mo, me) for mo, e in result["models"].items() for me in e["methods"]]
    # 200 s less the 10 s kept for writing: four measurements of 40 s fit; the fifth, expected
    # to take 1.25 x 40 s, is not started with 30 s left, nor anything after it.
    assert measured == gpu.plan(gpu.SMOKE_MODELS, gpu.METHODS)[:4]
    assert written[:4] == [40.0, 80.0, 120.0, 160.0] and result["elapsed_s"] <= 200
    table = (tmp_path / "smoke-cpu.md").read_text()
    assert "| slsam | 100.0 | 0.500 |" in table
    assert table.count("not measured: the budget ran out") == 4 * len(gpu.METHODS) - 4


def test_the_sync_counter_counts_python_warnings_and_printed_ones():
    counter = gpu.SyncCounter(enabled=True)
    with counter.counting():
        warnings.warn(f"{gpu.SyncCounter.MESSAGE} (function item)", UserWarning, stacklevel=1)
        warnings.warn(f"{gpu.SyncCounter.MESSAGE} (function item)", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
        os.write(2, f"[W] Warning: {gpu.SyncCounter.MESSAGE} (function copy_)\n".encode())
    assert counter.count == 3
    off = gpu.SyncCounter(enabled=False)
    with off.counting():
        warnings.simplefilter("ignore")
    assert off.count is None


def test_timing_the_bookkeeping_changes_nothing_in_training():
    def run(timed: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(5)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine = make_engine("slsam_paper", model, layer_ratio=0.4, seed=3)
        book = gpu.Bookkeeping(engine) if timed else None
        x = torch.randn(16, 8)
        for _ in range(6):
            engine.train_step(lambda index=None: model(x).pow(2).mean(), opt)
        return [p.detach().clone() for p in model.parameters()], engine.counts.clone(), book

    plain, counts, _ = run(False)
    timed, timed_counts, book = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, timed))
    assert torch.equal(counts, timed_counts) and book.seconds > 0
