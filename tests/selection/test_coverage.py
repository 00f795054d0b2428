"""The guard rail (:mod:`lightning_slsam.selection.coverage`): the full updates a sampled layer
can expect over a run, when the fit-start line fires and when it does not, and that its
threshold agrees with every committed row of the coverage table (docs/methods.md)."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import LitModel, loader, make_data, make_mlp, trainer

from lightning_slsam import CostAwareSLSAM, RandomSLSAM, SparseLayerSAM, TopSLSAM
from lightning_slsam.selection.coverage import DOCS, FLOOR, coverage_message, expected_updates

TABLE = Path(__file__).parents[2] / "docs" / "results" / "choosing" / "coverage.json"


def test_expected_updates_is_the_median_layers_full_updates():
    q = torch.tensor([0.1, 0.2, 0.2, 0.5, 0.9], dtype=torch.float64)
    assert expected_updates(q, 100, None) == pytest.approx(20.0)  # median q 0.2
    assert expected_updates(q, 100, 3.0) == pytest.approx(60.0)  # scaled: 0.6 of an update
    # a scaled update is at most a full one: min(1, q * cap)
    assert expected_updates(torch.full((4,), 0.5, dtype=torch.float64), 100, 3.0) == 100.0
    assert expected_updates(torch.empty(0), 100, None) is None
    assert expected_updates(q, math.inf, None) is None


def test_the_message_fires_under_the_floor_only_and_names_the_fixes():
    below = coverage_message("SparseLayerSAM", FLOOR - 1, 4 * FLOOR, 0.2, None)
    assert below is not None
    assert f"about {FLOOR - 1:.0f} full updates over these {4 * FLOOR:.0f} steps" in below
    assert "layer_ratio=0.25` or more" in below  # FLOOR / (4 * FLOOR), rounded up to 0.05
    assert below.endswith(f"(see {DOCS}).") and "every layer each step (RST)" in below
    # One sentence and the fix, the evidence behind the link: no measured figures in it.
    assert below.count(". ") == 0 and len(below) < 400, below
    assert "points" not in below and "coverage.md" not in below
    assert "lost accuracy" not in below and f"fewer than the {FLOOR:.0f} recommended" in below
    assert coverage_message("SparseLayerSAM", FLOOR, 5 * FLOOR, 0.2, None) is None
    assert coverage_message("SparseLayerSAM", None, math.inf, 0.2, None) is None
    # a run too short for any ratio to reach the floor offers none
    short = coverage_message("SparseLayerSAM", 4.0, 20, 0.2, None)
    assert short is not None and "layer_ratio=" not in short.split("; use ")[1]
    barely = coverage_message("SparseLayerSAM", FLOOR * 0.2, FLOOR, 0.2, None)
    assert barely is not None and "use `layer_ratio=1` (every layer, every step), " in barely


def _lines_at_train_start(callback, max_steps: int, max_epochs: int = -1) -> list[str]:
    """The coverage lines a fit warns at train start (the fit stops before its first step)."""

    class StopAtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.should_stop = True

    model = LitModel(make_mlp())
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = trainer([callback, StopAtStart()], max_steps=max_steps, max_epochs=max_epochs)
        fit.fit(model, loader(make_data(64), 16))
    assert fit.global_step == 0
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())
    return [str(w.message) for w in caught if "full updates" in str(w.message)]


#: The last step count under the floor and the first at it, for a layer receiving ``share``
#: of a full update per step.
def _under(share: float) -> int:
    return math.floor(FLOOR / share) - 1


def _at(share: float) -> int:
    return math.ceil(FLOOR / share) + 1


@pytest.mark.parametrize(
    ("callback", "max_steps", "fires"),
    [
        # the paper's method: 0.2 of an update per layer and step
        (SparseLayerSAM(preset="paper"), _under(0.2), True),
        (SparseLayerSAM(preset="paper"), _at(0.2), False),
        # the default scales updates up to 3x: 0.6 of an update per step
        (SparseLayerSAM(), _under(0.6), True),
        (SparseLayerSAM(), _at(0.6), False),
        (SparseLayerSAM(layer_ratio=0.5), _under(0.6), False),  # a larger ratio, as the line says
        (RandomSLSAM(), _under(0.2), True),
        (RandomSLSAM(preset="default"), _at(0.6), False),
        # a depth cut draws the layers near the input less often: fewer updates than the
        # default at the same length
        (CostAwareSLSAM(), _at(0.6), True),
        (TopSLSAM(), 10, False),  # a greedy pick has no draw to count
        (SparseLayerSAM(layer_ratio=1.0), 10, False),  # every layer every step
    ],
    ids=[
        "paper-under",
        "paper-at",
        "default-under",
        "default-at",
        "ratio-0.5",
        "random-under",
        "random-default-at",
        "cost-aware",
        "top",
        "all-layers",
    ],
)
def test_the_line_fires_exactly_under_the_floor(callback, max_steps, fires):
    lines = _lines_at_train_start(callback, max_steps)
    assert len(lines) == (1 if fires else 0), lines
    if fires:
        assert lines[0].startswith(type(callback).__name__ + ": each sampled layer can expect")
        assert f"over these {max_steps} steps" in lines[0]


def test_a_run_sized_in_epochs_counts_its_steps():
    # 4 batches per epoch: the paper's method gets 0.8 of an update per layer and epoch
    enough, short = _at(0.8), _under(0.8)
    assert _lines_at_train_start(SparseLayerSAM(preset="paper"), -1, max_epochs=enough) == []
    assert len(_lines_at_train_start(SparseLayerSAM(preset="paper"), -1, max_epochs=short)) == 1


def test_the_floor_agrees_with_the_coverage_table():
    # The committed table (examples/scripts/coverage_table.py): every row the guard rail
    # would warn for lost accuracy against SAM beyond SAM's seed spread, and no row that
    # matched SAM is warned for. Rows at the floor or above lose for other reasons too (the
    # language-model task, uncapped update scaling): the line does not claim those.
    rows = json.loads(TABLE.read_text())["rows"]
    warned = [r for r in rows if r["figure"] < FLOOR]
    assert len(warned) >= 15 and len(rows) - len(warned) >= 15
    assert [r["label"] for r in warned if not r["under_sam"]] == []
    assert min(r["figure"] for r in rows if not r["under_sam"]) >= FLOOR
    # the floor is no higher than the evidence: the line it draws falls between a loss and
    # the smallest figure that matched SAM
    assert max(r["figure"] for r in warned) >= 0.9 * FLOOR
