"""SL-S2-SAM (:mod:`lightning_slsam.methods.sl_s2sam`): single-step SAM on bandit-drawn layers,
each active layer perturbed along its own last gradient, after a dense plain first step."""

from __future__ import annotations

import torch
from probes import RHO, Recorder, setup_engine

from lightning_slsam import SLS2SAM, make_callback
from lightning_slsam.methods.s2sam import SingleStepParts
from lightning_slsam.selection.bandit import LayerBandit


def test_it_keeps_the_papers_preset():
    assert SLS2SAM().preset == "paper" and make_callback("sl_s2sam").preset == "paper"
    assert SLS2SAM().update_scale is None
    assert SLS2SAM(preset="default").update_scale == 3.0


def test_each_active_layer_perturbs_along_its_own_last_gradient():
    net, x, y, engine, opt = setup_engine(SLS2SAM(rho=RHO, layer_ratio=0.4, seed=1))
    assert type(engine.parts) is SingleStepParts and type(engine.selection) is LayerBandit
    last: dict[int, torch.Tensor] = {}
    params = list(net.parameters())
    for step in range(8):
        before = [p.detach().clone() for p in params]
        rec = Recorder(net, x, y)
        result = engine.train_step(rec, opt)
        (only,) = rec.passes
        mask = result.active_mask.tolist()
        assert result.num_backward == 1
        if step == 0:  # a plain step on every layer, not a draw: the bandit does not learn
            assert result.kind == "plain" and all(mask) and not result.drawn
            assert all(torch.equal(w, w0) for w, w0 in zip(only["weights"], before))
        else:
            assert result.kind == "single" and result.drawn and not all(mask)
            active = [i for i, on in enumerate(mask) if on]
            norm = torch.sqrt(sum(last[i].square().sum() for i in active))
            for i, (w, w0) in enumerate(zip(only["weights"], before)):
                e = RHO * last[i] / norm if mask[i] else torch.zeros_like(w0)
                torch.testing.assert_close(w - w0, e, atol=1e-6, rtol=1e-4)
        assert only["trainable"] == mask
        for i in (i for i, on in enumerate(mask) if on):
            last[i] = params[i].grad.clone()
    assert engine.selection.num_updates == 7
