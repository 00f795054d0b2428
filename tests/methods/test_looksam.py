"""LookSAM (:mod:`lightning_slsam.methods.looksam`): SAM every k steps, the orthogonal
component reused in between, against an independent computation."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from probes import RHO, Recorder, gradients, setup_engine, shifted

from lightning_slsam import LookSAM, SLSAMLookSAM
from lightning_slsam.methods.looksam import AMPLIFICATION_LIMIT, Lookahead, amplification_message

TABLE = Path(__file__).parents[2] / "docs" / "results" / "looksam_alpha" / "amplification.json"


def _first_ratio(net, x, y):
    """``||g_v|| / ||g||`` of the first SAM step, computed independently."""
    g = gradients(net, x, y)
    gnorm = torch.sqrt(sum(gi.square().sum() for gi in g))
    g_s = gradients(shifted(net, [RHO * gi / gnorm for gi in g]), x, y)
    inner = sum((a * b).sum() for a, b in zip(g, g_s))
    g_v = [b - inner / gnorm**2 * a for a, b in zip(g, g_s)]
    return float(torch.sqrt(sum(v.square().sum() for v in g_v)) / gnorm)


def _run(cb, steps):
    """``steps`` steps of ``cb``'s engine; the LookSAM warnings they raised."""
    net, x, y, engine, opt = setup_engine(cb)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            engine.train_step(Recorder(net, x, y), opt)
    return engine, [str(w.message) for w in caught if "LookSAM:" in str(w.message)]


def test_looksam_full_passes_every_k_steps_and_reuses_the_orthogonal_component():
    cb = LookSAM(rho=RHO, interval=3, alpha=0.7)
    net, x, y, engine, opt = setup_engine(cb)
    g_v = None
    for step in range(7):
        g = gradients(net, x, y)
        if step % 3 == 0:
            gnorm = torch.sqrt(sum(gi.square().sum() for gi in g))
            g_s = gradients(shifted(net, [RHO * gi / gnorm for gi in g]), x, y)
            inner = sum((a * b).sum() for a, b in zip(g, g_s))
            g_v = [b - inner / gnorm**2 * a for a, b in zip(g, g_s)]
            expected = g_s
        else:
            ratio = torch.sqrt(sum(gi.square().sum() for gi in g)) / torch.sqrt(
                sum(v.square().sum() for v in g_v)
            )
            expected = [gi + 0.7 * ratio * v for gi, v in zip(g, g_v)]
        result = engine.train_step(Recorder(net, x, y), opt)
        assert result.kind == ("sam" if step % 3 == 0 else "reuse")
        assert result.num_backward == (2 if step % 3 == 0 else 1)
        # The gradient the optimizer used; the reuse step scales the rounding of g_v (a
        # difference of nearly parallel gradients) by 0.7 ||g|| / ||g_v||.
        for p, e in zip(net.parameters(), expected):
            torch.testing.assert_close(p.grad, e, atol=1e-5, rtol=1e-4)


def test_the_interval_names_each_steps_kind():
    assert [Lookahead(4, 0.7, 1e-12).kind(t) for t in range(9)] == ["sam", "reuse", "reuse",
                                                                    "reuse", "sam", "reuse",
                                                                    "reuse", "reuse",
                                                                    "sam"]  # fmt: skip
    assert {Lookahead(1, 0.7, 1e-12).kind(t) for t in range(10)} == {"sam"}
    # alpha=0: plain steps in between, nothing stored.
    parts = Lookahead(3, 0.0, 1e-12)
    assert not parts.keeps_first_grads
    w = torch.zeros(2)
    parts.after_sam_step(None, [w], [], [w], [torch.ones(2)])
    assert parts.vertical == {}


@pytest.mark.parametrize(
    ("options", "name"),
    [({"interval": 0}, "interval"), ({"interval": 2.0}, "interval"),
     ({"interval": True}, "interval"), ({"alpha": -0.1}, "alpha")],
)  # fmt: skip
def test_the_options_are_checked_naming_them(options, name):
    with pytest.raises(ValueError, match=rf"^LookSAM: `{name}` must be"):
        LookSAM(**options)


def test_the_first_sam_step_measures_the_orthogonal_ratio_and_warns_above_the_limit():
    net, x, y, _, _ = setup_engine(LookSAM(rho=RHO))
    ratio = _first_ratio(net, x, y)
    # alpha just over the limit: one warning, at the first SAM step only (interval 3, 7 steps)
    over = AMPLIFICATION_LIMIT * ratio * 1.05
    engine, said = _run(LookSAM(rho=RHO, interval=3, alpha=over), 7)
    assert engine.parts.orthogonal_ratio == pytest.approx(ratio, rel=1e-4)
    assert len(said) == 1
    assert f"was {ratio:.3g} of the gradient's norm" in said[0]
    assert f"{over / ratio:.0f} times what the SAM step added" in said[0]
    suggested = float(said[0].split("Options: alpha=")[1].split(" ")[0])
    assert 0.9 * AMPLIFICATION_LIMIT * ratio <= suggested <= AMPLIFICATION_LIMIT * ratio
    # just under it, or nothing reused: no warning; the ratio is measured all the same
    engine, said = _run(LookSAM(rho=RHO, interval=3, alpha=AMPLIFICATION_LIMIT * ratio * 0.95), 7)
    assert said == [] and engine.parts.orthogonal_ratio == pytest.approx(ratio, rel=1e-4)
    assert _run(LookSAM(rho=RHO, interval=3, alpha=0.0), 7)[1] == []
    # SL-SAM on LookSAM's interval runs the same parts: the check holds there too
    assert len(_run(SLSAMLookSAM(rho=RHO, interval=3, alpha=100.0, seed=0), 4)[1]) == 1


def test_the_message_says_the_alpha_that_stays_under_the_limit():
    assert amplification_message(0.7, 0.7 / AMPLIFICATION_LIMIT) is None  # at the limit
    assert amplification_message(0.0, 1e-6) is None
    assert amplification_message(0.7, 0.0) is None  # SAM's gradient parallel: nothing added
    text = amplification_message(0.7, 0.0403)
    assert text is not None and "alpha=0.7 of the gradient's norm" in text
    assert "docs/methods.md#looksam-on-a-pretrained-transformer-the-reuse-check" in text
    suggested = float(text.split("Options: alpha=")[1].split(" ")[0])
    assert suggested == pytest.approx(AMPLIFICATION_LIMIT * 0.0403, rel=0.1)
    assert suggested <= AMPLIFICATION_LIMIT * 0.0403


def test_the_limit_agrees_with_the_table_it_cites():
    # The committed table (examples/scripts/looksam_table.py): every LookSAM configuration
    # above the limit trained less than SAM beyond SAM's seed spread, and every one at or
    # under it matched SAM; both kinds of row are there, on more than one task.
    rows = json.loads(TABLE.read_text())["rows"]
    warned = [r for r in rows if r["amplification"] > AMPLIFICATION_LIMIT]
    quiet = [r for r in rows if r["amplification"] <= AMPLIFICATION_LIMIT]
    assert len(warned) >= 2 and len(quiet) >= 3
    assert [r["label"] for r in warned if r["matches_sam"]] == []
    assert [r["label"] for r in quiet if not r["matches_sam"]] == []
    assert len({r["task"] for r in quiet}) >= 2 and all(r["n"] >= 3 for r in rows)
    # the line falls between every run of a matching configuration and every run of a losing
    # one (the check sees one run's first SAM step)
    quiet_runs = [s["amplification"] for r in quiet for s in r["per_seed"]]
    warned_runs = [s["amplification"] for r in warned for s in r["per_seed"]]
    assert max(quiet_runs) <= AMPLIFICATION_LIMIT < min(warned_runs)
