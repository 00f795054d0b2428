"""MESA (lightning_slsam.methods.mesa): one training pass per step, its loss plus the
consistency term with the logits of the weights' moving average; equal to the authors'
step written by hand and to their loss on the same logits; at weight 0 plain AdamW bit for
bit (the average's forward leaves running statistics and random streams alone); resumed
bit for bit; a step without logits refused before anything changes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import Snapshots, loader, make_data, trainer
from torch import nn

from lightning_slsam import MESA, SAMMixin, make_engine
from lightning_slsam.methods.mesa import MESASpec, consistency


def _batches(n: int = 6, dtype=torch.float64):
    x, y = make_data(16 * n).tensors
    return [(x[i : i + 16].to(dtype), y[i : i + 16]) for i in range(0, 16 * n, 16)]


def _net(dtype=torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3)]
    return nn.Sequential(*layers).to(dtype)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _authors_kl(output, reference, tau):
    """MESA_train.py's term: F.kl_div of the softmax's log against the average's softmax,
    summed over the classes, averaged over the batch, times tau^2."""
    kl = F.kl_div(F.softmax(output / tau, dim=-1).log(), F.softmax(reference / tau, dim=-1),
                  reduction="none")  # fmt: skip
    return kl.sum(-1).mean() * tau**2


def _hand_written(net, batches, weight, tau, start_step, decay):
    """The authors' step: the average (timm's ModelEmaV2 over the parameters, here with the
    model's own buffers) run in evaluation mode on the batch, the term added from
    ``start_step`` on, the average moved after each update."""
    net = copy.deepcopy(net)
    average = copy.deepcopy(net)
    opt = _adamw(net.parameters())
    history = []
    for t, (x, y) in enumerate(batches):
        reference = None
        if t >= start_step:
            with torch.no_grad():
                for a, b in zip(average.buffers(), net.buffers()):
                    a.copy_(b)  # the model's own running statistics
                average.eval()
                reference = average(x)
        logits = net(x)
        loss = F.cross_entropy(logits, y)
        if reference is not None:
            loss = loss + weight * _authors_kl(logits, reference, tau)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            for a, w in zip(average.parameters(), net.parameters()):
                a.mul_(decay).add_(w, alpha=1 - decay)
        history.append([p.detach().clone() for p in net.parameters()])
    return history


def _loss_fn(net, x, y):
    def loss():
        logits = net(x)
        return {"loss": F.cross_entropy(logits, y), "logits": logits}

    return loss


@pytest.mark.parametrize("start", [0.0, 0.5])
def test_mesa_equals_the_authors_step_written_by_hand(start):
    net, batches = _net(), _batches()
    weight, tau, decay = 0.8, 5.0, 0.9
    torch.manual_seed(1)  # dropout's masks: the same stream on both sides
    expected = _hand_written(net, batches, weight, tau, int(start * 6), decay)
    ours = copy.deepcopy(net)
    opt = _adamw(ours.parameters())
    engine = make_engine("mesa", ours, weight=weight, tau=tau, start=start, decay=decay, seed=0)
    engine.planned_steps = 6
    torch.manual_seed(1)
    for (x, y), want in zip(batches, expected):
        result = engine.train_step(_loss_fn(ours, x, y), opt)
        assert result.kind == "plain" and result.num_backward == 1 and ours.training
        # float64; log_softmax against the authors' softmax().log() and the average's lerp
        # against mul/add round apart, AdamW's normalisation amplifies it (measured 2e-11)
        for p, w in zip(ours.parameters(), want):
            torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-9)
    # The term changed the run: without it the same steps end elsewhere.
    torch.manual_seed(1)
    plain = _hand_written(net, batches, 0.0, tau, 0, decay)[-1]
    assert max(float((a - b).abs().max()) for a, b in zip(expected[-1], plain)) > 1e-4


def test_the_term_equals_the_authors_loss_on_the_same_logits():
    torch.manual_seed(0)
    z, reference = torch.randn(32, 10) * 3, torch.randn(32, 10) * 3
    for tau in (1.0, 5.0):
        torch.testing.assert_close(consistency(z.double(), reference.double(), tau),
                                   _authors_kl(z.double(), reference.double(), tau),
                                   rtol=1e-12, atol=1e-12)  # fmt: skip
        torch.testing.assert_close(consistency(z, reference, tau), _authors_kl(z, reference, tau),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
    # A language model's logits: summed over the vocabulary, averaged over every token.
    tokens = torch.randn(4, 7, 11)
    flat = consistency(tokens.reshape(28, 11), tokens.roll(1, 0).reshape(28, 11), 5.0)
    torch.testing.assert_close(consistency(tokens, tokens.roll(1, 0), 5.0), flat)


def test_at_weight_zero_mesa_is_adamw_bit_for_bit():
    # The average's forward runs in evaluation mode: running statistics and dropout's random
    # stream are as a plain step leaves them.
    net, batches = _net(torch.float32), _batches(dtype=torch.float32)
    ours, plain = copy.deepcopy(net), copy.deepcopy(net)
    engine = make_engine("mesa", ours, weight=0.0, start=0.0, seed=0)
    opts = _adamw(ours.parameters()), _adamw(plain.parameters())
    torch.manual_seed(3)
    for x, y in batches:
        engine.train_step(_loss_fn(ours, x, y), opts[0])
    torch.manual_seed(3)
    for x, y in batches:
        opts[1].zero_grad()
        F.cross_entropy(plain(x), y).backward()
        opts[1].step()
    for a, b in zip(ours.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b)


def test_a_resumed_engine_continues_as_the_uninterrupted_one():
    batches = _batches(8)

    def run(stop=None, state=None):
        net = _net()
        opt = _adamw(net.parameters())
        engine = make_engine("mesa", net, start=0.0, decay=0.8, seed=0)
        start = 0
        if state is not None:
            net.load_state_dict(state["net"])
            opt.load_state_dict(state["opt"])
            engine.load_state_dict(state["engine"])
            start = state["step"]
        for t, (x, y) in enumerate(batches[start:stop], start):
            torch.manual_seed(t)  # dropout
            engine.train_step(_loss_fn(net, x, y), opt)
            if t + 1 == stop:
                return {"net": copy.deepcopy(net.state_dict()), "step": stop,
                        "opt": copy.deepcopy(opt.state_dict()),
                        "engine": copy.deepcopy(engine.state_dict())}  # fmt: skip
        return net

    whole, resumed = run(), run(state=run(stop=3))
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


def test_a_step_without_logits_is_refused_before_anything_changes():
    net = _net(torch.float32)
    start = copy.deepcopy(net.state_dict())
    opt = _adamw(net.parameters())
    engine = make_engine("mesa", net, start=0.0, seed=0)
    x, y = _batches(1, torch.float32)[0]
    with pytest.raises(ValueError, match=r"MESA reads the training step's 'logits'.*'logits':"):
        engine.train_step(lambda: F.cross_entropy(net(x), y), opt)
    assert all(torch.equal(v, start[k]) for k, v in net.state_dict().items())
    assert not opt.state and net.training


def test_options_that_shape_an_ascent_are_refused():
    for options in ({"rho": 0.05}, {"adaptive": True}, {"perturbation_norm": "layer"}):
        with pytest.raises(ValueError, match="MESA: `rho`, `adaptive` and `perturbation_norm`"):
            MESASpec(**options)
    with pytest.raises(ValueError, match=r"MESA: `start` must be in \[0, 1\)"):
        MESASpec(start=1.0)


class Logits(SAMMixin, __import__("lightning").LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        logits = self.net(batch[0])
        return {"loss": F.cross_entropy(logits, batch[1]), "logits": logits}

    def configure_optimizers(self):
        return _adamw(self.parameters())


def test_under_a_trainer_the_term_starts_at_its_fraction_of_the_planned_steps():
    data = make_data(64)
    net = _net(torch.float32)
    snaps = Snapshots()
    callback = MESA(start=0.5, decay=0.9)
    torch.manual_seed(5)
    trainer([callback, snaps], max_steps=4).fit(Logits(copy.deepcopy(net)), loader(data, 16))
    assert callback.engine.planned_steps == 4
    ref = copy.deepcopy(net)
    opt = _adamw(ref.parameters())
    engine = make_engine("mesa", ref, start=0.5, decay=0.9, seed=0)
    engine.planned_steps = 4
    torch.manual_seed(5)
    for (x, y), after in zip(loader(data, 16), snaps.after):
        engine.train_step(_loss_fn(ref, x, y), opt)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(after[f"net.{name}"], p.detach(), rtol=0, atol=0)
