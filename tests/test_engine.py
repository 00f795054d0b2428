"""The pure-PyTorch step: freezing, perturbation, restore, skips and the bandit's input."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp
from torch import nn

from lightning_slsam import (
    LayerBandit,
    LayerSelection,
    SAMPerturbation,
    SparseSAMEngine,
    build_partition,
)


class FixedSelection(LayerSelection):
    """A selection that returns a given mask and records what it is told."""

    def __init__(self, mask: list[bool]) -> None:
        self.mask = torch.tensor(mask)
        self.num_layers = len(mask)
        self.updates: list[tuple[torch.Tensor, torch.Tensor]] = []

    def sample(self) -> torch.Tensor:
        return self.mask.clone()

    def update(self, active, norms) -> bool:
        self.updates.append((active.clone(), norms.clone()))
        return True


def _loss(net, x, y, observe=None):
    """The forward pass for SparseSAMEngine.train_step, optionally watching the model."""

    def compute_loss():
        if observe is not None:
            observe(net)
        return F.cross_entropy(net(x), y)

    return compute_loss


def _engine(net, mask, rho=0.05, norm="global"):
    partition = build_partition(net)
    return SparseSAMEngine(partition, FixedSelection(mask), SAMPerturbation(rho, norm=norm))


def test_inactive_layers_frozen_before_forward_and_bandit_gets_first_pass_norms():
    net = make_mlp()
    x, y = make_data(16).tensors
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    mask = [True, False, False, True, True, False, True, False]
    seen = []
    engine = _engine(net, mask)
    expected = copy.deepcopy(net)
    F.cross_entropy(expected(x), y).backward()
    engine.train_step(
        _loss(net, x, y, observe=lambda m: seen.append([p.requires_grad for p in m.parameters()])),
        opt,
    )
    assert seen == [mask, mask]  # both forwards ran with exactly the sampled set trainable
    assert all(p.requires_grad for p in net.parameters())  # released after the step
    ((active, norms),) = engine.selection.updates
    assert active.tolist() == mask
    for i, p in enumerate(expected.parameters()):
        if mask[i]:
            assert norms[i].item() == pytest.approx(p.grad.norm().item(), rel=1e-6)


@pytest.mark.parametrize("norm", ["global", "layer"])
def test_perturbation_has_radius_rho_and_restore_is_exact(norm):
    net = make_mlp()
    x, y = make_data(16).tensors
    before = [p.detach().clone() for p in net.parameters()]
    mask = [True, True, False, False, True, False, False, True]
    offsets = []

    def observe(module):
        offsets.append([p.detach() - b for p, b in zip(module.parameters(), before)])

    grads_ref = copy.deepcopy(net)
    F.cross_entropy(grads_ref(x), y).backward()
    opt = torch.optim.SGD(
        net.parameters(), lr=0.0
    )  # lr 0: the step must leave weights as they were
    engine = _engine(net, mask, rho=0.1, norm=norm)
    engine.train_step(_loss(net, x, y, observe=observe), opt)

    first, second = offsets
    assert all(float(o.abs().max()) == 0 for o in first)
    perturbed = [second[i] for i in range(8) if mask[i]]
    assert all(float(second[i].abs().max()) == 0 for i in range(8) if not mask[i])
    grads = [p.grad for i, p in enumerate(grads_ref.parameters()) if mask[i]]
    if norm == "global":
        total = torch.sqrt(sum(e.square().sum() for e in perturbed))
        assert total.item() == pytest.approx(0.1, rel=1e-5)
        gnorm = torch.sqrt(sum(g.square().sum() for g in grads))
        for e, g in zip(perturbed, grads):
            torch.testing.assert_close(e, 0.1 * g / gnorm, rtol=1e-4, atol=1e-7)
    else:
        for e, g in zip(perturbed, grads):  # one tensor per layer here
            assert e.norm().item() == pytest.approx(0.1, rel=1e-5)
            torch.testing.assert_close(e, 0.1 * g / g.norm(), rtol=1e-4, atol=1e-7)
    for p, b in zip(net.parameters(), before):
        assert torch.equal(p, b)  # exact restore, then an lr=0 step


def test_backup_holds_only_the_active_tensors():
    params = [nn.Parameter(torch.randn(4, 4)) for _ in range(5)]
    grads = [torch.randn(4, 4) for _ in params[:2]]
    pert = SAMPerturbation(0.05)
    norms = torch.stack([g.norm() for g in grads])
    backup = pert.perturb_(params[:2], grads, norms)
    assert len(backup) == 2
    assert all(b.data_ptr() != p.data_ptr() for b, p in zip(backup, params))


def test_unused_sampled_tensor_counts_as_zero_norm():
    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(8, 3)
            self.unused = nn.Linear(8, 3)

        def forward(self, x):
            return self.used(x)

    net = WithUnused()
    x, y = make_data(16).tensors
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    unused_before = [p.detach().clone() for p in net.unused.parameters()]
    engine = _engine(net, [True, False, True, True])
    result = engine.train_step(_loss(net, x, y), opt)
    assert not result.skipped
    ((_, norms),) = engine.selection.updates
    assert norms[2].item() == 0 and norms[3].item() == 0
    assert norms[0].item() > 0
    assert all(torch.equal(a, b) for a, b in zip(net.unused.parameters(), unused_before))

    # Only unused tensors active: the loss has no graph; the step is a no-op, not a crash.
    only_unused = _engine(net, [False, False, True, False])
    before = [p.detach().clone() for p in net.parameters()]
    result = only_unused.train_step(_loss(net, x, y), opt)
    assert not result.skipped and result.num_backward == 2
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), before))


@pytest.mark.parametrize("bad_pass", [1, 2])
def test_non_finite_pass_skips_the_step_untouched(bad_pass):
    net = make_mlp()
    x, y = make_data(16).tensors
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    # One good step first so the optimizer has state to protect.
    partition = build_partition(net)
    bandit = LayerBandit(partition.num_layers, layer_ratio=0.5, alpha_p=0.1)
    engine = SparseSAMEngine(partition, bandit, SAMPerturbation(0.05))
    engine.train_step(_loss(net, x, y), opt)
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


def test_engine_in_a_plain_loop_learns():
    torch.manual_seed(0)
    net = make_mlp()
    x, y = make_data(128).tensors
    opt = torch.optim.AdamW(net.parameters(), lr=3e-2)
    partition = build_partition(net)
    engine = SparseSAMEngine(
        partition,
        LayerBandit(
            partition.num_layers, layer_ratio=0.5, generator=torch.Generator().manual_seed(0)
        ),
        SAMPerturbation(0.05),
    )
    first = F.cross_entropy(net(x), y).item()
    active = 0
    for _ in range(60):
        active += int(engine.train_step(_loss(net, x, y), opt).active_mask.sum())
    assert F.cross_entropy(net(x), y).item() < 0.5 * first
    assert engine.counts.sum().item() == active
    assert (engine.counts > 0).all()
