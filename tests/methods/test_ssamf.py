"""SSAM-F (:mod:`lightning_slsam.methods.ssamf`): the ascent on the top Fisher coordinates."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from probes import RHO, Recorder, gradients, setup_engine
from tolerance import within
from torch import nn

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
        assert engine.parts.kept_fraction() == round(flat.numel() * 0.5) / flat.numel()
        assert result.active_ratio == 2.0


# -- the official code (github.com/Mi-Peng/Sparse-Sharpness-Aware-Minimization) --------------

DOCS = Path(__file__).resolve().parents[2] / "docs" / "paper-and-code.md"


def documented(heading: str, **names):
    """The ``callback`` that the Python block of the docs' section ``heading`` builds from
    the official code's flags ``names``."""
    section = DOCS.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    scope = dict(names)
    exec(re.search(r"```python\n(.*?)```", section, re.S).group(1), scope)
    return scope["callback"]


class OfficialSSAMF:
    """The official ``SSAMF`` optimizer (solver/sam.py, lines 75-201) with the step of its
    training loop (utils/engine.py, lines 20-44), transcribed.

    Its ``update_mask`` draws ``num_samples`` training samples with a loader of its own
    (lines 126-135); here they are given to :meth:`step`. ``leftover``: the first sample's
    gradient adds to the SAM step's, still in ``.grad`` (``second_step()`` does not zero it,
    line 60), as there.
    """

    def __init__(self, net, rho, sparsity, num_samples, update_freq, eps=1e-7, leftover=True):
        self.net, self.params = net, list(net.parameters())
        self.base = torch.optim.SGD(self.params, lr=0.1, momentum=0.9, weight_decay=5e-4)
        self.rho, self.sparsity, self.eps = rho, sparsity, eps
        self.num_samples, self.update_freq, self.leftover = num_samples, update_freq, leftover
        self.mask = [torch.zeros_like(p) for p in self.params]  # init_mask, lines 110-114

    def step(self, x, y, epoch, batch_idx, fisher_samples):
        self.base.zero_grad()  # utils/engine.py, lines 30-34
        F.cross_entropy(self.net(x), y).backward()
        with torch.no_grad():  # first_step, lines 166-177
            grad_norm = torch.norm(torch.stack([p.grad.norm(p=2) for p in self.params]), p=2)
            scale = self.rho / (grad_norm + self.eps)
            e_w = [p.grad * scale * m for p, m in zip(self.params, self.mask)]
            torch._foreach_add_(self.params, e_w)
        self.base.zero_grad()
        F.cross_entropy(self.net(x), y).backward()  # the closure, line 59
        with torch.no_grad():  # second_step, lines 44-51 (no zero_grad)
            torch._foreach_sub_(self.params, e_w)
        self.base.step()
        if epoch % self.update_freq == 0 and batch_idx == 0:  # lines 188-190
            self.update_mask(*fisher_samples)

    def update_mask(self, xs, ys):  # lines 116-165
        if not self.leftover:
            self.net.zero_grad()
        fisher = [torch.zeros_like(p) for p in self.params]
        for idx in range(len(ys)):
            if idx >= self.num_samples:
                break
            F.cross_entropy(self.net(xs[idx : idx + 1]), ys[idx : idx + 1]).backward()
            for f, p in zip(fisher, self.params):
                f += torch.square(p.grad)
            self.net.zero_grad()
        flat = torch.cat([f.flatten() for f in fisher])
        keep_num = int(len(flat) * (1 - self.sparsity))
        mask = torch.zeros_like(flat).scatter_(0, torch.topk(flat, keep_num)[1], 1.0)
        self.mask = [
            m.view_as(p) for m, p in zip(mask.split([p.numel() for p in self.params]), self.params)
        ]


def test_the_official_ssamf_run_is_one_plain_step_then_the_documented_callback():
    rho, sparsity, num_samples, update_freq, steps_per_epoch = 0.05, 0.5, 4, 2, 3
    gen = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randn(8, 6, generator=gen, dtype=torch.float64),
            torch.randint(0, 4, (8,), generator=gen),
        )
        for _ in range(1 + 4 * update_freq * steps_per_epoch)
    ]
    torch.manual_seed(0)
    start = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()  # 92 weights

    def official(eps, leftover=False):
        net = copy.deepcopy(start)
        opt = OfficialSSAMF(net, rho, sparsity, num_samples, update_freq, eps, leftover)
        weights, masks = [], []
        for t, (x, y) in enumerate(batches[:-1]):
            masks.append(opt.mask)  # the mask of step t
            # The samples of its own loader: here the next batch's first ones.
            opt.step(x, y, t // steps_per_epoch, t % steps_per_epoch, batches[t + 1])
            weights.append([p.detach().clone() for p in net.parameters()])
        return weights, masks

    def ours(cb):
        net = copy.deepcopy(start)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
        F.cross_entropy(net(batches[0][0]), batches[0][1]).backward()  # one plain step
        opt.step()
        engine = cb.spec.build_engine(net, seed=0)
        weights = [[p.detach().clone() for p in net.parameters()]]
        masks = [[torch.zeros_like(p) for p in net.parameters()]]
        for x, y in batches[1:-1]:
            closure = lambda index=None, x=x, y=y: F.cross_entropy(  # noqa: E731
                net(x if index is None else x[index]), y if index is None else y[index]
            )
            engine.train_step(closure, opt, batch_size=len(y))
            weights.append([p.detach().clone() for p in net.parameters()])
            masks.append(engine.parts.masks_for(list(net.parameters())))
        return weights, masks

    def gap(a, b):
        return max(float((u - v).abs().max()) for wa, wb in zip(a, b) for u, v in zip(wa, wb))

    cb = documented("SSAM-F and its official code", SSAMF=SSAMF, rho=rho, sparsity=sparsity,
                    num_samples=num_samples, update_freq=update_freq,
                    steps_per_epoch=steps_per_epoch)  # fmt: skip
    weights, masks = ours(cb)
    ref_weights, ref_masks = official(eps=1e-12)
    # The same mask at every step (none at the first, then 46 of the 92 weights, refreshed
    # after official steps 0, 6, 12 and 18) and the same weights after every step, with the
    # project's constant added to the norm.
    flat = [torch.cat([m.flatten() for m in ms]).tolist() for ms in masks]
    assert flat == [torch.cat([m.flatten() for m in ms]).tolist() for ms in ref_masks]
    assert [int(sum(f)) for f in flat] == [0] + [46] * (len(flat) - 1)
    assert len({tuple(f) for f in flat}) == 5
    assert within(gap(weights, ref_weights), 1e-10)
    # The official constant (1e-7) changes the radius by a relative 1e-7 / ||g||.
    official_gap = gap(weights, official(eps=1e-7)[0])
    assert official_gap > 0 and within(official_gap, 1e-7)
    # The official first Fisher sample carries the SAM step's gradient: another mask.
    assert gap(weights, official(eps=1e-12, leftover=True)[0]) > 1e-4
    # Reading `update_freq` as steps refreshes on another schedule: another run.
    mistaken = SSAMF(
        rho=rho, sparsity=sparsity, fisher_samples=num_samples, mask_interval=update_freq
    )
    assert gap(ours(mistaken)[0], ref_weights) > 1e-6
