"""The plots and statistics of `python -m examples.compare`'s report (:mod:`examples.report`)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from scipy.stats import spearmanr

from examples.report import plot_selection, rank_correlation


@pytest.fixture
def saved_figures(monkeypatch):
    """The figures saved while the test runs (the plot functions save and let go of them)."""
    figures, save = [], Figure.savefig

    def savefig(self, *args, **kwargs):
        figures.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def shown_ticks(axis) -> list[float]:
    low, high = sorted(axis.get_view_interval())
    return [t for t in axis.get_ticklocs() if low <= t <= high]


def test_selection_plot_has_whole_steps_and_counts_from_zero(tmp_path, saved_figures):
    # Three steps, no layer at the floor: the default locator would tick 1.25, 1.5, ...
    # and centre the flat zero line on an axis reaching below zero.
    records = {
        "slsam": [{"entropy": [1.0, 0.99, 0.97], "floor_layers": [0, 0, 0]}] * 2,
        "slsam_paper": [{"entropy": [1.0, 0.9, 0.8], "floor_layers": [0, 1, 3]}],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_selection(records, str(tmp_path / "selection.png"))
        (fig,) = saved_figures
        FigureCanvasAgg(fig).draw()
    ax_entropy, ax_floor = fig.axes
    for ax in (ax_entropy, ax_floor):
        steps = shown_ticks(ax.xaxis)
        assert len(steps) >= 2 and all(t == int(t) for t in steps)
    counts = shown_ticks(ax_floor.yaxis)
    assert ax_floor.get_ylim()[0] == 0 and all(t == int(t) >= 0 for t in counts)
    # With every floor count at zero, the axis still starts at zero, above nothing.
    flat = {"slsam": [{"entropy": [1.0, 0.99, 0.97], "floor_layers": [0, 0, 0]}]}
    assert plot_selection(flat, str(tmp_path / "flat.png"))
    ax_floor = saved_figures[-1].axes[1]
    assert ax_floor.get_ylim()[0] == 0 and ax_floor.get_ylim()[1] >= 1
    assert all(t == int(t) for t in shown_ticks(ax_floor.yaxis))


def test_selection_plot_needs_a_learning_selection(tmp_path):
    assert not plot_selection({"adamw": [{"floor_layers": []}]}, str(tmp_path / "none.png"))
    assert not (tmp_path / "none.png").exists()


def test_rank_correlation_matches_scipy_with_ties_and_skips_nan():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(3, 40))
        x = rng.integers(0, 6, size=n).astype(float)  # many ties
        y = x + rng.normal(size=n)
        want = spearmanr(x, y).statistic
        assert rank_correlation(torch.tensor(x), torch.tensor(y)) == pytest.approx(want, abs=1e-12)
    x = torch.tensor([1.0, 2.0, math.nan, 4.0])
    y = torch.tensor([10.0, 30.0, 5.0, 20.0])
    assert rank_correlation(x, y) == pytest.approx(spearmanr([1, 2, 4], [10, 30, 20]).statistic)
    assert math.isnan(rank_correlation(torch.ones(5), torch.arange(5.0)))
