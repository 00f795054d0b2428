"""Top-SL-SAM (:mod:`lightning_slsam.methods.top_slsam`): a dense first pass, then SAM on the
layers with the largest first-pass gradient norms, against an independent computation."""

from __future__ import annotations

import torch
from probes import RHO, Recorder, gradients, setup_engine, shifted

from lightning_slsam import TopSLSAM
from lightning_slsam.methods.top_slsam import TopKSelection


def test_k_is_the_rounded_share_of_the_layers_and_at_least_one():
    cb = TopSLSAM(layer_ratio=0.25, seed=0)
    _, _, _, engine, _ = setup_engine(cb)  # 8 tensors, 8 layers
    assert type(engine.selection) is TopKSelection and engine.selection.k == 2
    _, _, _, engine, _ = setup_engine(TopSLSAM(layer_ratio=0.01))
    assert engine.selection.k == 1
    _, _, _, engine, _ = setup_engine(TopSLSAM(layer_ratio=1.0))
    assert engine.selection.k == 8 and engine.selection.always_all


def test_second_pass_and_update_on_the_top_k_first_pass_norms():
    cb = TopSLSAM(rho=RHO, layer_ratio=0.25, seed=0)
    net, x, y, engine, opt = setup_engine(cb)
    for _ in range(4):
        g = gradients(net, x, y)
        norms = torch.stack([gi.norm() for gi in g])
        top = set(torch.topk(norms, 2).indices.tolist())
        kept = [i in top for i in range(len(g))]
        knorm = torch.sqrt(sum(g[i].square().sum() for i in top))
        ascent = [RHO * gi / knorm if on else torch.zeros_like(gi) for gi, on in zip(g, kept)]
        expected = gradients(shifted(net, ascent), x, y)
        before = [p.detach().clone() for p in net.parameters()]
        rec = Recorder(net, x, y)
        result = engine.train_step(rec, opt)
        first, second = rec.passes
        assert all(first["trainable"]) and second["trainable"] == kept  # dense, then top 2
        assert result.active_mask.tolist() == kept
        assert result.pass_numel[0] == result.trainable_numel > result.pass_numel[1]
        for a, b, e in zip(first["weights"], second["weights"], ascent):
            torch.testing.assert_close(b - a, e, atol=1e-6, rtol=1e-4)
        for p, w0, e, on in zip(net.parameters(), before, expected, kept):
            if on:  # updated with the gradient at the perturbed point
                torch.testing.assert_close(p.grad, e, atol=1e-6, rtol=1e-4)
            else:
                assert torch.equal(p.detach(), w0)
