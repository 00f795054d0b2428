"""The benchmarks' step-time figure (benchmarks/step_cost.py): a method's mean cost per step
over whole periods of its step schedule, not the median (one kind's time where a method
mixes kinds), in `make bench` (step_time.py, run_all.py) and in short_runs_time.py.

The scripts run on a tiny network with a fake clock: each timed step "takes" 2 s when it is
a SAM step and 1 s otherwise, so the figures are known exactly."""

from __future__ import annotations

import os
import statistics
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import models  # noqa: E402
import run_all  # noqa: E402
import short_runs_time  # noqa: E402
import step_cost  # noqa: E402
import step_time  # noqa: E402

from lightning_slsam import make_engine  # noqa: E402

#: A LookSAM-like schedule: one expensive step, four cheap ones.
PERIOD = [2.0, 1.0, 1.0, 1.0, 1.0]


def test_an_interval_schedule_is_summarized_by_its_period_mean_not_its_median():
    times = PERIOD * 4
    row = step_cost.summarize(times, schedule=step_cost.Schedule(period=5))
    assert row["mean_s"] == pytest.approx(1.2) and statistics.median(times) == 1.0
    assert (row["steps"], row["first_step"], row["enough"]) == (20, 0, True)


def test_the_window_starts_at_a_period_boundary_and_holds_whole_periods():
    # Timed from step 2 (two warm-up steps), 21 steps: steps 2-4 and 20-22 are left out.
    times = (PERIOD * 5)[2:23]
    kinds = [("sam" if t == 2.0 else "reuse") for t in times]
    row = step_cost.summarize(times, 2, step_cost.Schedule(period=5), kinds)
    assert row["mean_s"] == pytest.approx(1.2)
    assert (row["steps"], row["first_step"]) == (15, 5)
    assert row["kinds"] == {"sam": 3, "reuse": 12}
    assert step_cost.kinds_text(row["steps"], row["kinds"]) == "15: 3 sam + 12 reuse"
    with pytest.raises(ValueError, match="no whole period"):
        step_cost.summarize(times[:4], 2, step_cost.Schedule(period=5))


def test_a_coin_counts_every_timed_step_and_says_when_they_are_too_few():
    coin = step_cost.Schedule(probability=0.5)
    assert coin.min_steps == 20 and step_cost.Schedule(probability=0.3).min_steps == 34
    times = [2.0, 1.0, 2.0, 2.0, 1.0] * 4
    row = step_cost.summarize(times, 3, coin)
    assert row["mean_s"] == pytest.approx(statistics.fmean(times)) and row["enough"]
    assert not step_cost.summarize(times[:19], 3, coin)["enough"]
    # One kind: every window is whole, and the figure is the plain mean.
    assert step_cost.summarize([1.0, 3.0, 1.0], 7)["mean_s"] == pytest.approx(5 / 3)


@pytest.mark.parametrize(
    "method, schedule",
    [
        ("sam", step_cost.Schedule()),
        ("slsam_depth", step_cost.Schedule()),
        ("looksam", step_cost.Schedule(period=5)),
        ("slsam_looksam", step_cost.Schedule(period=5)),
        ("rst", step_cost.Schedule(probability=0.5)),
        ("slsam_rst", step_cost.Schedule(probability=0.5)),
    ],
)
def test_the_schedule_is_read_from_the_methods_engine(method, schedule):
    assert step_cost.schedule_of(make_engine(method, tiny_net(), seed=0)) == schedule
    assert step_cost.schedule_of(None) == step_cost.Schedule()  # plain AdamW


def tiny_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def tiny_batches(count: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(8, 4, generator=gen), "y": torch.randint(0, 2, (8,), generator=gen)}
            for _ in range(count)]  # fmt: skip


def fake_clock(steps, batches, warmup, kinds=None):
    """``interleaved`` with a clock that charges 2 s for a SAM step, 1 s for any other."""
    times = {name: [] for name in steps}
    for r, batch in enumerate(batches):
        for name, step in steps.items():
            step(batch)
            result = getattr(getattr(step, "engine", None), "last_result", None)
            kind = getattr(result, "kind", None)
            if r >= warmup:
                times[name].append(2.0 if kind == "sam" else 1.0)
                if kinds is not None:
                    kinds.setdefault(name, []).append(kind)
    return times


def test_the_interleaved_runs_record_each_timed_steps_kind():
    net = tiny_net()
    work = models.Workload("tiny", net, tiny_batches(9), tiny_loss, "tiny")
    steps = {"looksam": step_time.make_step("looksam", work, net, 1e-3, 0.05, 0.5)}
    kinds: dict = {}
    times = step_time.interleaved(steps, work.batches, 2, kinds)
    assert len(times["looksam"]) == 7
    assert kinds["looksam"] == ["reuse", "reuse", "reuse", "sam", "reuse", "reuse", "reuse"]


def tiny_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


@pytest.fixture(scope="module")
def bench():
    """step_time.measure (make bench's step times) on the tiny network, on the fake clock."""
    methods = ["adamw", "sam", "rst", "looksam", "slsam_looksam", "slsam_depth"]
    patch = pytest.MonkeyPatch()
    patch.setattr(step_time, "interleaved", fake_clock)
    patch.setattr(step_time, "make_workload", lambda name, count, device: models.Workload(
        "tiny", tiny_net(), tiny_batches(count), tiny_loss, "a tiny MLP"))  # fmt: skip
    try:
        yield step_time.measure("tiny", methods, rounds=20, warmup=5)
    finally:
        patch.undo()


def test_make_bench_reports_a_mixed_methods_mean_cost_per_step(bench):
    rows = bench["methods"]
    assert rows["sam"]["mean_s"] == 2.0 and rows["adamw"]["mean_s"] == 1.0
    # LookSAM: one SAM step in five -- the median would be a reuse step's 1 s (0.5x SAM).
    for name in ("looksam", "slsam_looksam"):
        assert rows[name]["mean_s"] == pytest.approx(1.2), name
        assert rows[name]["ratio_to_sam"] == pytest.approx(0.6), name
        assert rows[name]["kinds"] == {"sam": 4, "reuse": 16} and rows[name]["first_step"] == 5
    # RST: the SAM steps' share of the 20 timed steps.
    rst = rows["rst"]
    share = rst["kinds"]["sam"] / 20
    assert 0 < share < 1 and rst["steps"] == 20 and rst["enough"]
    assert rst["ratio_to_sam"] == pytest.approx((1 + share) / 2)
    assert rows["slsam_depth"]["ratio_to_sam"] == 1.0


def test_make_bench_tables_state_the_rule_and_quote_the_mean(bench):
    text = step_time.render(bench)
    assert step_cost.RULE in text
    assert "| looksam | 1.200 | 20: 4 sam + 16 reuse |" in text
    names = list(bench["methods"])
    result = {
        "stamp": "",
        "wall_s": 60.0,
        "targets": [],
        "models": {
            "tiny": {
                "time": bench,
                "bandit": {"ms_per_step": {"total": 0.1}},
                "memory": {name: {"training_mb": 100.0} for name in names},
            }
        },
    }
    text = run_all.render(result)
    assert step_cost.RULE in text
    assert "| looksam | 1.200 | 20: 4 sam + 16 reuse | 0.600 |" in text


def test_the_short_run_benchmark_uses_the_same_rule(monkeypatch):
    # 12 steps from step 0: two whole LookSAM intervals (steps 0-9) count.
    monkeypatch.setattr(short_runs_time, "load_task", lambda config, epochs: (
        tiny_net(), tiny_batches(12), lambda m, b, index=None: tiny_loss(m, b), 1e-3))  # fmt: skip
    monkeypatch.setattr(short_runs_time, "interleaved", fake_clock)
    [result] = short_runs_time.measure(["vision92"], ["sam", "adamw", "looksam"])
    rows = result["configs"]
    assert rows["looksam"]["mean_step_s"] == pytest.approx(1.2)
    assert rows["looksam"]["ratio_to_sam"] == pytest.approx(0.6)
    assert rows["adamw"]["timed_steps"] == 12 and rows["looksam"]["timed_steps"] == 10
    text = short_runs_time.render([result])
    assert step_cost.RULE in text and "| looksam (10: 2 sam + 8 reuse) | 1.200 | 0.600 |" in text


def test_tasks_on_one_config_are_the_first_steps_of_one_run(monkeypatch):
    # vision 92 (4 epochs) and 276 (12 epochs): one run of 3 epochs' batches here (3 steps
    # each), the shorter summarised over its first third.
    epochs_asked = []

    def load(config, epochs):
        epochs_asked.append(epochs)
        return tiny_net(), tiny_batches(epochs * 3 // 4), lambda m, b, i=None: tiny_loss(m, b), 1e-3

    monkeypatch.setattr(short_runs_time, "load_task", load)
    monkeypatch.setattr(short_runs_time, "interleaved", fake_clock)
    short, long = short_runs_time.measure(["vision92", "vision276"], ["sam", "slsam_paper"])
    assert epochs_asked == [12]  # one model, one run
    assert (short["steps"], long["steps"]) == (3, 9)
    assert short["configs"]["sam"]["timed_steps"] == 3
    assert long["configs"]["sam"]["timed_steps"] == 9
    # the active ratio of the first steps alone, not of the whole run
    paper = [short["configs"]["slsam_paper"], long["configs"]["slsam_paper"]]
    assert 0 < paper[0]["active_ratio"] < 2 and 0 < paper[1]["active_ratio"] < 2
    assert short["configs"]["sam"]["active_ratio"] == pytest.approx(2.0)
