"""Momentum-SAM (lightning_slsam.methods.momentum_sam): one pass per step at the weights
moved against the optimizer's normalised momentum, equal to its authors' update written by
hand; the weights are never left moved; an optimizer without momentum is refused before
anything changes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import LitModel, Snapshots, loader, make_data, make_mlp, trainer
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_slsam import MomentumSAM, make_engine
from lightning_slsam.methods.momentum_sam import MomentumSAMSpec, base_optimizer

RHO = 0.5


def _batches(n: int = 6):
    x, y = make_data(16 * n).tensors
    return [(x[i : i + 16].double(), y[i : i + 16]) for i in range(0, 16 * n, 16)]


def _hand_written(net, batches, make_opt, key: str, rho: float = RHO):
    """The authors' update, written from adamW_msam.py / msam.py: the gradient at
    ``w - rho * m / (||m|| + 1e-12)`` (one norm over every tensor), applied to ``w``."""
    net = copy.deepcopy(net)
    params = list(net.parameters())
    opt = make_opt(params)
    history = []
    for x, y in batches:
        moms = [opt.state[p][key] for p in params if p in opt.state]
        saved = [p.detach().clone() for p in params]
        if moms:
            norm = torch.linalg.vector_norm(torch.stack([m.norm() for m in moms]))
            with torch.no_grad():
                for p, m in zip(params, moms):
                    p.sub_(m * (rho / (norm + 1e-12)))
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history


@pytest.mark.parametrize(
    "make_opt, key",
    [
        (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01), "exp_avg"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01), "momentum_buffer"),
    ],
    ids=["adamw", "sgd"],
)
def test_momentum_sam_equals_the_authors_update_written_by_hand(make_opt, key):
    # float64: the comparison measures the method, not float32 rounding (tests/tolerance.py)
    net = make_mlp(seed=0).double()
    batches = _batches()
    expected = _hand_written(net, batches, make_opt, key)
    ours = copy.deepcopy(net)
    opt = make_opt(list(ours.parameters()))
    engine = make_engine("momentum_sam", ours, rho=RHO, seed=0)
    kinds = []
    for (x, y), want in zip(batches, expected):
        result = engine.train_step(lambda x=x, y=y: F.cross_entropy(ours(x), y), opt)
        kinds.append(result.kind)
        assert result.num_backward == 1 and result.pass_numel == [engine.trainable_numel]
        for p, w in zip(ours.parameters(), want):  # the true weights, between steps
            torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-12)
    assert kinds == ["plain"] + ["single"] * 5  # no momentum before the first update
    start = dict(net.named_parameters())
    moved = max(float((p - start[n]).abs().max()) for n, p in ours.named_parameters())
    assert moved > 1e-2  # the comparison can fail
    # The move changed the run: without it the same steps end elsewhere.
    unmoved = _hand_written(net, batches, make_opt, key, rho=0.0)[-1]
    assert max(float((a - b).abs().max()) for a, b in zip(expected[-1], unmoved)) > 1e-4


def test_the_move_is_against_the_momentum_and_undone_before_the_update():
    net = make_mlp(seed=0).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    engine = make_engine("momentum_sam", net, rho=RHO, seed=0)
    (x, y), (x2, y2) = _batches(2)
    engine.train_step(lambda: F.cross_entropy(net(x), y), opt)
    params = list(net.parameters())
    before = [p.detach().clone() for p in params]
    moms = [opt.state[p]["momentum_buffer"].clone() for p in params]
    norm = torch.linalg.vector_norm(torch.stack([m.norm() for m in moms]))
    seen = []

    def loss():
        seen.append([p.detach().clone() for p in params])
        return F.cross_entropy(net(x2), y2)

    engine.train_step(loss, opt)
    (during,) = seen
    for d, b, m in zip(during, before, moms):
        torch.testing.assert_close(d - b, -RHO * m / norm, rtol=1e-9, atol=1e-12)
    total = torch.linalg.vector_norm(torch.stack([(d - b).norm() for d, b in zip(during, before)]))
    assert float(total) == pytest.approx(RHO, rel=1e-9)  # the radius, over every tensor


@pytest.mark.parametrize(
    "make_opt",
    [lambda p: torch.optim.SGD(p, lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)],
    ids=["sgd-without-momentum", "adagrad"],
)
def test_an_optimizer_without_momentum_is_refused_before_anything_changes(make_opt):
    net = make_mlp(seed=0)
    opt = make_opt(net.parameters())
    engine = make_engine("momentum_sam", net, seed=0)
    before = [p.detach().clone() for p in net.parameters()]
    x, y = make_data(16).tensors
    with pytest.raises(ValueError, match="needs an optimizer that keeps one: AdamW"):
        engine.train_step(lambda: F.cross_entropy(net(x), y), opt)
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    assert all(float(st.get("step", 0)) == 0 for st in opt.state.values())  # never stepped
    assert engine.num_steps == 0

    # Under a Trainer, at fit start.
    class NoMomentum(LitModel):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(MisconfigurationException, match="SGD with momentum > 0; the training"):
        trainer(callbacks=[MomentumSAM()], max_steps=2).fit(
            NoMomentum(make_mlp(seed=0)), loader(make_data(32), 16)
        )


def test_options_that_shape_a_gradient_ascent_are_refused():
    for options in ({"adaptive": True}, {"perturbation_norm": "layer"}):
        with pytest.raises(ValueError, match="MomentumSAM: `adaptive` and `perturbation_norm`"):
            MomentumSAMSpec(**options)
    with pytest.raises(ValueError, match="MomentumSAM: `rho` must be a finite number > 0"):
        MomentumSAMSpec(rho=0)


def test_under_a_trainer_validation_and_checkpoints_see_the_true_weights(tmp_path):
    data = make_data(64)
    net = make_mlp(seed=0)
    snaps = Snapshots()
    model = LitModel(copy.deepcopy(net))
    trainer(callbacks=[MomentumSAM(rho=RHO), snaps], max_steps=4).fit(model, loader(data, 16))
    # The same steps in a plain loop, with the module's optimizer.
    ref = copy.deepcopy(net)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    engine = make_engine("momentum_sam", ref, rho=RHO, seed=0)
    for (x, y), after in zip(loader(data, 16), snaps.after):
        engine.train_step(lambda x=x, y=y: F.cross_entropy(ref(x), y), opt)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(after[f"net.{name}"], p.detach(), rtol=0, atol=0)
    kinds = model.trainer.callbacks[0].engine.kind_counts
    assert kinds["plain"] == 1 and kinds["single"] == 3


def test_base_optimizer_unwraps_the_frameworks_wrappers():
    opt = torch.optim.AdamW(make_mlp().parameters())

    class Wrapper:
        def __init__(self, inner):
            self.optimizer = inner

    class Lightning:
        def __init__(self, inner):
            self._optimizer = inner

    assert base_optimizer(Wrapper(Lightning(opt))) is opt and base_optimizer(opt) is opt
