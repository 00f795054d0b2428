"""SAM on every layer (:class:`~lightning_slsam.methods.spec.MethodSpec` as is): its defaults,
the steps it runs (the base :class:`~lightning_slsam.core.step.MethodParts`) and each step
against an independent computation."""

from __future__ import annotations

import pytest
import torch
from probes import RHO, Recorder, gradients, setup_engine, shifted

from lightning_slsam import SAM, SparseLayerSAM
from lightning_slsam.core.perturbation import ASAM_ETA
from lightning_slsam.core.step import STEP_KINDS, MethodParts
from lightning_slsam.methods.spec import MethodSpec


def test_asam_radius_and_eta_defaults():
    assert SAM().rho == 0.01 and SparseLayerSAM().rho == 0.01
    # rho=None (0.5 with adaptive=True) is retired: ASAM's reference radius is given.
    assert SAM(adaptive=True).rho == 0.01
    assert SparseLayerSAM(adaptive=True).rho == 0.01
    assert SAM(rho=0.5, adaptive=True).rho == 0.5
    assert SAM(rho=0.2, adaptive=True).rho == 0.2
    # ASAM's eta is its reference value.
    assert SAM(adaptive=True).spec.make_perturbation().eta == 0.01 == ASAM_ETA
    with pytest.raises(ValueError, match="`rho`"):
        SAM(rho=0.0)


def test_sam_runs_a_sam_step_every_step():
    assert {MethodParts().kind(t) for t in range(10)} == {"sam"}
    assert set(STEP_KINDS) == {"sam", "plain", "reuse", "single"}
    engine = MethodSpec().build_engine(torch.nn.Linear(4, 2), seed=0)
    assert type(engine.parts) is MethodParts and engine.selection.always_all
    assert engine.update_scale is None


def test_sam_step_uses_the_gradient_at_the_ascended_weights():
    cb = SAM(rho=RHO)
    net, x, y, engine, opt = setup_engine(cb)
    for _ in range(4):
        w = [p.detach().clone() for p in net.parameters()]
        g = gradients(net, x, y)
        gnorm = torch.sqrt(sum(gi.square().sum() for gi in g))
        ascent = [RHO * gi / gnorm for gi in g]
        expected = gradients(shifted(net, ascent), x, y)
        rec = Recorder(net, x, y)
        result = engine.train_step(rec, opt)
        assert result.kind == "sam" and result.num_backward == 2
        assert result.active_ratio == 2.0 and bool(result.active_mask.all())
        first, second = rec.passes
        for a, b, e in zip(first["weights"], second["weights"], ascent):
            torch.testing.assert_close(b - a, e, atol=1e-6, rtol=1e-4)
        for p, e in zip(net.parameters(), expected):  # the gradient the optimizer used
            torch.testing.assert_close(p.grad, e, atol=1e-6, rtol=1e-4)
        # The update started from the unperturbed weights (the exact restore).
        for p, w0, e in zip(net.parameters(), w, expected):
            torch.testing.assert_close(p.detach(), w0 - 0.1 * e, atol=1e-6, rtol=1e-5)
