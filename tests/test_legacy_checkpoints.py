"""Checkpoints written by an earlier version of the plugin still resume identically.

``tests/fixtures/legacy`` holds, for every kind of method state, a checkpoint after one
epoch and the reference result of an uninterrupted two-epoch run, both made with the code
of commit 21703b5 (``tests/fixtures/make_legacy_checkpoints.py``), under the method names
and options of then (its ``CASES`` name today's that run the same configuration). Today's
code must load each checkpoint and finish the run as that code did without interruption:
the same draws (the counts exactly), the weights and probabilities up to the rounding of
this machine's kernels (tests/tolerance.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from tolerance import (
    STORED_PROBS,
    assert_matches_stored,
    load_input,
    load_stored,
    plain,
    stored_run_tolerance,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

from make_legacy_checkpoints import CASES, run  # noqa: E402

pytestmark = pytest.mark.kernels  # stored references: run again under other kernels

REFERENCE = load_stored(FIXTURES / "legacy" / "reference.pt", weights_only=True)

#: The cases whose configuration SparseLayerSAM ran then and a class of its own runs today:
#: the checkpoint holds the callback's state under the key "SparseLayerSAM", which today's
#: class does not read (no migration before 1.0).
MOVED = {"slsam_depth": "CostAwareSLSAM", "slsam_rank_scale": "SLSAMAblation"}


def _resume_and_check(name: str, ckpt: Path) -> None:
    saved = load_stored(ckpt, weights_only=False)["state_dict"]
    _, model, callback = run(name, epochs=2, ckpt_path=str(ckpt))
    expected = REFERENCE[name]
    weights = {n: p.detach() for n, p in model.named_parameters()}
    tolerance = stored_run_tolerance(CASES[name][0])
    # The second epoch trained, farther than the tolerance (so the comparison can fail) ...
    moved = max(float((weights[n] - plain(saved[n])).abs().max()) for n in weights)
    assert moved > 10 * tolerance["atol"]
    # ... and ended where the uninterrupted run of the earlier code ended: the same draws,
    # exactly; weights within 1e-5 + 1e-4 * |w| (LookSAM: 1e-4 + 1e-3 * |w|), probabilities
    # within 1e-7 (the rounding of another machine's kernels, measured in tests/tolerance.py).
    assert torch.equal(callback.engine.counts, expected["counts"])
    assert_matches_stored(weights, expected["weights"], **tolerance, what=name)
    assert_matches_stored(callback.probs, expected["probs"], **STORED_PROBS, what=name)


@pytest.mark.parametrize("name", sorted(set(CASES) - set(MOVED)))
def test_a_legacy_checkpoint_resumes_to_the_uninterrupted_result(name):
    _resume_and_check(name, FIXTURES / "legacy" / f"{name}.ckpt")


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_state_filed_under_the_class_of_an_earlier_version_is_refused_in_one_line(name):
    ckpt = FIXTURES / "legacy" / f"{name}.ckpt"
    assert "SparseLayerSAM" in load_input(ckpt, weights_only=False)["callbacks"]
    message = (
        rf"^{MOVED[name]}: the checkpoint's SAM state was saved by lightning-slsam 0\.2 or"
        r" earlier under the class name 'SparseLayerSAM', .*docs/changelog\.md\)\.$"
    )
    with pytest.raises(MisconfigurationException, match=message):
        run(name, epochs=2, ckpt_path=str(ckpt))


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_configurations_state_resumes_under_its_class_of_today(name, tmp_path):
    """The state itself carries over: filed under today's class (a copy of the fixture
    with the callback's entry renamed), the run ends where the earlier code's did."""
    checkpoint = load_input(FIXTURES / "legacy" / f"{name}.ckpt", weights_only=False)
    checkpoint["callbacks"] = {MOVED[name]: checkpoint["callbacks"].pop("SparseLayerSAM")}
    copy = tmp_path / f"{name}.ckpt"
    torch.save(checkpoint, copy)
    _resume_and_check(name, copy)
