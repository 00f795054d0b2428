"""The method combinations the measurements run (examples/methods.py): SL-SAM's draw with
SAF's step."""

from __future__ import annotations

import torch

from examples.methods import SLSAMSAF, SLSAMSAFSpec, registered
from lightning_slsam import METHODS, make_callback
from lightning_slsam.methods.saf import SAFSpec


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _train(spec, steps: int = 6):
    # Two batches of 8 samples, each visited once per "epoch": SAF's term from the second.
    net = _net()
    engine = spec.build_engine(net, seed=0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)
    results = []
    for step in range(steps):
        index = torch.arange(8) + 8 * (step % 2)

        def loss(index=index):
            logits = net(x[index])
            losses = torch.nn.functional.cross_entropy(logits, y[index], reduction="none")
            return {"loss": losses, "logits": logits, "index": index}

        before = [p.detach().clone() for p in net.parameters()]
        result = engine.train_step(loss, opt)
        changed = [not torch.equal(b, p) for b, p in zip(before, net.parameters())]
        results.append((result, changed))
    return net, engine, results


def test_on_every_layer_it_is_saf_bit_for_bit():
    # layer_ratio 1 under the paper's preset (no head rule, no update scaling): every layer
    # is drawn every step, and the step is SAF's, its term included.
    options = {"weight": 2.0, "delay": 1, "start_epoch": 0}
    a, _, _ = _train(SLSAMSAFSpec(layer_ratio=1.0, preset="paper", **options))
    b, _, _ = _train(SAFSpec(**options))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c, _, _ = _train(SAFSpec(**{**options, "weight": 0.0}))  # the term mattered
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_each_step_is_one_pass_on_the_drawn_layers_and_the_bandit_learns():
    spec = SLSAMSAFSpec(layer_ratio=0.5, preset="paper", delay=1, start_epoch=0)
    _, engine, results = _train(spec, steps=8)
    total = sum(p.numel() for p in _net().parameters())
    for result, changed in results:
        assert result.kind == "plain" and len(result.pass_numel) == 1
        assert result.pass_numel[0] < total  # the frozen layers computed no gradient
        assert changed == result.active_mask.tolist()  # only the drawn layers moved
    assert not torch.allclose(engine.selection.probs, torch.full((4,), 0.5, dtype=torch.float64))


def test_its_callback_is_known_by_name_only_inside_registered():
    assert "slsam_saf" not in METHODS
    with registered():
        callback = make_callback("slsam_saf", layer_ratio=0.3, weight=3.0)
        assert type(callback) is SLSAMSAF and METHODS["slsam_saf"][0] is SLSAMSAF
        assert (callback.spec.layer_ratio, callback.spec.weight) == (0.3, 3.0)
    assert "slsam_saf" not in METHODS
