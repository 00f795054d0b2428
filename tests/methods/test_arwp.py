"""ARWP (lightning_slsam.methods.arwp): one pass per step at weights moved by row-scaled
Gaussian noise from the method's own generator, shrunk by the running squared gradients and
grown over the run; equal to the authors' update written by hand, to AdamW when the noise
vanishes; resumed bit for bit; a run whose length is unknown is refused before any change."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import LitModel, Snapshots, loader, make_data, make_mlp, trainer

from lightning_slsam import ARWP, make_engine
from lightning_slsam.methods.arwp import noise_radius

SEED = 3


def _batches(n: int = 6):
    x, y = make_data(16 * n).tensors
    return [(x[i : i + 16].double(), y[i : i + 16]) for i in range(0, 16 * n, 16)]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _hand_written(net, batches, rho, growth, eta, beta, planned):
    """The authors' step (nblt/mARWP, utils.py ARWP.first_step/second_step and
    train_rwp_cos.py's CosineInc), with the noise of a generator seeded as the method seeds
    its own: per element ``F`` (a running sum of squared gradients), summed over each row
    when the noise is drawn."""
    net = copy.deepcopy(net)
    params = list(net.parameters())
    opt = _adamw(params)
    source = torch.Generator().manual_seed(SEED + 1)  # the engine's parts get seed + 1
    gen = torch.Generator().manual_seed(int(torch.randint(2**62, (), generator=source)))
    squares: dict[int, torch.Tensor] = {}
    history = []
    for t, (x, y) in enumerate(batches):
        std = rho * (1 + growth * (1 - math.cos(math.pi * min(t / planned, 1))) / 2)
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
                if p.dim() > 1:
                    rows = p.reshape(p.shape[0], -1)
                    noise = noise * (std * rows.norm(dim=1, keepdim=True)).view(-1, 1)
                    if id(p) in squares:
                        fisher = squares[id(p)].reshape(p.shape[0], -1).sum(dim=1, keepdim=True)
                        noise = noise / torch.sqrt(1 + eta * fisher)
                else:
                    noise = noise * std * p.norm()
                    if id(p) in squares:
                        noise = noise / torch.sqrt(1 + eta * squares[id(p)])
                p.add_(noise.view_as(p))
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
                g2 = p.grad.square()
                squares[id(p)] = g2 if id(p) not in squares else squares[id(p)] * beta + g2
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history


@pytest.mark.parametrize(("growth", "eta"), [(0.0, 0.0), (10.0, 0.1), (10.0, 5.0)])
def test_arwp_equals_the_authors_update_written_by_hand(growth, eta):
    # float64: the comparison measures the method, not float32 rounding (tests/tolerance.py)
    net, batches = make_mlp(seed=0).double(), _batches()
    rho, beta, planned = 0.05, 0.9, 6
    expected = _hand_written(net, batches, rho, growth, eta, beta, planned)
    ours = copy.deepcopy(net)
    opt = _adamw(list(ours.parameters()))
    engine = make_engine("arwp", ours, rho=rho, growth=growth, eta=eta, beta=beta, seed=SEED)
    engine.planned_steps = planned
    for (x, y), want in zip(batches, expected):
        result = engine.train_step(lambda x=x, y=y: F.cross_entropy(ours(x), y), opt)
        assert result.kind == "single" and result.num_backward == 1
        assert result.pass_numel == [engine.trainable_numel]
        for p, w in zip(ours.parameters(), want):  # the true weights, between steps
            torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-12)
    # The noise changed the run: without it (AdamW) the same steps end elsewhere.
    plain = copy.deepcopy(net)
    opt = _adamw(list(plain.parameters()))
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        opt.step()
    apart = max(
        float((p - q).detach().abs().max()) for p, q in zip(plain.parameters(), ours.parameters())
    )
    assert apart > 1e-4


def test_vanishing_noise_is_adamw():
    net, batches = make_mlp(seed=0).double(), _batches()
    ours, plain = copy.deepcopy(net), copy.deepcopy(net)
    engine = make_engine("arwp", ours, rho=1e-14, growth=0.0, seed=SEED)
    opts = _adamw(list(ours.parameters())), _adamw(list(plain.parameters()))
    for x, y in batches:
        engine.train_step(lambda x=x, y=y: F.cross_entropy(ours(x), y), opts[0])
        opts[1].zero_grad()
        F.cross_entropy(plain(x), y).backward()
        opts[1].step()
    for p, q in zip(ours.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10)


def test_the_noise_grows_from_rho_to_rho_times_one_plus_growth():
    assert noise_radius(0.01, 10.0, 0, 200) == 0.01
    assert noise_radius(0.01, 10.0, 100, 200) == pytest.approx(0.06)
    assert noise_radius(0.01, 10.0, 200, 200) == pytest.approx(0.11)
    assert noise_radius(0.01, 10.0, 400, 200) == pytest.approx(0.11)  # held after the plan
    assert noise_radius(0.01, 0.0, 50, math.inf) == 0.01


def test_a_resumed_engine_draws_and_shrinks_as_the_uninterrupted_one():
    batches = _batches(8)

    def run(stop=None, state=None):
        net = make_mlp(seed=0).double()
        opt = _adamw(list(net.parameters()))
        engine = make_engine("arwp", net, rho=0.05, growth=3.0, seed=SEED)
        engine.planned_steps = 8
        start = 0
        if state is not None:
            net.load_state_dict(state["net"])
            opt.load_state_dict(state["opt"])
            engine.load_state_dict(state["engine"])
            start = state["step"]
        for t, (x, y) in enumerate(batches[start:stop], start):
            engine.train_step(lambda x=x, y=y: F.cross_entropy(net(x), y), opt)
            if t + 1 == stop:
                saved = {"net": copy.deepcopy(net.state_dict()), "step": stop,
                         "opt": copy.deepcopy(opt.state_dict()),
                         "engine": copy.deepcopy(engine.state_dict())}  # fmt: skip
                return saved
        return net

    whole = run()
    resumed = run(state=run(stop=3))
    for p, q in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_a_run_of_unknown_length_is_refused_before_anything_changes():
    net = make_mlp(seed=0)
    start = copy.deepcopy(net.state_dict())
    opt = _adamw(list(net.parameters()))
    engine = make_engine("arwp", net, seed=SEED)  # growth 10: needs the run's length
    x, y = make_data(16).tensors
    with pytest.raises(ValueError, match=r"ARWP\(growth=10\).*engine.planned_steps.*growth=0"):
        engine.train_step(lambda: F.cross_entropy(net(x), y), opt)
    assert all(torch.equal(v, start[k]) for k, v in net.state_dict().items())
    assert not opt.state and all(p.requires_grad for p in net.parameters())


def test_under_a_trainer_the_run_length_is_the_trainers_and_the_weights_stay_true():
    # The callback hands the engine the trainer's planned steps (the noise grows over them);
    # after each step the module holds the weights the plain loop's update gives, never the
    # noisy ones.
    data = make_data(64)
    net = make_mlp(seed=0)
    snaps = Snapshots()
    callback = ARWP(rho=0.05, seed=SEED)
    trainer(callbacks=[callback, snaps], max_steps=4).fit(LitModel(copy.deepcopy(net)),
                                                          loader(data, 16))  # fmt: skip
    assert callback.engine.planned_steps == 4 and callback.engine.kind_counts == {"single": 4}
    ref = copy.deepcopy(net)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    engine = make_engine("arwp", ref, rho=0.05, seed=SEED)
    engine.planned_steps = 4
    for (x, y), after in zip(loader(data, 16), snaps.after):
        engine.train_step(lambda x=x, y=y: F.cross_entropy(ref(x), y), opt)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(after[f"net.{name}"], p.detach(), rtol=0, atol=0)
