"""The end of a step (:mod:`lightning_slsam.core.commit`): a non-finite pass skips the step
with weights, optimizer, selection and gradients untouched."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp
from probes import loss_closure

from lightning_slsam import LayerBandit, SAMPerturbation, SparseSAMEngine, build_partition


@pytest.mark.parametrize("bad_pass", [1, 2])
def test_non_finite_pass_skips_the_step_untouched(bad_pass):
    net = make_mlp()
    x, y = make_data(16).tensors
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    # One good step first so the optimizer has state to protect.
    partition = build_partition(net)
    bandit = LayerBandit(partition.num_layers, layer_ratio=0.5, alpha_p=0.1)
    engine = SparseSAMEngine(partition, bandit, SAMPerturbation(0.05))
    engine.train_step(loss_closure(net, x, y), opt)
    weights = [p.detach().clone() for p in net.parameters()]
    opt_state = copy.deepcopy(opt.state_dict())
    probs = bandit.probs.clone()

    calls = [0]

    def poisoned():  # the low-level protocol: forward, backward, detached loss
        calls[0] += 1
        loss = F.cross_entropy(net(x), y)
        if calls[0] == bad_pass:
            loss = loss * float("nan")
        loss.backward()
        return loss.detach()

    stepped = []
    with pytest.warns(RuntimeWarning, match="skipped"):
        result = engine.step(
            poisoned, lambda: opt.zero_grad(set_to_none=True), lambda skip: stepped.append(skip)
        )
    assert result.skipped and stepped == [True]
    assert f"{'first' if bad_pass == 1 else 'second'} pass" in result.skip_reason
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), weights))
    assert all(p.grad is None for p in net.parameters())
    assert torch.equal(bandit.probs, probs)
    torch.testing.assert_close(opt.state_dict(), opt_state, rtol=0, atol=0)
    assert engine.num_skipped == 1 and engine.num_steps == 2
