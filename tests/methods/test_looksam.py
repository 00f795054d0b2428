"""LookSAM (:mod:`lightning_slsam.methods.looksam`): SAM every k steps, the orthogonal
component reused in between, against an independent computation."""

from __future__ import annotations

import pytest
import torch
from probes import RHO, Recorder, gradients, setup_engine, shifted

from lightning_slsam import LookSAM
from lightning_slsam.methods.looksam import Lookahead


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
        for p, e in zip(net.parameters(), expected):  # the gradient the optimizer used
            torch.testing.assert_close(p.grad, e, atol=1e-6, rtol=1e-4)


def test_the_interval_names_each_steps_kind():
    assert [Lookahead(4, 0.7, 1e-12).kind(t) for t in range(9)] == ["sam", "reuse", "reuse",
                                                                    "reuse", "sam", "reuse",
                                                                    "reuse", "reuse",
                                                                    "sam"]  # fmt: skip
    assert {Lookahead(1, 0.7, 1e-12).kind(t) for t in range(10)} == {"sam"}
    # alpha=0: plain steps in between, nothing stored.
    assert Lookahead(3, 0.0, 1e-12).after_sam_step is None
    assert not Lookahead(3, 0.0, 1e-12).keeps_first_grads


@pytest.mark.parametrize(
    ("options", "name"),
    [({"interval": 0}, "interval"), ({"interval": 2.0}, "interval"),
     ({"interval": True}, "interval"), ({"alpha": -0.1}, "alpha")],
)  # fmt: skip
def test_the_options_are_checked_naming_them(options, name):
    with pytest.raises(ValueError, match=rf"^LookSAM: `{name}` must be"):
        LookSAM(**options)
