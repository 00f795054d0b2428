"""ESAM (:mod:`lightning_slsam.methods.esam`): sampled layers perturbed, the second pass on
the sharpest half of the batch."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp
from probes import RHO, Recorder, setup_engine
from tolerance import within

from lightning_slsam import ESAM
from lightning_slsam.core.passes import PassOutput
from lightning_slsam.methods.esam import ESAMSpec, SharpestSamples


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


# -- the official code (github.com/dydjw9/Efficient_SAM, utils/Esam.py) ----------------------

DOCS = Path(__file__).resolve().parents[2] / "docs" / "paper-and-code.md"


def documented(heading: str, **names):
    """The ``callback`` that the Python block of the docs' section ``heading`` builds from
    the official code's flags ``names``."""
    section = DOCS.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    scope = dict(names)
    exec(re.search(r"```python\n(.*?)```", section, re.S).group(1), scope)
    return scope["callback"]


def official_esam_step(net, optimizer, x, y, *, rho, beta, gamma, perturbed, eps=1e-7):
    """``ESAM.step`` of the official utils/Esam.py (lines 67-121), transcribed.

    Which tensors the first pass differentiates is the previous step's draw there
    (``random.random() > beta`` freezes a tensor, line 60; the very first step runs on all);
    here it is ``perturbed``. Returns the indices of the second pass's samples.
    """
    params = list(net.parameters())
    for p, on in zip(params, perturbed):
        p.requires_grad_(on)
    loss = F.cross_entropy(net(x), y, reduction="none")  # lines 75-82
    l_before = loss.detach().clone()
    loss.mean().backward()
    with torch.no_grad():  # first_step, lines 22-39
        grad_norm = torch.norm(
            torch.stack([p.grad.norm(p=2) for p in params if p.grad is not None]), p=2
        )  # _grad_norm, lines 123-136
        scale = rho / (grad_norm + eps) / beta  # line 26
        e_w = {}
        for p in params:
            p.requires_grad_(True)
            if p.grad is None:
                continue
            e_w[p] = p.grad * scale
            p.add_(e_w[p] * 1)
    optimizer.zero_grad()
    with torch.no_grad():  # lines 88-104
        instance_sharpness = F.cross_entropy(net(x), y, reduction="none") - l_before
        if gamma >= 0.99:
            indices = torch.ones_like(y, dtype=torch.bool)
        else:
            position = int(len(y) * gamma)
            cutoff = torch.topk(instance_sharpness, position)[0][-1]
            indices = instance_sharpness > cutoff
    F.cross_entropy(net(x[indices]), y[indices], reduction="none").mean().backward()
    with torch.no_grad():  # second_step, lines 53-65
        for p, e in e_w.items():
            p.sub_(e)
    optimizer.step()
    optimizer.zero_grad()
    return indices.nonzero().flatten()


def _sgd(net):
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)


def test_the_documented_options_reproduce_the_official_esam_step():
    # The official code's flags (its run.sh uses --beta 0.5 --gamma 0.5), a float64 model.
    rho, beta, gamma, n = 0.05, 0.5, 0.5, 16
    start = make_mlp().double()
    batches = [
        tuple(t.double() if t.is_floating_point() else t for t in make_data(n, seed=s).tensors)
        for s in range(5)
    ]

    def ours(cb):
        net = copy.deepcopy(start)
        opt, engine = _sgd(net), cb.spec.build_engine(net, seed=3)
        draws, kept, weights = [], [], []
        for x, y in batches:
            rec = Recorder(net, x, y, per_sample=True)
            engine.train_step(rec, opt, batch_size=n)
            draws.append(rec.passes[0]["trainable"])
            kept.append(rec.passes[-1]["index"].tolist())
            weights.append([p.detach().clone() for p in net.parameters()])
        return draws, kept, weights

    def official(draws, eps):
        net = copy.deepcopy(start)
        opt, kept, weights = _sgd(net), [], []
        for (x, y), drawn in zip(batches, draws):
            chosen = official_esam_step(
                net, opt, x, y, rho=rho, beta=beta, gamma=gamma, perturbed=drawn, eps=eps
            )
            kept.append(chosen.tolist())
            weights.append([p.detach().clone() for p in net.parameters()])
        return kept, weights

    def gap(a, b):
        return max(float((u - v).abs().max()) for wa, wb in zip(a, b) for u, v in zip(wa, wb))

    cb = documented("ESAM and its official code", ESAM=ESAM, rho=rho, beta=beta, gamma=gamma, n=n)
    draws, kept, weights = ours(cb)
    assert any(0 < sum(d) < len(d) for d in draws)  # some steps perturb part of the layers
    # With the project's constant added to the gradient norm (1e-12), the steps are equal.
    ref_kept, ref_weights = official(draws, eps=1e-12)
    assert kept == ref_kept and {len(k) for k in kept} == {int(gamma * n) - 1}  # 7 of 16
    assert within(gap(weights, ref_weights), 1e-10)
    # The official constant (1e-7) changes the radius by a relative 1e-7 / ||g||.
    official_gap = gap(weights, official(draws, eps=1e-7)[1])
    assert official_gap > 0 and within(official_gap, 1e-7)
    # ESAM at the flags' own values is another method: twice the radius, one sample more.
    draws, kept, weights = ours(ESAM(rho=rho, weight_ratio=beta, data_ratio=gamma))
    assert {len(k) for k in kept} == {int(gamma * n)}
    assert gap(weights, official(draws, eps=1e-12)[1]) > 1e-4


@pytest.mark.parametrize("gamma", [0.5, 0.3, 0.75])
def test_the_documented_data_ratio_keeps_what_the_official_selection_keeps(gamma):
    # The official rule keeps the samples strictly above the int(gamma * n)-th largest
    # sharpness (utils/Esam.py lines 97-104): int(gamma * n) - 1 of them.
    for n in range(max(8, int(2 / gamma) + 1), 1025):
        spec = documented("ESAM and its official code", ESAM=ESAMSpec, rho=0.05, beta=0.5,
                          gamma=gamma, n=n)  # fmt: skip
        sharpness = torch.randperm(n, generator=torch.Generator().manual_seed(n)).double()
        first = PassOutput(torch.tensor(0.0), [torch.zeros(n, dtype=torch.float64)])
        chosen = SharpestSamples(spec.data_ratio).select(
            first, lambda backward, s=sharpness: PassOutput(torch.tensor(0.0), [s])
        )[0]
        cutoff = torch.topk(sharpness, int(n * gamma))[0][-1]
        assert chosen.tolist() == (sharpness > cutoff).nonzero().flatten().tolist(), n
