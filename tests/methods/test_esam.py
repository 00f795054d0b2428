"""ESAM (:mod:`lightning_slsam.methods.esam`): sampled layers perturbed, the second pass on
the sharpest half of the batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from probes import RHO, Recorder, setup_engine

from lightning_slsam import ESAM


def test_esam_perturbs_sampled_layers_and_second_pass_sees_the_sharpest_half():
    cb = ESAM(rho=RHO, seed=2)
    net, x, y, engine, opt = setup_engine(cb, n=16)
    pass1_layers = 0
    for _ in range(10):
        before_losses = F.cross_entropy(net(x), y, reduction="none").detach()
        rec = Recorder(net, x, y, per_sample=True)
        result = engine.train_step(rec, opt, batch_size=16)
        first, select, second = rec.passes
        assert first["index"] is None and select["index"] is None and not select["grad_enabled"]
        assert second["index"].numel() == 8  # half of the batch
        # The selection forward ran at the perturbed point; the chosen samples are those
        # whose loss rose most there.
        moved = copy.deepcopy(net)
        with torch.no_grad():
            for p, w in zip(moved.parameters(), select["weights"]):
                p.copy_(w)
            after_losses = F.cross_entropy(moved(x), y, reduction="none")
        expected = (after_losses - before_losses).topk(8).indices.sort().values
        assert second["index"].tolist() == expected.tolist()
        # Only the first pass's sampled tensors were perturbed; every layer was updated.
        sampled = first["trainable"]
        for w0, w1, on in zip(first["weights"], select["weights"], sampled):
            assert (not torch.equal(w0, w1)) == on
        assert bool(result.active_mask.all()) and all(second["trainable"])
        pass1_layers += sum(sampled)
    assert 20 <= pass1_layers <= 60  # about half of 8 tensors over 10 steps


def test_esam_without_per_sample_losses_fails_clearly_before_touching_weights():
    net, x, y, engine, opt = setup_engine(ESAM())
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match="needs per-sample losses"):
        engine.train_step(Recorder(net, x, y), opt, batch_size=32)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), before))
