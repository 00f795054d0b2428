"""The engine's step (:mod:`lightning_slsam.core.engine`): freezing before each forward, what
the selection learns from, which steps draw, and learning in a plain loop."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp
from probes import fixed_engine, loss_closure
from torch import nn

from lightning_slsam import (
    LayerBandit,
    SAMPerturbation,
    SparseLayerSAM,
    SparseSAMEngine,
    build_partition,
)
from lightning_slsam.core.schedules import Schedule
from lightning_slsam.core.step_kinds import PlainStep


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
        active += int(engine.train_step(loss_closure(net, x, y), opt).active_mask.sum())
    assert F.cross_entropy(net(x), y).item() < 0.5 * first
    assert engine.counts.sum().item() == active
    assert (engine.counts > 0).all()


def test_dense_one_pass_trains_every_layer_on_the_plain_steps_only():
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(15)])  # 30 tensors
    cb = SparseLayerSAM(schedule="random", dense_one_pass=True, alpha_p=0.5, seed=2)
    engine = cb.spec.build_engine(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(8, 4), torch.randint(0, 4, (8,))
    results = [engine.train_step(lambda: F.cross_entropy(net(x), y), opt) for _ in range(40)]
    plain = [r for r in results if r.kind == "plain"]
    sam = [r for r in results if r.kind == "sam"]
    assert 10 < len(plain) < 30 and len(sam) == 40 - len(plain)
    assert all(bool(r.active_mask.all()) and not r.drawn and r.num_backward == 1 for r in plain)
    assert all(r.drawn and int(r.active_mask.sum()) < 30 for r in sam)
    assert engine.selection.num_updates == len(sam)  # the bandit learns from its draws only
    with pytest.raises(ValueError, match="dense_one_pass"):
        SparseLayerSAM(dense_one_pass=1)


# -- what the engine checks ---------------------------------------------------------------------


class Twice(Schedule):
    """A schedule that names a step kind of its own, ``"twice"``, on odd steps."""

    kinds = ("sam", "twice")

    def kind(self, step: int) -> str:
        return "twice" if step % 2 else "sam"


def test_a_schedule_naming_a_kind_the_engine_lacks_is_refused():
    net = make_mlp()
    partition = build_partition(net)
    with pytest.raises(ValueError, match=r"runs step kinds \['twice'\] that the engine lacks"):
        SparseSAMEngine(partition, LayerBandit(8), SAMPerturbation(0.05), schedule=Twice())
    # A schedule that does not declare its kinds is caught at the step that names one.
    undeclared = type("Undeclared", (Schedule,), {"kind": Twice.kind})()
    engine = SparseSAMEngine(partition, LayerBandit(8), SAMPerturbation(0.05), schedule=undeclared)
    x, y = make_data(16).tensors
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    assert engine.train_step(loss_closure(net, x, y), opt).kind == "sam"
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match=r"named step kind 'twice'; the engine has \['plain',"):
        engine.train_step(loss_closure(net, x, y), opt)
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    assert engine.num_steps == 1
    # Given the kind, the engine runs it: here "twice" is a plain step under another name.
    kinds = {"twice": PlainStep()}
    engine = SparseSAMEngine(partition, LayerBandit(8), SAMPerturbation(0.05), schedule=Twice(),
                             kinds=kinds)  # fmt: skip
    results = [engine.train_step(loss_closure(net, x, y), opt) for _ in range(4)]
    assert [(r.kind, r.num_backward) for r in results] == [("sam", 2), ("twice", 1)] * 2
    assert engine.kind_counts == {"sam": 2, "twice": 2}


def test_loading_the_state_of_another_number_of_layers_is_refused():
    net = make_mlp()
    engine = SparseSAMEngine(build_partition(net), LayerBandit(8), SAMPerturbation(0.05))
    other = SparseSAMEngine(build_partition(net, layers="module"), LayerBandit(4),
                            SAMPerturbation(0.05))  # fmt: skip
    with pytest.raises(ValueError, match="has 4 layers but the model has 8"):
        engine.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="`update_scale` must be None or a finite number >= 1"):
        SparseSAMEngine(build_partition(net), LayerBandit(8), SAMPerturbation(0.05),
                        update_scale=float("inf"))  # fmt: skip
    with pytest.raises(ValueError, match="`bn_stats` must be one of"):
        SparseSAMEngine(build_partition(net), LayerBandit(8), SAMPerturbation(0.05), bn_stats="x")
