"""How the tests compare numbers: the one place for the rule.

1. **Bit for bit only within one run.** ``torch.equal`` compares two computations made in
   the same test run, on this machine: a resumed run against the uninterrupted one, one
   process against two, a method against its hand-written form.
2. **A stored reference gets a tolerance.** Numbers read from a file (``tests/fixtures``)
   or made on another machine were rounded by that machine's kernels: float32 matmuls
   summed in another order differ in the last bits (measured on the saved-config fixture
   after 6 AdamW steps, on an AMD EPYC against the machine that wrote it: up to 2.5e-7,
   4.5e-6 where LookSAM's reuse step amplifies it).
   :func:`load_stored` marks every floating-point tensor of a stored file, and a marked
   tensor refuses ``torch.equal`` and ``==``: it is compared with
   :func:`assert_matches_stored`, whose tolerance is stated beside the call. What must be
   exact stays exact: integer and boolean tensors (draws, masks, counts, step kinds) are
   not marked and compare with ``torch.equal``.
3. **A tolerance leaves room.** No comparison should use more than a tenth of its
   tolerance on any machine the suite has run on. Runs compared across code paths that sum
   in another order step with SGD (``helpers.linear_sgd``): AdamW divides each update by
   its gradient's root mean square and turns a near-zero gradient's last bits into a step
   of up to the learning rate. An offset read off float32 weights (``after - before``)
   carries an ulp of the weight (:func:`offset_atol`); a run in another precision is held
   to the float32 run's update (:func:`update_gap`). With ``SLSAM_TEST_MARGINS=<folder>``
   set, every comparison made through ``torch.allclose``, ``torch.testing.assert_close``,
   ``numpy.testing.assert_allclose``, ``pytest.approx`` or :func:`within` writes the share
   of its tolerance it used there (``tests/margins.py`` reads them back).

``tests/test_tolerance.py`` holds the rule: a test that reads a stored file with
``torch.load`` instead of :func:`load_stored` (or :func:`load_input`, for a checkpoint a
run resumes from) fails (:func:`guard_stored_loads`), and so does one that compares a
stored float bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

TESTS = Path(__file__).resolve().parent
FIXTURES = TESTS / "fixtures"


#: A stored run of the tests' small MLP (a few AdamW steps at lr 1e-2, 6 in both fixtures)
#: against today's: weights within ``atol + rtol * |stored|``. Measured on an AMD EPYC
#: (AVX-512) against the machine that wrote the fixtures, under its default kernels,
#: ATEN_CPU_CAPABILITY=default/avx2, torch.backends.mkldnn off and 1 or 2 threads: at most
#: 2.7e-7 (0.03 of this tolerance) over the 40 saved-config runs and the 8 legacy checkpoints.
STORED_RUN = {"rtol": 1e-4, "atol": 1e-5}
#: LookSAM's reuse steps add the orthogonal part g_v of the last SAM gradient scaled by
#: ``||g|| / ||g_v||``, which amplifies g_v's rounding: measured at most 4.5e-6 (0.05 of
#: this tolerance; 0.45 of the one above).
STORED_LOOKSAM_RUN = {"rtol": 1e-3, "atol": 1e-4}
#: The selection's probabilities (float64) follow the per-layer gradient norms, so their
#: rounding too: measured at most 1.7e-9.
STORED_PROBS = {"rtol": 0.0, "atol": 1e-7}


def stored_run_tolerance(method: str) -> dict[str, float]:
    """:data:`STORED_LOOKSAM_RUN` for LookSAM and SL-SAM + LookSAM (a method name or a
    callback's class path), else :data:`STORED_RUN`."""
    return STORED_LOOKSAM_RUN if "looksam" in method.lower() else STORED_RUN


class StoredTensor(torch.Tensor):
    """A floating-point tensor read from a stored reference: a tolerance, not bits."""

    _REFUSED = {torch.equal, torch.eq, torch.Tensor.eq, torch.Tensor.__eq__, torch.Tensor.ne,
                torch.Tensor.__ne__, torch.ne}  # fmt: skip

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls._REFUSED:
            raise AssertionError(
                "a stored reference was compared bit for bit: floats read from a file were "
                "rounded by another machine's kernels; compare them with "
                "tests/tolerance.py's assert_matches_stored(got, stored, rtol=..., atol=...), "
                "stating the tolerance beside the call"
            )
        result = super().__torch_function__(func, types, args, kwargs or {})
        # Arithmetic on a stored tensor gives plain tensors (only the file's values are marked).
        return _unmark(result)


def _unmark(value: Any) -> Any:
    if isinstance(value, StoredTensor):
        return value.as_subclass(torch.Tensor)
    if isinstance(value, tuple | list):
        return type(value)(_unmark(v) for v in value)
    return value


def _mark(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not isinstance(value, StoredTensor):
        return value.as_subclass(StoredTensor) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _mark(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_mark(v) for v in value)
    return value


def load_stored(path: str | Path, **kwargs: Any) -> Any:
    """``torch.load`` of a stored reference, its floating-point tensors marked."""
    return _mark(_LOAD(path, **kwargs))


def load_input(path: str | Path, **kwargs: Any) -> Any:
    """``torch.load`` of a stored file a test uses as input, not as a reference (a
    checkpoint to edit and resume from): its tensors unmarked."""
    return _LOAD(path, **kwargs)


_LOAD = torch.load


def guard_stored_loads() -> None:
    """Refuse a plain ``torch.load`` of a file under ``tests/fixtures`` written in a test:
    a stored reference is read with :func:`load_stored`, an input with :func:`load_input`.
    (Lightning's own load of a fixture it resumes from is not a comparison: allowed.)"""

    def guarded(f, *args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_code.co_filename
        if (
            isinstance(f, str | os.PathLike)
            and Path(f).resolve().is_relative_to(FIXTURES)
            and caller.startswith(str(TESTS))
            and caller != __file__
        ):
            raise AssertionError(
                f"{Path(caller).name} reads the stored file {Path(f).name} with torch.load: "
                "read a reference with tests/tolerance.py's load_stored (its floats then "
                "compare within a stated tolerance), or an input with load_input"
            )
        return _LOAD(f, *args, **kwargs)

    torch.load = guarded


def plain(value: Any) -> torch.Tensor:
    """A stored tensor as a plain one (for code that needs its values, not a comparison)."""
    return _unmark(value)


def assert_matches_stored(
    got: Any, stored: Any, *, rtol: float, atol: float, what: str = ""
) -> None:
    """``got`` equals a stored reference: floats within ``atol + rtol * |stored|``,
    integers, booleans and everything else exactly. Nested dicts and lists compare key by
    key."""
    if isinstance(stored, dict):
        assert isinstance(got, dict) and set(got) == set(stored), what
        for k in stored:
            assert_matches_stored(got[k], stored[k], rtol=rtol, atol=atol, what=f"{what}[{k}]")
        return
    if isinstance(stored, list | tuple):
        assert len(got) == len(stored), what
        for i, (g, s) in enumerate(zip(got, stored, strict=True)):
            assert_matches_stored(g, s, rtol=rtol, atol=atol, what=f"{what}[{i}]")
        return
    if isinstance(stored, torch.Tensor) and stored.is_floating_point():
        torch.testing.assert_close(got, plain(stored), rtol=rtol, atol=atol, msg=what or None)
        return
    if isinstance(stored, torch.Tensor):
        assert got.dtype == stored.dtype and torch.equal(got, stored), what
        return
    assert got == stored, what


def offset_atol(*weights: torch.Tensor, ulps: int = 16) -> float:
    """The absolute tolerance of an offset read off float32 weights (``after - before``,
    a perturbation or an update): ``after`` was rounded to the nearest float, so the offset
    carries up to half an ulp of ``max |w|`` however small it is. ``ulps`` of them: such a
    comparison uses at most 1/32 of its tolerance."""
    eps = torch.finfo(torch.float32).eps
    return ulps * eps * max(float(plain(w).abs().max()) for w in weights)


def update_gap(weights: dict, reference: dict, start: dict) -> float:
    """How far a run ended from a reference run, in units of the reference's update:
    ``||w - w_ref|| / ||w_ref - w_start||`` over all tensors together (names may carry a
    ``net.`` prefix). For a run in another precision, whose rounding scales with what the
    update moved, not with the weights' last bits: a lost update, or one applied twice, is
    a gap of 1."""

    def flat(d: dict) -> dict:
        return {k.removeprefix("net."): plain(v).detach().float() for k, v in d.items()}

    w, ref, w0 = flat(weights), flat(reference), flat(start)
    gap = torch.sqrt(sum(((w[k] - ref[k]) ** 2).sum() for k in ref))
    moved = torch.sqrt(sum(((ref[k] - w0[k]) ** 2).sum() for k in ref))
    return float(gap / moved)


#: bfloat16 runs against float32 ones (3 steps of the tests' MLP, linear_sgd; under DDP and
#: on one device): the update gap. bf16-mixed computes in bfloat16: measured at most
#: 0.0044. bf16-true also holds the weights in bfloat16 (8 bits), rounding every update:
#: measured at most 0.072 (0.066 with the default preset's update scaling); 0.75 is 10
#: times that, under the gap of 1 that a lost or doubled update makes. Two methods change
#: what they compute in bfloat16, and their weights are not held to these: LookSAM's reuse
#: step scales bfloat16's rounding of g_v by ||g|| / ||g_v|| (gap 0.14-0.22), ESAM picks
#: its samples by bfloat16 per-sample losses (0.12-0.47).
BF16_UPDATE_GAP = {"bf16-mixed": 0.05, "bf16-true": 0.75}
#: The methods whose weights bfloat16 changes beyond its rounding (above).
BF16_CHANGES = ("looksam", "slsam_looksam", "esam")


def within(value: float, limit: float) -> bool:
    """``value < limit`` for a measured difference against its tolerance, recorded as a
    share of the tolerance when margins are being recorded."""
    value = float(value)
    _record("within", value / limit if limit else math.inf)
    return value < limit


# -- the margin record (SLSAM_TEST_MARGINS) ----------------------------------------------------

_FOLDER = os.environ.get("SLSAM_TEST_MARGINS")


def _site() -> str:
    """The first frame in a test file: where the comparison is written."""
    frame = sys._getframe(2)
    here = str(Path(__file__))
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(str(TESTS)) and name != here and "/fixtures/" not in name:
            return f"{Path(name).relative_to(TESTS.parent)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _record(kind: str, share: float) -> None:
    if _FOLDER is None:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    row = {"test": test, "site": _site(), "kind": kind, "share": share}
    with open(Path(_FOLDER) / f"margins-{os.getpid()}.jsonl", "a") as handle:
        handle.write(json.dumps(row) + "\n")


def _share(actual: Any, expected: Any, rtol: float, atol: float) -> float:
    """max |actual - expected| / (atol + rtol * |expected|) (0 where both are equal)."""
    with torch.no_grad():
        a = torch.as_tensor(plain(actual)).detach().to("cpu", torch.float64)
        e = torch.as_tensor(plain(expected)).detach().to("cpu", torch.float64)
        diff = (a - e).abs()
        finite = torch.isfinite(diff)
        same = (a == e) | (torch.isnan(a) & torch.isnan(e))
        if not bool((finite | same).all()):
            return math.inf
        share = torch.where(same, 0.0, diff / (atol + rtol * e.abs()))
        return float(share.max()) if share.numel() else 0.0


_DEFAULTS = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5),
             torch.float32: (1.3e-6, 1e-5), torch.float64: (1e-7, 1e-7)}  # fmt: skip


def _close_share(actual: Any, expected: Any, rtol: float | None, atol: float | None) -> float:
    if isinstance(expected, dict):
        return max((_close_share(actual[k], expected[k], rtol, atol) for k in expected), default=0)
    if isinstance(expected, list | tuple) and not all(isinstance(v, int | float) for v in expected):
        pairs = zip(actual, expected, strict=True)
        return max((_close_share(a, e, rtol, atol) for a, e in pairs), default=0)
    if rtol is None:
        dtype = expected.dtype if isinstance(expected, torch.Tensor) else torch.float64
        rtol, atol = _DEFAULTS.get(dtype, (0.0, 0.0))
    return _share(actual, expected, rtol, atol)


def install_margin_record() -> None:
    """Record the share of its tolerance every comparison uses (``SLSAM_TEST_MARGINS``)."""
    if _FOLDER is None:
        return
    import _pytest.approx
    import numpy

    allclose, assert_close = torch.allclose, torch.testing.assert_close
    np_assert_allclose = numpy.testing.assert_allclose

    def recorded_allclose(input, other, rtol=1e-5, atol=1e-8, equal_nan=False):
        _record("allclose", _share(input, other, rtol, atol))
        return allclose(input, other, rtol=rtol, atol=atol, equal_nan=equal_nan)

    def recorded_assert_close(actual, expected, *args, rtol=None, atol=None, **kwargs):
        with contextlib.suppress(Exception):  # shapes or types the comparison reports
            _record("assert_close", _close_share(actual, expected, rtol, atol))
        return assert_close(actual, expected, *args, rtol=rtol, atol=atol, **kwargs)

    def recorded_np_assert_allclose(actual, desired, rtol=1e-7, atol=0, *args, **kwargs):
        with contextlib.suppress(Exception):
            _record("assert_allclose", _share(actual, desired, rtol, atol))
        return np_assert_allclose(actual, desired, rtol, atol, *args, **kwargs)

    scalar_eq = _pytest.approx.ApproxScalar.__eq__

    def recorded_eq(self, actual):
        result = scalar_eq(self, actual)
        try:
            tolerance = self.tolerance
            gap = abs(self.expected - actual)
            share = 0.0 if gap == 0 else (gap / tolerance if tolerance else math.inf)
            _record("approx", float(share))
        except Exception:  # non-numeric values: compared exactly
            pass
        return result

    torch.allclose = recorded_allclose
    numpy.testing.assert_allclose = recorded_np_assert_allclose
    torch.testing.assert_close = recorded_assert_close
    _pytest.approx.ApproxScalar.__eq__ = recorded_eq
