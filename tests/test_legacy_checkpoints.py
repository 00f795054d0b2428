"""Checkpoints written by an earlier version of the plugin still resume identically.

``tests/fixtures/legacy`` holds, for every kind of method state, a checkpoint after one
epoch and the reference result of an uninterrupted two-epoch run, both made with the code
of commit 21703b5 (``tests/fixtures/make_legacy_checkpoints.py``), under the method names
and options of then (its ``CASES`` name today's that run the same configuration). Today's
code must load each checkpoint and finish the run exactly as that code did without
interruption.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

from make_legacy_checkpoints import CASES, run  # noqa: E402

REFERENCE = torch.load(FIXTURES / "legacy" / "reference.pt", weights_only=True)

#: The cases whose configuration SparseLayerSAM ran then and a class of its own runs today:
#: the checkpoint holds the callback's state under the key "SparseLayerSAM", and today's
#: class resumes from it.
MOVED = {"slsam_depth": "CostAwareSLSAM", "slsam_rank_scale": "SLSAMAblation"}


def _resume_and_check(name: str, ckpt: Path) -> None:
    saved = torch.load(ckpt, weights_only=False)["state_dict"]
    _, model, callback = run(name, epochs=2, ckpt_path=str(ckpt))
    expected = REFERENCE[name]
    weights = {n: p.detach() for n, p in model.named_parameters()}
    # The second epoch trained (so the comparison can fail) ...
    assert any(not torch.equal(weights[n], saved[n]) for n in weights)
    # ... and ended where the uninterrupted run of the earlier code ended.
    for n, value in expected["weights"].items():
        torch.testing.assert_close(weights[n], value, rtol=1e-5, atol=1e-7, msg=n)
    torch.testing.assert_close(callback.probs, expected["probs"], rtol=1e-7, atol=1e-9)
    assert torch.equal(callback.engine.counts, expected["counts"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_legacy_checkpoint_resumes_to_the_uninterrupted_result(name):
    ckpt = FIXTURES / "legacy" / f"{name}.ckpt"
    if name in MOVED:  # the state is filed under the class that saved it
        assert "SparseLayerSAM" in torch.load(ckpt, weights_only=False)["callbacks"]
    _resume_and_check(name, ckpt)


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_configurations_state_resumes_under_its_class_of_today(name, tmp_path):
    """The state itself carries over: filed under today's class (a copy of the fixture
    with the callback's entry renamed), the run ends where the earlier code's did."""
    checkpoint = torch.load(FIXTURES / "legacy" / f"{name}.ckpt", weights_only=False)
    checkpoint["callbacks"] = {MOVED[name]: checkpoint["callbacks"].pop("SparseLayerSAM")}
    copy = tmp_path / f"{name}.ckpt"
    torch.save(checkpoint, copy)
    _resume_and_check(name, copy)
