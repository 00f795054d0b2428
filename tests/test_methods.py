"""Each method's defining behaviour, checked against independent computations."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp
from torch import nn

from lightning_slsam import (
    ESAM,
    METHODS,
    RST,
    S2SAM,
    SAM,
    SLS2SAM,
    SSAMF,
    LookSAM,
    RandomSLSAM,
    SparseLayerSAM,
    TopSLSAM,
    make_callback,
)

RHO = 0.05


def _grads(net: nn.Module, x, y) -> list[torch.Tensor]:
    """Plain gradient of the mean cross-entropy at ``net``'s current weights."""
    net = copy.deepcopy(net)
    net.zero_grad()
    F.cross_entropy(net(x), y).backward()
    return [p.grad.clone() for p in net.parameters()]


def _at(net: nn.Module, offsets: list[torch.Tensor]) -> nn.Module:
    moved = copy.deepcopy(net)
    with torch.no_grad():
        for p, e in zip(moved.parameters(), offsets):
            p.add_(e)
    return moved


class Recorder:
    """compute_loss for engine.train_step that records what each pass saw."""

    def __init__(self, net, x, y, per_sample=False):
        self.net, self.x, self.y, self.per_sample = net, x, y, per_sample
        self.passes: list[dict] = []

    def __call__(self, index=None):
        x, y = (self.x, self.y) if index is None else (self.x[index], self.y[index])
        self.passes.append(
            {
                "weights": [p.detach().clone() for p in self.net.parameters()],
                "trainable": [p.requires_grad for p in self.net.parameters()],
                "index": None if index is None else index.clone(),
                "grad_enabled": torch.is_grad_enabled(),
            }
        )
        losses = F.cross_entropy(self.net(x), y, reduction="none")
        return losses if self.per_sample else losses.mean()


def _setup(cb, seed=0, n=32):
    torch.manual_seed(seed)
    net = make_mlp()
    x, y = make_data(n).tensors
    return net, x, y, cb.build_engine(net), torch.optim.SGD(net.parameters(), lr=0.1)


# -- the registry and dense SAM ----------------------------------------------------------


def test_registry_builds_every_method_with_its_paper_defaults():
    expected = {
        "sam": SAM, "adasam": SAM, "slsam": SparseLayerSAM, "random_slsam": RandomSLSAM,
        "top_slsam": TopSLSAM, "s2sam": S2SAM, "sl_s2sam": SLS2SAM, "rst": RST, "esam": ESAM,
        "ssamf": SSAMF, "looksam": LookSAM,
    }  # fmt: skip
    for name, cls in expected.items():
        cb = make_callback(name)
        assert type(cb) is cls and cb.rho == 0.01
    with pytest.raises(ValueError, match="needs no callback"):
        make_callback("adamw")
    assert make_callback("SL-SAM".replace("SL-SAM", "slsam")).layer_ratio == 0.2
    assert make_callback("rst").sam_probability == 0.5
    assert (make_callback("esam").weight_ratio, make_callback("esam").data_ratio) == (0.5, 0.5)
    assert make_callback("ssamf").sparsity == 0.5
    assert (make_callback("looksam").sam_interval, make_callback("looksam").looksam_alpha) == (
        5,
        0.7,
    )
    assert make_callback("slsam_rst").schedule == "random"
    assert make_callback("slsam_looksam").schedule == "interval"
    assert make_callback("slsam_robust").bandit_loss == "rank"
    assert set(METHODS) >= set(expected) | {"adamw", "slsam_rst", "slsam_looksam", "slsam_robust"}
    with pytest.raises(ValueError, match="Unknown method 'sgd'"):
        make_callback("sgd")
    with pytest.raises(ValueError, match="fixes schedule='random'"):
        RST(schedule="interval")


def _asam_reference(net: nn.Module, grads, rho: float, eta: float, active=None):
    """ASAM's ascent as its reference code computes it (SamsungLabs/ASAM ``ascent_step``):
    ``T_w = |w| + eta`` for parameters named like weights, 1 for the others; one norm of
    ``T_w g`` over all; ``e = rho * T_w^2 g / ||T_w g||``."""
    named = list(net.named_parameters())
    use = [active is None or active[i] for i in range(len(named))]
    scale = [
        (p.detach().abs() + eta) if "weight" in name else torch.ones_like(p) for name, p in named
    ]
    tg = [t * g for t, g, on in zip(scale, grads, use) if on]
    norm = torch.sqrt(sum(x.square().sum() for x in tg))
    return [
        rho * t * t * g / norm if on else torch.zeros_like(g) for t, g, on in zip(scale, grads, use)
    ]


def test_asam_perturbation_follows_the_reference():
    cb = SAM(rho=RHO, adaptive=True)
    net, x, y, engine, opt = _setup(cb)
    with torch.no_grad():
        net[0].weight.zero_()  # a zero-valued weight tensor is still perturbed (eta)
    rec = Recorder(net, x, y)
    g = _grads(net, x, y)
    w = [p.detach().clone() for p in net.parameters()]
    engine.train_step(rec, opt)
    expected = _asam_reference(net_at(w, net), g, RHO, 0.01)
    for before, during, want in zip(w, rec.passes[1]["weights"], expected):
        torch.testing.assert_close(during - before, want, atol=1e-7, rtol=1e-4)
    zero_weight = [n for n, _ in net.named_parameters()].index("0.weight")
    assert float((rec.passes[1]["weights"][zero_weight] - w[zero_weight]).abs().max()) > 0
    # Biases are perturbed unscaled: rho * g / ||T g|| (not rho * |b|^2 g / ...).
    bias = [n for n, _ in net.named_parameters()].index("3.bias")
    ratio = (rec.passes[1]["weights"][bias] - w[bias]) / g[bias]
    torch.testing.assert_close(ratio, ratio.flatten()[0].expand_as(ratio))


def net_at(weights, net):
    moved = copy.deepcopy(net)
    with torch.no_grad():
        for p, w in zip(moved.parameters(), weights):
            p.copy_(w)
    return moved


def test_asam_radius_and_eta_defaults():
    assert SAM().rho == 0.01 and SparseLayerSAM().rho == 0.01
    assert SAM(adaptive=True).rho == 0.5  # ASAM's reference radius
    assert SparseLayerSAM(adaptive=True).rho == 0.5
    assert SAM(rho=0.2, adaptive=True).rho == 0.2
    assert SAM(adaptive=True).perturbation.eta == 0.01
    assert SAM(adaptive=True, adaptive_eta=0.0).perturbation.eta == 0.0
    with pytest.raises(ValueError, match="adaptive_eta"):
        SAM(adaptive=True, adaptive_eta=-1.0)


# -- Random-SL-SAM and Top-SL-SAM -----------------------------------------------------------


def test_random_sl_sam_frequencies_are_uniform_and_fixed():
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])  # 10 tensors
    cb = RandomSLSAM(layer_ratio=0.3, seed=4)
    engine = cb.build_engine(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(8, 2), torch.randint(0, 2, (8,))
    steps = 500
    for _ in range(steps):
        engine.train_step(lambda: F.cross_entropy(net(x), y), opt)
    # Marginal of Bernoulli(0.3) per layer, redrawn while empty.
    marginal = 0.3 / (1 - 0.7**10)
    sd = (marginal * (1 - marginal) / steps) ** 0.5
    freq = engine.frequencies()
    assert (freq - marginal).abs().max() < 4 * sd
    assert torch.equal(engine.selection.probs, torch.full((10,), 0.3, dtype=torch.float64))


def test_top_sl_sam_picks_exactly_the_k_largest_first_pass_norms():
    cb = TopSLSAM(rho=RHO, layer_ratio=0.25)  # k = 2 of 8
    net, x, y, engine, opt = _setup(cb)
    for _ in range(6):
        g = _grads(net, x, y)
        expected = torch.tensor([gi.norm() for gi in g]).topk(2).indices.sort().values
        rec = Recorder(net, x, y)
        result = engine.train_step(rec, opt)
        assert torch.nonzero(result.active_mask).flatten().tolist() == expected.tolist()
        assert all(rec.passes[0]["trainable"])  # the first pass computes every layer
        assert rec.passes[1]["trainable"] == result.active_mask.tolist()
        assert result.active_ratio_per_pass[0] == 1.0
    assert engine.never_selected() >= 4  # greedy: most layers are never trained


# -- single-step SAM --------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["s2sam", "sl_s2sam"])
def test_single_step_methods_perturb_along_each_layers_last_gradient(method):
    cb = make_callback(method, rho=RHO, seed=1)
    net, x, y, engine, opt = _setup(cb)
    last: dict[int, torch.Tensor] = {}
    for step in range(8):
        rec = Recorder(net, x, y)
        before = [p.detach().clone() for p in net.parameters()]
        result = engine.train_step(rec, opt)
        assert len(rec.passes) == 1 and result.num_backward == 1  # one pass per step
        offsets = [d - b for d, b in zip(rec.passes[0]["weights"], before)]
        if step == 0:
            assert result.kind == "plain" and bool(result.active_mask.all())
            assert all(float(o.abs().max()) == 0 for o in offsets)
        else:
            active = result.active_mask.tolist()
            directions = [last[i] for i in range(8) if active[i]]
            norm = torch.sqrt(sum(d.square().sum() for d in directions))
            for i in range(8):
                expected = RHO * last[i] / norm if active[i] else torch.zeros_like(offsets[i])
                torch.testing.assert_close(offsets[i], expected, atol=1e-7, rtol=1e-4)
        for i, p in enumerate(net.parameters()):
            if p.grad is not None:
                last[i] = p.grad.clone()  # this step's gradient, at the perturbed point
    if method == "sl_s2sam":
        assert 0 < engine.frequencies()[0] < 1  # layers really were sampled after step 0


# -- RST and LookSAM --------------------------------------------------------------------------


def _kinds(cb, steps=200):
    net = nn.Linear(3, 2)
    engine = cb.build_engine(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    results = [engine.train_step(lambda: F.cross_entropy(net(x), y), opt) for _ in range(steps)]
    return [r.kind for r in results], [r.num_backward for r in results]


def test_rst_does_sam_on_about_half_the_steps_reproducibly():
    kinds, backward = _kinds(RST(seed=3))
    sam = sum(k == "sam" for k in kinds)
    assert 0.4 * 200 < sam < 0.6 * 200
    assert backward == [2 if k == "sam" else 1 for k in kinds]
    assert set(kinds) == {"sam", "plain"}
    assert _kinds(RST(seed=3))[0] == kinds
    assert _kinds(RST(seed=4))[0] != kinds
    assert {k for k in _kinds(RST(probability=1.0))[0]} == {"sam"}


def test_looksam_full_passes_every_k_steps_and_reuses_the_orthogonal_component():
    cb = LookSAM(rho=RHO, interval=3, alpha=0.7)
    net, x, y, engine, opt = _setup(cb)
    g_v = None
    for step in range(7):
        g = _grads(net, x, y)
        if step % 3 == 0:
            gnorm = torch.sqrt(sum(gi.square().sum() for gi in g))
            g_s = _grads(_at(net, [RHO * gi / gnorm for gi in g]), x, y)
            inner = sum((a * b).sum() for a, b in zip(g, g_s))
            g_v = [b - inner / gnorm**2 * a for a, b in zip(g, g_s)]
            expected = g_s
        else:
            ratio = torch.sqrt(sum(gi.square().sum() for gi in g)) / torch.sqrt(
                sum(v.square().sum() for v in g_v)
            )
            expected = [gi + 0.7 * ratio * v for gi, v in zip(g, g_v)]
        result = engine.train_step(Recorder(net, x, y), opt)
        assert result.kind == ("sam" if step % 3 == 0 else "reuse")
        assert result.num_backward == (2 if step % 3 == 0 else 1)
        for p, e in zip(net.parameters(), expected):  # the gradient the optimizer used
            torch.testing.assert_close(p.grad, e, atol=1e-6, rtol=1e-4)


# -- ESAM ---------------------------------------------------------------------------------------


def test_esam_perturbs_sampled_layers_and_second_pass_sees_the_sharpest_half():
    cb = ESAM(rho=RHO, seed=2)
    net, x, y, engine, opt = _setup(cb, n=16)
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
    net, x, y, engine, opt = _setup(ESAM())
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match="needs per-sample losses"):
        engine.train_step(Recorder(net, x, y), opt, batch_size=32)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), before))


# -- SSAM-F -------------------------------------------------------------------------------------


def test_ssamf_perturbs_only_the_top_fisher_coordinates():
    cb = SSAMF(rho=RHO, sparsity=0.5, fisher_samples=8, mask_interval=3)
    net, x, y, engine, opt = _setup(cb, n=16)
    for step in range(5):
        w = [p.detach().clone() for p in net.parameters()]
        fisher = [torch.zeros_like(p) for p in net.parameters()]
        for i in range(8):
            for f, gi in zip(fisher, _grads(net, x[i : i + 1], y[i : i + 1])):
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
        assert engine.hooks[0].fisher.kept_fraction() == pytest.approx(0.5, abs=1 / flat.numel())
        assert result.active_ratio == 2.0


# -- both axes of sparsity, and ASAM on a sparse method -------------------------------------


def test_sl_sam_with_rst_coin_samples_layers_on_every_step_and_sam_on_about_half():
    net = nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)])
    cb = SparseLayerSAM(layer_ratio=0.3, schedule="random", seed=5)
    engine = cb.build_engine(net)
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
    engine = cb.build_engine(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(6, 3), torch.randint(0, 3, (6,))
    results = [engine.train_step(lambda: F.cross_entropy(net(x), y), opt) for _ in range(12)]
    assert [r.kind for r in results] == ["sam", "reuse", "reuse", "reuse"] * 3
    assert sum(bool(r.active_mask.all()) for r in results) < 4
    assert engine.kinds["reuse"].vertical  # the orthogonal components of the SAM steps were stored
    assert set(engine.kinds["reuse"].vertical) <= {id(p) for p in net.parameters()}


def test_asam_on_sl_sam_perturbs_only_active_tensors_as_the_reference():
    cb = SparseLayerSAM(rho=RHO, layer_ratio=0.4, adaptive=True, seed=2)
    net, x, y, engine, opt = _setup(cb)
    g = _grads(net, x, y)
    w = [p.detach().clone() for p in net.parameters()]
    rec = Recorder(net, x, y)
    result = engine.train_step(rec, opt)
    active = result.active_mask.tolist()
    assert 0 < sum(active) < len(active)
    expected = _asam_reference(net_at(w, net), g, RHO, 0.01, active)
    for before, during, want in zip(w, rec.passes[1]["weights"], expected):
        torch.testing.assert_close(during - before, want, atol=1e-7, rtol=1e-4)


def test_depth_cut_freezes_everything_below_the_cut_and_shortens_backprop():
    from lightning_slsam.selection.wrappers import DepthCut

    net = nn.Sequential(*[nn.Linear(3, 3) for _ in range(20)])  # 40 tensors, input first
    cb = SparseLayerSAM(preset="paper", layer_ratio=0.2, backprop_depth=0.5, seed=1)
    engine = cb.build_engine(net)
    assert isinstance(engine.selection, DepthCut)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(6, 3), torch.randint(0, 3, (6,))
    reached = []
    for _ in range(300):
        result = engine.train_step(lambda: F.cross_entropy(net(x), y), opt)
        cut = engine.selection.last_cut
        mask = result.active_mask
        assert not bool(mask[:cut].any()) and bool(mask.any())
        reached.append(1 - int(torch.nonzero(mask)[0]) / 40)
    assert 0.4 < sum(reached) / len(reached) < 0.6  # half the depth on average
    assert engine.selection.inner.num_updates == 300  # the bandit still learns
    state = engine.selection.state_dict()
    again = cb.build_engine(net)
    again.selection.load_state_dict(state)
    assert [again.selection.sample().tolist() for _ in range(5)] == [
        engine.selection.sample().tolist() for _ in range(5)
    ]


# -- learning only from drawn steps; the short-run remedies -----------------------------------


def test_sl_s2_sam_first_step_is_dense_and_does_not_teach_the_bandit():
    """The first step of SL-S2-SAM trains every layer without a draw: the bandit must not
    learn from it (its 1/p weights would treat an all-ones mask as a rare draw)."""
    cb = SLS2SAM(rho=RHO, layer_ratio=0.25, alpha_p=0.5, seed=3)
    net, x, y, engine, opt = _setup(cb)
    uniform = engine.selection.probs
    first = engine.train_step(Recorder(net, x, y), opt)
    assert first.kind == "plain" and bool(first.active_mask.all())
    torch.testing.assert_close(engine.selection.probs, uniform, rtol=0, atol=0)
    assert engine.selection.num_updates == 0 and not first.drawn
    second = engine.train_step(Recorder(net, x, y), opt)
    assert second.drawn and engine.selection.num_updates == 1
    assert not torch.allclose(engine.selection.probs, uniform)


def test_dense_warmup_and_min_updates_follow_the_run_length():
    from lightning_slsam.selection.wrappers import DenseWarmup

    net = make_mlp()
    cb = SparseLayerSAM(preset="paper", dense_warmup=0.25, seed=0)
    engine = cb.build_engine(net, total_steps=40)
    assert isinstance(engine.selection, DenseWarmup) and engine.selection.steps == 10
    assert engine.selection.inner.budget == pytest.approx(0.2 * 8)
    assert SparseLayerSAM(dense_warmup=7).build_engine(net).selection.steps == 7
    # A floor of 10 updates per layer over 20 steps needs half the layers each step.
    cb = SparseLayerSAM(preset="paper", min_updates=10, seed=0)
    engine = cb.build_engine(net, total_steps=20)
    assert cb.effective_ratio == 0.5 and engine.selection.budget == pytest.approx(4.0)
    cb = SparseLayerSAM(min_updates=10, seed=0)
    cb.build_engine(net, total_steps=1000)
    assert cb.effective_ratio == 0.2  # long enough: the ratio is kept
    random = RandomSLSAM(dense_warmup=5, min_updates=10)
    assert random.build_engine(net, total_steps=20).selection.inner.ratio == 0.5


def test_fractional_options_without_a_run_length_fail_clearly():
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    for cb in (SparseLayerSAM(dense_warmup=0.3), SparseLayerSAM(min_updates=5)):
        with pytest.raises(MisconfigurationException, match="run's length"):
            cb.build_engine(make_mlp())
    for bad in ({"dense_warmup": -1}, {"dense_warmup": 1.5}, {"min_updates": -2},
                {"min_updates": 0.5}):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            SparseLayerSAM(**bad)


def test_warmup_layer_ratio_falls_from_one_to_the_target():
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(25)])  # 50 tensors
    cb = SparseLayerSAM(rho=RHO, dense_warmup=20, seed=1)
    engine = cb.build_engine(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(8, 4), torch.randint(0, 4, (8,))
    sizes = [
        int(engine.train_step(lambda: F.cross_entropy(net(x), y), opt).active_mask.sum())
        for _ in range(60)
    ]
    assert sizes[0] == 50
    assert sum(sizes[:5]) / 5 > 40 and abs(sum(sizes[30:]) / 30 - 10) < 3
    assert engine.selection.inner.num_updates == 60  # the bandit learns through the warm-up


def test_head_always_active_finds_a_fresh_timm_and_transformers_head():
    import timm
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
    )

    from lightning_slsam.core.partition import find_new_head

    vit = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=7
    )
    assert find_new_head(vit) == ["head.weight", "head.bias"]
    bert = BertForSequenceClassification(
        BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=32, vocab_size=50, num_labels=3)
    )  # fmt: skip
    assert find_new_head(bert) == ["classifier.weight", "classifier.bias"]
    llama = LlamaForCausalLM(
        LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=2, intermediate_size=32, vocab_size=50)
    )  # fmt: skip
    assert find_new_head(llama) == []  # a language model's lm_head is pretrained

    cb = SparseLayerSAM(head_always_active=True, seed=0)
    engine = cb.build_engine(bert)
    assert engine.partition.always_active_names == ["classifier.weight", "classifier.bias"]
    assert "classifier.weight" not in [n for g in engine.partition.param_names for n in g]


def test_head_always_active_uses_the_module_hook_and_warns_when_nothing_is_found():
    class WithHook(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.out = nn.Linear(3, 3), nn.Linear(3, 2)

        def sam_head_parameters(self):
            return ["out.weight", "out.bias"]

    cb = SparseLayerSAM(head_always_active=True)
    assert cb.build_engine(WithHook()).partition.always_active_names == ["out.weight", "out.bias"]
    with pytest.warns(UserWarning, match="found no freshly initialised head"):
        SparseLayerSAM(head_always_active=True).build_engine(make_mlp())
    with pytest.raises(ValueError, match="head_always_active"):
        SparseLayerSAM(head_always_active="yes")


def test_presets_set_the_remedies_and_explicit_options_win():
    from lightning_slsam import PRESETS

    paper = SparseLayerSAM(preset="paper")
    assert paper.preset == "paper" and paper.bandit_loss == "shifted"
    assert (paper.dense_warmup, paper.min_updates, paper.alpha_p) == (0, 0, 1e-3)
    assert not paper.head_always_active and not paper.vectors_always_active
    robust = SparseLayerSAM(preset="robust")
    for key, value in PRESETS["robust"].items():
        assert getattr(robust, key) == value
    assert robust.alpha_p == 0.03  # the rank loss's own step size
    # No warm-up in the preset: rank + head + scale matched it at less cost (docs/results.md).
    assert robust.dense_warmup == 0 and robust.head_always_active and robust.scale_updates
    mixed = SparseLayerSAM(preset="robust", dense_warmup=0.3, bandit_loss="shifted")
    assert mixed.dense_warmup == 0.3 and mixed.bandit_loss == "shifted" and mixed.alpha_p == 1e-3
    assert mixed.head_always_active
    assert make_callback("slsam_robust").preset == "robust"
    with pytest.raises(ValueError, match="preset"):
        SparseLayerSAM(preset="fast")


def test_vectors_always_active_trains_every_bias_and_norm_weight_every_step():
    net = make_mlp()  # 3 Linear (weight, bias) + 1 LayerNorm (weight, bias)
    engine = SparseLayerSAM(vectors_always_active=True, seed=0).build_engine(net)
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


def test_dense_one_pass_trains_every_layer_on_the_plain_steps_only():
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(15)])  # 30 tensors
    cb = SparseLayerSAM(schedule="random", dense_one_pass=True, alpha_p=0.5, seed=2)
    engine = cb.build_engine(net)
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


# -- inverse-inclusion update scaling -----------------------------------------------------------


def _one_step(cb, seed=0, lr=0.1, steps_before=0):
    """Weights change of one engine step of ``cb`` on a 20-tensor MLP (SGD), after
    ``steps_before`` steps; returns (deltas, result, inclusion used for the draw)."""
    torch.manual_seed(seed)
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
    engine = cb.build_engine(net, total_steps=50)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    x, y = torch.randn(16, 4), torch.randint(0, 4, (16,))

    def loss():
        return F.cross_entropy(net(x), y)

    for _ in range(steps_before):
        engine.train_step(loss, opt)
    before = [p.detach().clone() for p in net.parameters()]
    selection = engine.selection
    result = engine.train_step(loss, opt)
    q = selection.inclusion()
    return [p.detach() - b for p, b in zip(net.parameters(), before)], result, q


def test_scale_updates_multiplies_each_drawn_layers_update_by_one_over_q():
    kwargs = dict(rho=RHO, layer_ratio=0.3, seed=4)
    plain, r0, _ = _one_step(SparseLayerSAM(preset="paper", **kwargs))
    scaled, r1, _ = _one_step(SparseLayerSAM(preset="paper", scale_updates=True, **kwargs))
    assert torch.equal(r0.active_mask, r1.active_mask) and 0 < int(r0.active_mask.sum()) < 20
    for layer, (a, b) in enumerate(zip(plain, scaled)):  # one layer per tensor
        if r0.active_mask[layer]:
            torch.testing.assert_close(b, a / 0.3, rtol=1e-5, atol=1e-7)
        else:
            assert not a.any() and not b.any()


def test_scale_updates_uses_the_probability_of_the_draw_capped():
    """After the bandit has moved, one step's update of each drawn layer is SAM's SGD step
    times min(1 / p, cap), p the probabilities the step drew with."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
    cb = SparseLayerSAM(rho=RHO, layer_ratio=0.3, bandit_loss="rank", alpha_p=0.5,
                        scale_updates=True, max_update_scale=2.5, seed=4)  # fmt: skip
    engine = cb.build_engine(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 4, (16,))

    def loss():
        return F.cross_entropy(net(x), y)

    for _ in range(8):
        engine.train_step(loss, opt)
    p = engine.selection.probs
    assert float(p.max() - p.min()) > 0.2  # the bandit has moved: factors differ by layer
    reference = copy.deepcopy(net)
    before = [t.detach().clone() for t in net.parameters()]
    mask = engine.train_step(loss, opt).active_mask
    # The same SAM step by hand on the drawn tensors: ascent along the first-pass
    # gradient (one global norm), SGD along the second-pass gradient.
    drawn = [t for t, on in zip(reference.parameters(), mask) if on]
    g = torch.autograd.grad(F.cross_entropy(reference(x), y), drawn)
    norm = torch.sqrt(sum(gi.square().sum() for gi in g))
    with torch.no_grad():
        for t, gi in zip(drawn, g):
            t.add_(RHO * gi / norm)
    g2 = iter(torch.autograd.grad(F.cross_entropy(reference(x), y), drawn))
    factors = (1.0 / p).clamp(max=2.5)
    for layer, (t, b) in enumerate(zip(net.parameters(), before)):
        delta = t.detach() - b
        if not mask[layer]:
            assert not delta.any()
            continue
        expected = -0.1 * next(g2) * float(factors[layer])
        torch.testing.assert_close(delta, expected, rtol=1e-4, atol=1e-6)
    used = set(factors[mask].tolist())
    assert len(used) > 1 and used - {2.5}  # per-layer factors, some below the cap


def test_scale_updates_leaves_dense_and_warmup_steps_unscaled():
    # Dense warm-up: the first step draws every layer with probability 1 -> factor 1.
    plain, _, _ = _one_step(RandomSLSAM(rho=RHO, layer_ratio=0.25, dense_warmup=10, seed=1))
    scaled, r1, q = _one_step(
        RandomSLSAM(rho=RHO, layer_ratio=0.25, dense_warmup=10, scale_updates=True, seed=1)
    )
    assert bool(r1.active_mask.all()) and bool((q == 1).all())
    for a, b in zip(plain, scaled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    # A dense plain step of RST's coin (dense_one_pass) is not a draw: not scaled.
    def rst(seed: int, **extra) -> SparseLayerSAM:
        return SparseLayerSAM(rho=RHO, schedule="random", dense_one_pass=True, seed=seed, **extra)

    seed = next(s for s in range(50) if not _one_step(rst(s))[1].drawn)
    plain, _, _ = _one_step(rst(seed))
    scaled, r1, _ = _one_step(rst(seed, scale_updates=True))
    assert not r1.drawn and bool(r1.active_mask.all())
    for a, b in zip(plain, scaled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_scaled_updates_move_each_layer_as_far_as_dense_training_in_expectation():
    """A linear loss has a constant gradient: dense SGD moves every weight by lr * g per
    step. With scaling, sparse steps move each layer that far on average; without, by q."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(3, 3, bias=False) for _ in range(8)])
    c = [torch.randn_like(p) for p in net.parameters()]

    def linear_loss():
        return (
            sum((p * ci).sum() for p, ci in zip(net.parameters(), c))
            + 0 * net(torch.zeros(1, 3)).sum()
        )

    def travel(scale):
        start = [p.detach().clone() for p in net.parameters()]
        cb = RandomSLSAM(rho=1e-6, layer_ratio=0.25, scale_updates=scale, seed=7)
        engine = cb.build_engine(net)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        for _ in range(400):
            engine.train_step(linear_loss, opt)
        moved = [(s - p.detach()) / (1e-3 * 400 * ci) for p, s, ci in zip(net.parameters(),
                                                                         start, c)]  # fmt: skip
        with torch.no_grad():
            for p, s in zip(net.parameters(), start):
                p.copy_(s)
        return torch.stack([m.mean() for m in moved])

    unscaled, scaled = travel(False), travel(True)
    assert abs(float(unscaled.mean()) - 0.25) < 0.05  # a quarter of the dense distance
    assert abs(float(scaled.mean()) - 1.0) < 0.12  # the dense distance, in expectation


def test_scale_updates_options_are_validated_and_in_the_presets():
    from lightning_slsam import PRESETS

    assert PRESETS["robust"]["scale_updates"] and not PRESETS["paper"]["scale_updates"]
    assert SparseLayerSAM(preset="robust").update_scale == pytest.approx(5.0)
    assert SparseLayerSAM(preset="paper").update_scale is None
    assert SparseLayerSAM().update_scale == 3.0  # the default preset's cap
    assert SparseLayerSAM(preset="paper", scale_updates=True, layer_ratio=0.5).update_scale == 2.0
    assert SparseLayerSAM(max_update_scale=5).update_scale == 5.0  # explicit wins
    assert RandomSLSAM(scale_updates=True, max_update_scale=3).update_scale == 3.0
    for bad in ({"scale_updates": "yes"}, {"max_update_scale": 0.5},
                {"max_update_scale": float("inf")}):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            SparseLayerSAM(**bad)
    from lightning_slsam.core.engine import SparseSAMEngine

    with pytest.raises(ValueError, match="update_scale"):
        SparseSAMEngine.__init__(object.__new__(SparseSAMEngine), None, None, None,
                                 update_scale=0.9)  # fmt: skip


def test_the_default_is_pinned():
    """``SparseLayerSAM()``'s configuration, chosen on docs/results/gpu (docs/results.md):
    changing any of it must change this test, the docs and the changelog together."""
    from lightning_slsam import PRESETS

    default = SparseLayerSAM()
    assert default.preset == "default" and PRESETS["default"] == {
        "budget": "compute",
        "bandit_loss": "rank",
        "dense_warmup": 0,
        "min_updates": 0,
        "head_always_active": True,
        "vectors_always_active": False,
        "scale_updates": True,
        "max_update_scale": 3.0,
    }
    assert (default.rho, default.layer_ratio, default.p_min, default.alpha_p) == (
        0.01, 0.2, 1e-3, 0.03)  # fmt: skip
    assert (default.budget, default.update_scale, default.backprop_depth) == ("compute", 3.0, 1.0)
    # The paper's exact method stays one argument away, and the comparisons' "slsam" is it.
    paper = SparseLayerSAM(preset="paper")
    assert (paper.budget, paper.bandit_loss, paper.head_always_active, paper.update_scale) == (
        "count", "shifted", False, None)  # fmt: skip
    assert make_callback("slsam").preset == "paper"
    assert make_callback("slsam_default").preset == "default"
    assert SLS2SAM().preset == "paper"  # only SL-SAM's default moved
    # A model with no fresh head: the default trains every layer by sampling, silently.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SparseLayerSAM(seed=0).build_engine(make_mlp())
    from lightning_slsam.methods.subset import PRESET_WORDS

    assert set(PRESET_WORDS) == set(PRESETS)  # the run summary describes every preset
