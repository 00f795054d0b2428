"""SAM's ascent and its exact undo (:mod:`lightning_slsam.core.perturbation`): the radius,
per-layer norms, the backup, and ASAM's adaptive ascent against its reference code."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp
from probes import RHO, Recorder, fixed_engine, gradients, loss_closure, net_at, setup_engine
from tolerance import offset_atol, within
from torch import nn

from lightning_slsam import SAM, SparseLayerSAM
from lightning_slsam.core.perturbation import SAMPerturbation


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
    engine = fixed_engine(net, mask, rho=0.1, norm=norm)
    engine.train_step(loss_closure(net, x, y, observe=observe), opt)

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
            torch.testing.assert_close(e, 0.1 * g / gnorm, rtol=1e-4, atol=offset_atol(*before))
    else:
        for e, g in zip(perturbed, grads):  # one tensor per layer here
            assert e.norm().item() == pytest.approx(0.1, rel=1e-5)
            torch.testing.assert_close(e, 0.1 * g / g.norm(), rtol=1e-4, atol=offset_atol(*before))
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
    net, x, y, engine, opt = setup_engine(cb)
    with torch.no_grad():
        net[0].weight.zero_()  # a zero-valued weight tensor is still perturbed (eta)
    rec = Recorder(net, x, y)
    g = gradients(net, x, y)
    w = [p.detach().clone() for p in net.parameters()]
    engine.train_step(rec, opt)
    expected = _asam_reference(net_at(w, net), g, RHO, 0.01)
    for before, during, want in zip(w, rec.passes[1]["weights"], expected):
        torch.testing.assert_close(during - before, want, atol=offset_atol(before), rtol=1e-4)
    zero_weight = [n for n, _ in net.named_parameters()].index("0.weight")
    assert float((rec.passes[1]["weights"][zero_weight] - w[zero_weight]).abs().max()) > 0
    # Biases are perturbed unscaled: rho * g / ||T g|| (not rho * |b|^2 g / ...).
    bias = [n for n, _ in net.named_parameters()].index("3.bias")
    offset = rec.passes[1]["weights"][bias] - w[bias]
    largest = g[bias].abs().argmax()  # the ratio read where the offset's rounding matters least
    ratio = offset.flatten()[largest] / g[bias].flatten()[largest]
    torch.testing.assert_close(offset, ratio * g[bias], rtol=1e-4, atol=offset_atol(w[bias]))


def test_asam_on_sl_sam_perturbs_only_active_tensors_as_the_reference():
    cb = SparseLayerSAM(rho=RHO, layer_ratio=0.4, adaptive=True, seed=2)
    net, x, y, engine, opt = setup_engine(cb)
    g = gradients(net, x, y)
    w = [p.detach().clone() for p in net.parameters()]
    rec = Recorder(net, x, y)
    result = engine.train_step(rec, opt)
    active = result.active_mask.tolist()
    assert 0 < sum(active) < len(active)
    expected = _asam_reference(net_at(w, net), g, RHO, 0.01, active)
    for before, during, want in zip(w, rec.passes[1]["weights"], expected):
        torch.testing.assert_close(during - before, want, atol=offset_atol(before), rtol=1e-4)


@pytest.mark.parametrize("name", ["sam", "slsam_paper"])
def test_float64_models_get_float64_gradient_norms(name):
    """A float64 model's perturbation radius comes from a float64 norm: 20 SAM steps equal
    a float64 hand-written reference to float64 rounding (a float32 norm left 1e-7 to 1e-6)."""
    from lightning_slsam.methods.registry import method_spec

    torch.manual_seed(0)
    net = make_mlp().double()
    ref = copy.deepcopy(net)
    x, y = make_data(32).tensors
    x = x.double()
    extra = {"layer_ratio": 1.0} if name != "sam" else {}  # every layer: SAM's step
    engine = method_spec(name, rho=RHO, **extra).build_engine(net, seed=0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(20):
        engine.train_step(loss_closure(net, x, y), opt)
        g = gradients(ref, x, y)
        scale = RHO / (torch.sqrt(sum(gi.square().sum() for gi in g)) + 1e-12)
        with torch.no_grad():
            for p, gi in zip(ref.parameters(), g):
                p.add_(gi * scale)
        g2 = gradients(ref, x, y)
        with torch.no_grad():
            for p, gi in zip(ref.parameters(), g):
                p.sub_(gi * scale)
        ref_opt.zero_grad()
        for p, gi in zip(ref.parameters(), g2):
            p.grad = gi
        ref_opt.step()
    worst = max(float((a - b).abs().max()) for a, b in zip(net.parameters(), ref.parameters()))
    assert all(p.dtype == torch.float64 for p in net.parameters())
    assert within(worst, 1e-12), worst
