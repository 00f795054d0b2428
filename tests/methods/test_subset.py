"""The subset methods' specifications (:mod:`lightning_slsam.methods.subset`): SL-SAM with a
schedule, the short-run remedies that follow the run length, always-active vectors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp
from torch import nn

from lightning_slsam import RandomSLSAM, SparseLayerSAM


def test_sl_sam_with_rst_coin_samples_layers_on_every_step_and_sam_on_about_half():
    net = nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)])
    cb = SparseLayerSAM(layer_ratio=0.3, schedule="random", seed=5)
    engine = cb.spec.build_engine(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(6, 3), torch.randint(0, 3, (6,))
    results = [engine.train_step(lambda: F.cross_entropy(net(x), y), opt) for _ in range(200)]
    sam = [r for r in results if r.kind == "sam"]
    plain = [r for r in results if r.kind == "plain"]
    assert 80 < len(sam) < 120 and len(sam) + len(plain) == 200
    assert all(r.num_backward == 2 for r in sam) and all(r.num_backward == 1 for r in plain)
    # The bandit's sample applies to both kinds of step: layers are sparse on each.
    assert sum(bool(r.active_mask.all()) for r in results) < 20
    assert engine.selection.num_updates == 200
    assert cb.schedule == "random"


def test_sl_sam_with_looksam_interval_keeps_sparse_layers_and_the_interval():
    net = nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)])
    cb = SparseLayerSAM(layer_ratio=0.3, schedule="interval", sam_interval=4, seed=5)
    engine = cb.spec.build_engine(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(6, 3), torch.randint(0, 3, (6,))
    results = [engine.train_step(lambda: F.cross_entropy(net(x), y), opt) for _ in range(12)]
    assert [r.kind for r in results] == ["sam", "reuse", "reuse", "reuse"] * 3
    assert sum(bool(r.active_mask.all()) for r in results) < 4
    assert engine.kinds["reuse"].vertical  # the orthogonal components of the SAM steps were stored
    assert set(engine.kinds["reuse"].vertical) <= {id(p) for p in net.parameters()}


def test_dense_warmup_and_min_updates_follow_the_run_length():
    from lightning_slsam.selection.wrappers import DenseWarmup

    net = make_mlp()
    cb = SparseLayerSAM(preset="paper", dense_warmup=0.25, seed=0)
    engine = cb.spec.build_engine(net, total_steps=40)
    assert isinstance(engine.selection, DenseWarmup) and engine.selection.steps == 10
    assert engine.selection.inner.budget == pytest.approx(0.2 * 8)
    assert SparseLayerSAM(dense_warmup=7).spec.build_engine(net).selection.steps == 7
    # A floor of 10 updates per layer over 20 steps needs half the layers each step.
    cb = SparseLayerSAM(preset="paper", min_updates=10, seed=0)
    engine = cb.spec.build_engine(net, total_steps=20)
    assert cb.effective_ratio == 0.5 and engine.selection.budget == pytest.approx(4.0)
    cb = SparseLayerSAM(min_updates=10, seed=0)
    cb.spec.build_engine(net, total_steps=1000)
    assert cb.effective_ratio == 0.2  # long enough: the ratio is kept
    random = RandomSLSAM(dense_warmup=5, min_updates=10)
    assert random.spec.build_engine(net, total_steps=20).selection.inner.ratio == 0.5


def test_fractional_options_without_a_run_length_fail_clearly():
    for cb in (SparseLayerSAM(dense_warmup=0.3), SparseLayerSAM(min_updates=5)):
        with pytest.raises(ValueError, match="run's length"):
            cb.spec.build_engine(make_mlp())
    for bad in ({"dense_warmup": -1}, {"dense_warmup": 1.5}, {"min_updates": -2},
                {"min_updates": 0.5}):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            SparseLayerSAM(**bad)


def test_vectors_always_active_trains_every_bias_and_norm_weight_every_step():
    net = make_mlp()  # 3 Linear (weight, bias) + 1 LayerNorm (weight, bias)
    engine = SparseLayerSAM(vectors_always_active=True, seed=0).spec.build_engine(net)
    assert engine.partition.always_active_names == ["0.bias", "2.weight", "2.bias", "3.bias",
                                                    "5.bias"]  # fmt: skip
    assert engine.partition.names == ["0.weight", "3.weight", "5.weight"]
    x, y = make_data(16).tensors
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    for _ in range(5):
        engine.train_step(lambda: F.cross_entropy(net(x), y), opt)
        for name, p in net.named_parameters():
            if p.dim() == 1:
                assert not torch.equal(p.detach(), before[name])  # updated every step
                before[name] = p.detach().clone()


def test_the_paper_preset_keeps_the_count_budget():
    from lightning_slsam import SparseLayerSAM, make_engine

    assert SparseLayerSAM(preset="paper").budget == "count"
    assert SparseLayerSAM(preset="robust").budget == "count"
    net = torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 2))
    assert make_engine("slsam", net, seed=0).selection.costs is None  # "slsam" is the paper's
    engine = make_engine("slsam", net, seed=0, budget="compute")
    assert engine.selection.costs.tolist() == [800.0, 16.0, 2.0]
    with pytest.raises(ValueError, match="`budget`"):
        SparseLayerSAM(budget="flops")
