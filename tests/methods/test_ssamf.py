"""SSAM-F (:mod:`lightning_slsam.methods.ssamf`): the ascent on the top Fisher coordinates."""

from __future__ import annotations

import pytest
import torch
from probes import RHO, Recorder, gradients, setup_engine

from lightning_slsam import SSAMF


def test_ssamf_perturbs_only_the_top_fisher_coordinates():
    cb = SSAMF(rho=RHO, sparsity=0.5, fisher_samples=8, mask_interval=3)
    net, x, y, engine, opt = setup_engine(cb, n=16)
    for step in range(5):
        w = [p.detach().clone() for p in net.parameters()]
        fisher = [torch.zeros_like(p) for p in net.parameters()]
        for i in range(8):
            for f, gi in zip(fisher, gradients(net, x[i : i + 1], y[i : i + 1])):
                f.add_(gi.square())
        rec = Recorder(net, x, y)
        result = engine.train_step(rec, opt, batch_size=16)
        refresh = step % 3 == 0
        assert result.extra_backward == (8 if refresh else 0)
        if refresh:
            flat = torch.cat([f.flatten() for f in fisher])
            chosen = torch.zeros_like(flat, dtype=torch.bool)
            chosen[flat.topk(round(flat.numel() * 0.5)).indices] = True
            mask = chosen.split([p.numel() for p in net.parameters()])
            mask = [m.view_as(p) for m, p in zip(mask, net.parameters())]
        offsets = [during - before for during, before in zip(rec.passes[-1]["weights"], w)]
        assert all(float(o[~m].abs().sum()) == 0 for o, m in zip(offsets, mask))
        moved = sum(int((o[m] != 0).sum()) for o, m in zip(offsets, mask))
        assert moved > 0.9 * sum(int(m.sum()) for m in mask)
        assert engine.method.kept_fraction() == pytest.approx(0.5, abs=1 / flat.numel())
        assert result.active_ratio == 2.0
