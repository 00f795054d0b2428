"""SAF (lightning_slsam.methods.saf): one training pass per step, its loss plus the
consistency term with each sample's logits ``delay`` epochs ago; equal to the authors' step
written by hand (their ring of per-epoch logits); at weight 0 plain AdamW bit for bit;
resumed bit for bit; under DDP, with the samples dealt out anew each epoch, equal to one
process (the store the same everywhere); refused before anything changes without logits and
indices, or where the store would hold a vocabulary per token."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp, two_ranks

from lightning_slsam import SAF, make_engine
from lightning_slsam.methods.saf import MAX_LOGITS, SAFSpec

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N, BATCH, EPOCHS = 32, 8, 5


def _epochs(seed: int = 0):
    """Each epoch's batches of (x, y, index), the samples shuffled anew every epoch."""
    x, y = make_data(N).tensors
    x = x.double()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(EPOCHS):
        order = torch.randperm(N, generator=gen)
        yield [(x[i], y[i], i) for i in order.split(BATCH)]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _hand_written(net, weight, tau, delay, start_epoch):
    """SAF_train.py's step: ``train_logits[indices, epoch % (delay + 1)]`` recorded every
    step; from ``epoch > kl_start_epoch`` on the term against
    ``train_logits[indices, (epoch - delay) % (delay + 1)]``, F.kl_div of the softmax's log
    against the past softmax, summed over the classes, averaged over the batch, times
    tau^2."""
    net = copy.deepcopy(net)
    opt = _adamw(net.parameters())
    bank = torch.zeros(N, delay + 1, 3, dtype=torch.float64)
    history = []
    for epoch, batches in enumerate(_epochs()):
        for x, y, index in batches:
            output = net(x)
            bank[index, epoch % (delay + 1)] = output.detach()
            loss = F.cross_entropy(output, y)
            if epoch > start_epoch:
                past = bank[index, (epoch - delay) % (delay + 1)]
                kl = F.kl_div(F.softmax(output / tau, dim=-1).log(),
                              F.softmax(past / tau, dim=-1), reduction="none")  # fmt: skip
                loss = loss + weight * kl.sum(-1).mean() * tau**2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            history.append([p.detach().clone() for p in net.parameters()])
    return history


def _loss_fn(net, x, y, index):
    def loss():
        logits = net(x)
        return {"loss": F.cross_entropy(logits, y), "logits": logits, "index": index}

    return loss


@pytest.mark.parametrize(("delay", "start_epoch"), [(1, 1), (2, 2), (2, 3)])
def test_saf_equals_the_authors_step_written_by_hand(delay, start_epoch):
    net = make_mlp(seed=0).double()
    weight, tau = 0.8, 2.0
    expected = _hand_written(net, weight, tau, delay, start_epoch)
    ours = copy.deepcopy(net)
    opt = _adamw(ours.parameters())
    engine = make_engine("saf", ours, weight=weight, tau=tau, delay=delay,
                         start_epoch=start_epoch, seed=0)  # fmt: skip
    steps = [b for batches in _epochs() for b in batches]
    for (x, y, index), want in zip(steps, expected):
        result = engine.train_step(_loss_fn(ours, x, y, index), opt)
        assert result.kind == "plain" and result.num_backward == 1
        # float64; log_softmax against the authors' softmax().log() (measured under 1e-12)
        for p, w in zip(ours.parameters(), want):
            torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-9)
    assert engine.parts.visits.tolist() == [EPOCHS] * N
    # The term changed the run: without it the same steps end elsewhere.
    plain = _hand_written(net, 0.0, tau, delay, start_epoch)[-1]
    assert max(float((a - b).abs().max()) for a, b in zip(expected[-1], plain)) > 1e-4


def test_at_weight_zero_saf_is_adamw_bit_for_bit():
    net = make_mlp(seed=0)
    ours, plain = copy.deepcopy(net), copy.deepcopy(net)
    engine = make_engine("saf", ours, weight=0.0, delay=1, start_epoch=0, seed=0)
    opts = _adamw(ours.parameters()), _adamw(plain.parameters())
    for batches in _epochs():
        for x, y, index in batches:
            engine.train_step(_loss_fn(ours, x.float(), y, index), opts[0])
            opts[1].zero_grad()
            F.cross_entropy(plain(x.float()), y).backward()
            opts[1].step()
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), plain.parameters()))


def test_a_resumed_engine_continues_as_the_uninterrupted_one():
    steps = [b for batches in _epochs() for b in batches]

    def run(stop=None, state=None):
        net = make_mlp(seed=0).double()
        opt = _adamw(net.parameters())
        engine = make_engine("saf", net, delay=1, start_epoch=1, seed=0)
        start = 0
        if state is not None:
            net.load_state_dict(state["net"])
            opt.load_state_dict(state["opt"])
            engine.load_state_dict(state["engine"])
            start = state["step"]
        for t, (x, y, index) in enumerate(steps[start:stop], start):
            engine.train_step(_loss_fn(net, x, y, index), opt)
            if t + 1 == stop:
                return {"net": copy.deepcopy(net.state_dict()), "step": stop,
                        "opt": copy.deepcopy(opt.state_dict()),
                        "engine": copy.deepcopy(engine.state_dict())}  # fmt: skip
        return net

    whole, resumed = run(), run(state=run(stop=9))  # mid-epoch, after the term started
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters()))


@pytest.mark.parametrize("given", [("logits",), ("index",), ()], ids=["no-index", "no-logits",
                                                                      "neither"])  # fmt: skip
def test_a_step_without_logits_and_indices_is_refused_before_anything_changes(given):
    net = make_mlp(seed=0)
    start = copy.deepcopy(net.state_dict())
    opt = _adamw(net.parameters())
    engine = make_engine("saf", net, seed=0)
    x, y = make_data(8).tensors

    def loss():
        logits = net(x)
        out = {"loss": F.cross_entropy(logits, y), "logits": logits, "index": torch.arange(8)}
        return {k: v for k, v in out.items() if k == "loss" or k in given}

    with pytest.raises(ValueError, match=r"SAF reads the training step's 'logits' and 'index'"):
        engine.train_step(loss, opt)
    assert all(torch.equal(v, start[k]) for k, v in net.state_dict().items()) and not opt.state


def test_a_vocabulary_per_token_is_refused_naming_mesa():
    emb = torch.nn.Embedding(200, 128)
    opt = _adamw(emb.parameters())
    engine = make_engine("saf", emb, seed=0)
    tokens = torch.randint(0, 200, (2, 129))  # 129 tokens x 128 logits > MAX_LOGITS
    assert MAX_LOGITS < 129 * 128

    def loss():
        logits = emb(tokens)
        return {"loss": logits.mean(), "logits": logits, "index": torch.arange(2)}

    before = emb.weight.detach().clone()
    with pytest.raises(ValueError, match=r"SAF stores .* a language model's .* use MESA"):
        engine.train_step(loss, opt)
    assert torch.equal(emb.weight, before)


def test_options_that_shape_an_ascent_are_refused():
    with pytest.raises(ValueError, match="SAF: `rho`, `adaptive` and `perturbation_norm`"):
        SAFSpec(rho=0.05)
    with pytest.raises(ValueError, match=r"SAF: `delay` must be an integer >= 1"):
        SAF(delay=0)


def test_under_ddp_the_store_follows_the_samples_between_processes(tmp_path):
    # Each epoch a DistributedSampler deals the samples out anew: a sample's past logits
    # come from the other process as often as not. Every process records both processes'
    # logits, so the store, and the run, are one process's.
    ranks = two_ranks(os.path.join(TESTS, "saf_ddp_worker.py"), tmp_path)
    moved = 0
    for epoch, (r0, r1) in enumerate(zip(ranks[0]["epochs"], ranks[1]["epochs"])):
        assert torch.equal(r0["visits"], r0["ref_visits"]) and r0["visits"].min() == epoch + 1
        torch.testing.assert_close(r0["store"], r0["ref_store"], rtol=0, atol=1e-6)
        assert torch.equal(r0["store"], r1["store"])
        for w, ref in zip(r0["weights"], r0["ref_weights"]):
            torch.testing.assert_close(w, ref, rtol=0, atol=1e-5)
        if epoch:
            before = set(ranks[0]["epochs"][epoch - 1]["samples"])
            moved += len(before - set(r0["samples"]))
    assert moved > 0  # samples did move between the processes
