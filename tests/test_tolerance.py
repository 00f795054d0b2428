"""The rule of tests/tolerance.py, held: a stored reference is read through load_stored and
compared within a tolerance, never bit for bit; what must be exact (integers, booleans)
stays exact; the margin record measures what share of its tolerance a comparison used."""

from __future__ import annotations

import json

import margins
import pytest
import tolerance
import torch
from tolerance import FIXTURES, assert_matches_stored, load_input, load_stored, plain

pytestmark = pytest.mark.kernels  # the guard and the marks hold under every variant too


@pytest.fixture
def stored(tmp_path):
    path = tmp_path / "run.pt"
    torch.save({"weights": {"w": torch.tensor([1.0, -2.0])}, "counts": torch.tensor([3, 0]),
                "masks": [torch.tensor([True, False])], "file": "a.yaml"}, path)  # fmt: skip
    return load_stored(path, weights_only=True)


def test_a_stored_float_refuses_a_bit_for_bit_comparison(stored):
    w = stored["weights"]["w"]
    for compare in (lambda: torch.equal(torch.tensor([1.0, -2.0]), w), lambda: w == 1.0,
                    lambda: torch.eq(w, w), lambda: w != 1.0):  # fmt: skip
        with pytest.raises(AssertionError, match="assert_matches_stored"):
            compare()
    # What must be exact stays exact: integers and booleans are not marked.
    assert torch.equal(stored["counts"], torch.tensor([3, 0]))
    assert torch.equal(stored["masks"][0], torch.tensor([True, False]))
    # Arithmetic on a stored tensor gives a plain one, and plain() unmarks.
    assert type(w * 2) is torch.Tensor and type(plain(w)) is torch.Tensor
    assert torch.equal(plain(w), torch.tensor([1.0, -2.0]))


def test_a_stored_reference_matches_within_its_tolerance_and_integers_exactly(stored):
    got = {"weights": {"w": torch.tensor([1.0 + 1.5e-6, -2.0])}, "counts": torch.tensor([3, 0]),
           "masks": [torch.tensor([True, False])], "file": "a.yaml"}  # fmt: skip
    assert_matches_stored(got, stored, rtol=0, atol=2e-6)
    with pytest.raises(AssertionError):
        assert_matches_stored(got, stored, rtol=0, atol=1e-6)
    with pytest.raises(AssertionError):  # rtol scales with the stored value
        assert_matches_stored(got, stored, rtol=1e-6, atol=0)
    assert_matches_stored(got, stored, rtol=2e-6, atol=0)
    for key, wrong in (("counts", torch.tensor([2, 1])), ("counts", torch.tensor([3.0, 0.0])),
                       ("masks", [torch.tensor([True, True])]), ("file", "b.yaml")):  # fmt: skip
        with pytest.raises(AssertionError):
            assert_matches_stored({**got, key: wrong}, stored, rtol=1, atol=1)
    with pytest.raises(AssertionError):  # a missing key
        assert_matches_stored({k: v for k, v in got.items() if k != "file"}, stored, rtol=1, atol=1)


def test_a_plain_torch_load_of_a_stored_file_in_a_test_is_refused():
    reference = FIXTURES / "legacy" / "reference.pt"
    with pytest.raises(AssertionError, match="load_stored"):
        torch.load(reference, weights_only=True)
    with pytest.raises(AssertionError, match="load_stored"):
        torch.load(str(reference), weights_only=True)
    # Read as a reference, or as an input (a checkpoint to edit and resume from).
    marked = load_stored(reference, weights_only=True)["slsam"]["probs"]
    assert type(marked) is tolerance.StoredTensor
    assert type(load_input(reference, weights_only=True)["slsam"]["probs"]) is torch.Tensor


def test_every_stored_file_is_one_the_guard_sees():
    # The guard is on torch.load: a stored file of another kind (.json, .npz) would be read
    # around it. Such a file must get its reader in tests/tolerance.py first.
    stored = [p for p in FIXTURES.rglob("*") if p.is_file() and p.suffix != ".py"]
    assert len(stored) >= 10
    assert {p.suffix for p in stored} <= {".pt", ".ckpt"}, sorted(
        str(p) for p in stored if p.suffix not in (".pt", ".ckpt")
    )


def test_the_margin_record_measures_the_share_of_the_tolerance_used(tmp_path, monkeypatch):
    assert tolerance._share(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]), 0.0, 1.0) == 0.5
    assert tolerance._share(torch.tensor([2.0]), torch.tensor([1.0]), 1.0, 0.0) == 1.0
    assert tolerance._share(torch.tensor([float("nan")]), torch.tensor([1.0]), 1.0, 1.0) > 1e30
    # float32's assert_close defaults (rtol 1.3e-6, atol 1e-5) when none is given
    share = tolerance._close_share(torch.tensor([5e-6]), torch.tensor([0.0]), None, None)
    assert share == pytest.approx(0.5, rel=1e-6)
    monkeypatch.setattr(tolerance, "_FOLDER", str(tmp_path))
    assert tolerance.within(3e-7, 1e-6) and not tolerance.within(2e-6, 1e-6)
    # (the suite itself may be recording: this test's own approx comparisons land there too)
    rows = [json.loads(line) for f in tmp_path.glob("margins-*.jsonl")
            for line in f.read_text().splitlines()]  # fmt: skip
    rows = [r for r in rows if r["kind"] == "within"]
    assert [r["share"] for r in rows] == pytest.approx([0.3, 2.0])
    assert {r["site"].split(":")[0] for r in rows} == {"tests/test_tolerance.py"}
    sites = margins.read([str(tmp_path)])
    (site,) = [s for s in sites.values() if s["kind"] == "within"]
    assert site["shares"] == pytest.approx([0.3, 2.0])
