"""S2-SAM (:mod:`lightning_slsam.methods.s2sam`): single steps after a plain first step, each
one pass at weights perturbed along the previous step's gradient, against an independent
computation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from probes import RHO, Recorder, gradients, setup_engine, shifted
from torch import nn

from lightning_slsam import S2SAM
from lightning_slsam.methods.s2sam import SingleStepParts


def _kinds(cb, steps=10):
    net = nn.Linear(3, 2)
    engine = cb.spec.build_engine(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    results = [engine.train_step(lambda: F.cross_entropy(net(x), y), opt) for _ in range(steps)]
    return results, engine


def test_single_step_parts_name_every_step_single():
    assert {SingleStepParts().kind(t) for t in range(10)} == {"single"}


def test_s2sam_runs_one_pass_per_step_after_a_plain_first_step():
    results, engine = _kinds(S2SAM(seed=0))
    assert type(engine.parts) is SingleStepParts
    assert [r.kind for r in results] == ["plain"] + ["single"] * 9
    assert all(r.num_backward == 1 for r in results)
    assert not results[0].drawn and all(r.drawn for r in results[1:])
    assert engine.kind_counts == {"plain": 1, "single": 9}


def test_each_step_perturbs_along_the_previous_steps_gradient():
    net, x, y, engine, opt = setup_engine(S2SAM(rho=RHO))
    previous = None
    for step in range(5):
        if previous is None:
            ascent = [torch.zeros_like(p) for p in net.parameters()]
        else:
            gnorm = torch.sqrt(sum(gi.square().sum() for gi in previous))
            ascent = [RHO * gi / gnorm for gi in previous]
        expected = gradients(shifted(net, ascent), x, y)
        before = [p.detach().clone() for p in net.parameters()]
        rec = Recorder(net, x, y)
        result = engine.train_step(rec, opt)
        assert result.kind == ("plain" if step == 0 else "single") and result.num_backward == 1
        (only,) = rec.passes
        for w, w0, e in zip(only["weights"], before, ascent):
            torch.testing.assert_close(w - w0, e, atol=1e-6, rtol=1e-4)
        for p, w0, e in zip(net.parameters(), before, expected):  # updated from w, not w + e
            torch.testing.assert_close(p.grad, e, atol=1e-6, rtol=1e-4)
            torch.testing.assert_close(p.detach(), w0 - 0.1 * e, atol=1e-6, rtol=1e-5)
        previous = expected
    assert set(engine.last_grad) == {id(p) for p in net.parameters()}
