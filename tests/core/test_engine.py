"""The engine (:mod:`lightning_slsam.core.engine`): freezing before each forward, what the
selection learns from, which steps draw, the kinds a method names, its counters and state, and
learning in a plain loop."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp
from probes import fixed_engine, loss_closure
from torch import nn

from examples.methods import SLSAMAblationSpec
from lightning_slsam.core.engine import SAMEngine
from lightning_slsam.core.partition import build_partition
from lightning_slsam.core.perturbation import SAMPerturbation
from lightning_slsam.core.step import MethodParts
from lightning_slsam.methods.registry import method_spec
from lightning_slsam.selection.bandit import LayerBandit


def test_inactive_layers_frozen_before_forward_and_bandit_gets_first_pass_norms():
    net = make_mlp()
    x, y = make_data(16).tensors
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    mask = [True, False, False, True, True, False, True, False]
    seen = []
    engine = fixed_engine(net, mask)
    expected = copy.deepcopy(net)
    F.cross_entropy(expected(x), y).backward()
    engine.train_step(
        loss_closure(
            net, x, y, observe=lambda m: seen.append([p.requires_grad for p in m.parameters()])
        ),
        opt,
    )
    assert seen == [mask, mask]  # both forwards ran with exactly the sampled set trainable
    assert all(p.requires_grad for p in net.parameters())  # released after the step
    ((active, norms),) = engine.selection.updates
    assert active.tolist() == mask
    for i, p in enumerate(expected.parameters()):
        if mask[i]:
            assert norms[i].item() == pytest.approx(p.grad.norm().item(), rel=1e-6)


def test_engine_in_a_plain_loop_learns():
    torch.manual_seed(0)
    net = make_mlp()
    x, y = make_data(128).tensors
    opt = torch.optim.AdamW(net.parameters(), lr=3e-2)
    partition = build_partition(net)
    engine = SAMEngine(
        partition,
        LayerBandit(
            partition.num_layers, layer_ratio=0.5, generator=torch.Generator().manual_seed(0)
        ),
        SAMPerturbation(0.05),
    )
    first = F.cross_entropy(net(x), y).item()
    active = 0
    for _ in range(60):
        active += int(engine.train_step(loss_closure(net, x, y), opt).active_mask.sum())
    assert F.cross_entropy(net(x), y).item() < 0.5 * first
    assert engine.counts.sum().item() == active
    assert (engine.counts > 0).all()


def test_the_coins_plain_steps_train_the_drawn_layers_in_one_pass_and_teach_the_bandit():
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(15)])  # 30 tensors
    engine = method_spec("slsam_rst", seed=2).build_engine(net)  # SL-SAM on RST's coin
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(8, 4), torch.randint(0, 4, (8,))
    results = [engine.train_step(lambda: F.cross_entropy(net(x), y), opt) for _ in range(40)]
    plain = [r for r in results if r.kind == "plain"]
    sam = [r for r in results if r.kind == "sam"]
    assert 10 < len(plain) < 30 and len(sam) == 40 - len(plain)
    assert all(r.drawn and r.num_backward == 1 and int(r.active_mask.sum()) < 30 for r in plain)
    assert all(r.drawn and r.num_backward == 2 and int(r.active_mask.sum()) < 30 for r in sam)
    numel = torch.tensor(engine.partition.numel)
    assert all(r.pass_numel == [int(numel[r.active_mask].sum())] for r in plain)
    assert engine.selection.num_updates == 40  # every step is a draw the bandit learns from
    assert engine.kind_counts == {"sam": len(sam), "plain": len(plain)}


# -- what the engine checks ---------------------------------------------------------------------


class Twice(MethodParts):
    """A method that names a step kind that does not exist, ``"twice"``, on odd steps."""

    def kind(self, step: int) -> str:
        return "twice" if step % 2 else "sam"


class Alternate(MethodParts):
    """SAM on even steps, a plain step on odd ones."""

    def kind(self, step: int) -> str:
        return "plain" if step % 2 else "sam"


def test_a_method_naming_a_kind_the_engine_lacks_is_refused_and_its_kinds_run():
    net = make_mlp()
    partition = build_partition(net)
    # The kind is checked at the step that names it, before anything changes.
    engine = SAMEngine(partition, LayerBandit(8), SAMPerturbation(0.05), Twice())
    x, y = make_data(16).tensors
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    assert engine.train_step(loss_closure(net, x, y), opt).kind == "sam"
    before = [p.detach().clone() for p in net.parameters()]
    refused = r"named step kind 'twice'; the kinds are \('sam', 'plain',"
    with pytest.raises(ValueError, match=refused):
        engine.train_step(loss_closure(net, x, y), opt)
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    assert all(p.requires_grad for p in net.parameters())
    assert engine.num_steps == 1
    # The kinds a method names are run: here SAM and plain steps in turn.
    engine = SAMEngine(partition, LayerBandit(8), SAMPerturbation(0.05), Alternate())
    results = [engine.train_step(loss_closure(net, x, y), opt) for _ in range(4)]
    assert [(r.kind, r.num_backward) for r in results] == [("sam", 2), ("plain", 1)] * 2
    assert engine.kind_counts == {"sam": 2, "plain": 2}


def test_loading_the_state_of_another_number_of_layers_is_refused():
    net = make_mlp()
    engine = SAMEngine(build_partition(net), LayerBandit(8), SAMPerturbation(0.05))
    other = SAMEngine(build_partition(net, layers="module"), LayerBandit(4),
                            SAMPerturbation(0.05))  # fmt: skip
    with pytest.raises(ValueError, match="has 4 layers but the model has 8"):
        engine.load_state_dict(other.state_dict())
    # The engine's options are checked once, by the method's specification.
    bad_cap = r"`max_update_scale` must be None .* or a finite number >= 1"
    with pytest.raises(ValueError, match=bad_cap):
        SLSAMAblationSpec(max_update_scale=float("inf"))
    with pytest.raises(ValueError, match="`bn_stats` must be one of"):
        method_spec("sam", bn_stats="x")


def test_the_counters_count_committed_steps_and_resume_from_the_state():
    net = make_mlp()
    x, y = make_data(16).tensors
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    mask = [True, False, False, True, False, False, True, True]
    engine = fixed_engine(net, mask)
    engine.train_step(loss_closure(net, x, y), opt)

    def nan_loss():
        return F.cross_entropy(net(x), y) * float("nan")

    with pytest.warns(RuntimeWarning, match="skipped"):
        skipped = engine.train_step(nan_loss, opt)  # counted as a step, not as an update
    engine.train_step(loss_closure(net, x, y), opt)
    assert skipped.skipped and engine.last_result is not skipped
    assert (engine.num_steps, engine.num_skipped, engine.kind_counts) == (3, 1, {"sam": 2})
    assert engine.counts.tolist() == [2 * int(m) for m in mask]
    assert engine.frequencies().tolist() == [float(m) for m in mask]
    assert engine.never_selected() == 4
    # The Active Ratio: the drawn parameters (0.weight, 2.bias, 5.weight, 5.bias) per pass.
    ratio = 2 * (128 + 16 + 48 + 3) / 499
    assert engine.last_result.active_ratio == pytest.approx(ratio)
    assert engine.mean_active_ratio == pytest.approx(ratio)
    # The mean first-pass norm of each layer measured, over the committed steps only.
    norms = torch.stack([n for _, n in engine.selection.updates])
    assert len(norms) == 2
    means = engine.mean_norms()
    on = torch.tensor(mask)
    torch.testing.assert_close(means[on], norms.mean(0)[on], rtol=1e-12, atol=0)
    assert bool(means[~on].isnan().all()) and engine.norm_counts.tolist() == engine.counts.tolist()
    # A fresh engine on the same layers resumes every counter.
    again = fixed_engine(make_mlp(), mask)
    again.load_state_dict(engine.state_dict())
    assert torch.equal(again.counts, engine.counts)
    assert torch.equal(again.norm_sums, engine.norm_sums)
    assert (again.num_steps, again.num_skipped, again.kind_counts) == (3, 1, {"sam": 2})
    assert again.mean_active_ratio == pytest.approx(ratio)
