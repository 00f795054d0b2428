"""Resuming a SAM fit from a checkpoint (a story across the callback, the engine and the
selection): equal to the uninterrupted run, and changed options applied."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from helpers import LitModel, ResumableLoader, loader, make_data, make_mlp, trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from examples.methods import SLSAMAblation
from lightning_slsam import CostAwareSLSAM, SparseLayerSAM


@pytest.mark.parametrize(
    ("method", "options"),
    [
        (SLSAMAblation, {"alpha_p": 0.05}),
        (SLSAMAblation, {"bandit_loss": "rank", "alpha_p": 0.5}),
        # A selection wrapper whose draws span the checkpoint: the depth cut's own generator.
        (CostAwareSLSAM, {}),
    ],
    ids=["alpha_p", "rank", "depth_cut"],
)
def test_resume_equals_uninterrupted(tmp_path, method, options):
    data = make_data(64)
    net = make_mlp(seed=5)

    def run(max_epochs, ckpt_path=None, callbacks=()):
        L.seed_everything(7)
        model = LitModel(copy.deepcopy(net))
        cb = method(layer_ratio=0.3, **options)
        t = trainer(callbacks=[cb, *callbacks], max_epochs=max_epochs, enable_checkpointing=True)
        t.fit(model, loader(data, 16), ckpt_path=ckpt_path)
        return model, cb

    full_model, full_cb = run(4)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    run(2, callbacks=[saver])
    ckpt = str(tmp_path / "epoch=1-step=8.ckpt")
    resumed_model, resumed_cb = run(4, ckpt_path=ckpt)

    for (name, a), b in zip(full_model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(full_cb.probs, resumed_cb.probs)
    assert not torch.allclose(full_cb.probs, torch.full_like(full_cb.probs, 0.3))
    assert torch.equal(full_cb.engine.counts, resumed_cb.engine.counts)
    assert resumed_cb.engine.num_steps == 16

    state = torch.load(ckpt, weights_only=False)["callbacks"]
    (key,) = [k for k in state if method.__name__ in k]
    assert state[key]["layer_names"] == full_cb.layer_names


def test_mid_epoch_resume_equals_uninterrupted(tmp_path):
    """From a step checkpoint mid-epoch; the loader must be resumable (Lightning's rule)."""
    data = make_data(96)  # 6 batches per epoch
    net = make_mlp(seed=5)

    def run(max_epochs, ckpt_path=None, callbacks=()):
        L.seed_everything(7)
        model = LitModel(copy.deepcopy(net))
        cb = SLSAMAblation(layer_ratio=0.3, alpha_p=0.05)
        t = trainer(callbacks=[cb, *callbacks], max_epochs=max_epochs, enable_checkpointing=True)
        t.fit(model, ResumableLoader(data, batch_size=16), ckpt_path=ckpt_path)
        return model, cb

    full_model, full_cb = run(2)
    run(1, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)])
    resumed_model, resumed_cb = run(2, ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"))
    for a, b in zip(full_model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(full_cb.probs, resumed_cb.probs)
    assert resumed_cb.engine.num_steps == 12


def _resumed_difference(tmp_path, make_loader, dropout: bool = False) -> float:
    """Largest weight difference between an 8-step run and the same run resumed from its
    checkpoint at the end of epoch 0 (step 4)."""
    data, net = make_data(64), make_mlp(seed=5)
    if dropout:  # draws its masks from the global random state
        net.insert(1, torch.nn.Dropout(0.1))

    def run(max_epochs, ckpt_path=None, callbacks=()):
        L.seed_everything(7)
        model = LitModel(copy.deepcopy(net))
        t = trainer(callbacks=[SparseLayerSAM(layer_ratio=0.5), *callbacks],
                    max_epochs=max_epochs, enable_checkpointing=bool(callbacks))  # fmt: skip
        t.fit(model, make_loader(data), ckpt_path=ckpt_path)
        return model

    whole = run(2)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    run(1, callbacks=[saver])
    again = run(2, ckpt_path=str(tmp_path / "epoch=0-step=4.ckpt"))
    return max((a - b).abs().max().item() for a, b in zip(whole.parameters(), again.parameters()))


def test_resume_is_exact_when_the_data_order_and_random_draws_are(tmp_path):
    # docs/methods.md ("Cost and state") states when a resumed run equals the uninterrupted
    # one; each case it names holds as written.
    from pathlib import Path

    from torch.utils.data import DistributedSampler

    docs = Path(__file__).resolve().parents[2] / "docs" / "methods.md"
    assert "a plain `DataLoader(..., shuffle=True)` does not" in docs.read_text()

    def seeded(data):  # a shuffled order that depends on the seed and the epoch only
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
        return DataLoader(data, batch_size=16, sampler=sampler)

    def shuffled(data):
        return DataLoader(data, batch_size=16, shuffle=True)

    assert _resumed_difference(tmp_path / "unshuffled", lambda d: loader(d, 16)) == 0.0
    assert _resumed_difference(tmp_path / "seeded", seeded) == 0.0
    # The documented caveats: another order, or other dropout masks, after the resume.
    assert _resumed_difference(tmp_path / "shuffled", shuffled) > 1e-4
    assert _resumed_difference(tmp_path / "dropout", lambda d: loader(d, 16), True) > 1e-4


def test_resume_with_changed_options_keeps_distribution_and_applies_new_options(tmp_path):
    data = make_data(64)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    first = SLSAMAblation(preset="paper", layer_ratio=0.3, alpha_p=0.05, seed=0)
    trainer(callbacks=[first, saver], max_epochs=1, enable_checkpointing=True).fit(
        LitModel(make_mlp()), loader(data, 16)
    )
    learned = first.probs.clone()

    resumed = SLSAMAblation(preset="paper", layer_ratio=0.5, alpha_p=0.0, seed=0)
    with pytest.warns(UserWarning, match=r"layer_ratio 0.3 -> 0.5.*alpha_p 0.05 -> 0.0"):
        trainer(callbacks=[resumed], max_epochs=2).fit(
            LitModel(make_mlp()), loader(data, 16), ckpt_path=str(tmp_path / "epoch=0-step=4.ckpt")
        )
    probs = resumed.probs
    assert probs.sum().item() == pytest.approx(0.5 * 8)
    # alpha_p = 0 freezes the distribution: the learned one, rescaled to the new budget
    # (no entry reaches the cap of 1 here, so the KL projection is a plain rescaling).
    assert not torch.allclose(learned, torch.full_like(learned, 0.3))
    assert probs.max() < 1
    torch.testing.assert_close(probs, learned * (4.0 / learned.sum()))


def test_a_fit_under_the_compute_budget_and_a_resume_that_switches_budget(tmp_path):
    def fit(budget, max_epochs, ckpt_path=None, callbacks=()):
        L.seed_everything(0)
        callback = SLSAMAblation(layer_ratio=0.3, budget=budget, bandit_loss="rank")
        t = trainer(callbacks=[callback, *callbacks], max_epochs=max_epochs,
                    enable_checkpointing=bool(callbacks))  # fmt: skip
        t.fit(LitModel(make_mlp(seed=5)), loader(make_data(64), 16), ckpt_path=ckpt_path)
        return callback

    saver = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    counted = fit("count", 1, callbacks=[saver])
    assert counted.bandit.costs is None
    with pytest.warns(UserWarning, match="budget 'count' -> 'compute'"):
        switched = fit("compute", 2, ckpt_path=str(tmp_path / "epoch=0-step=4.ckpt"))
    costs = switched.bandit.costs
    assert costs.tolist() == [float(n) for n in switched.partition.numel]
    share = float((costs * switched.probs).sum() / costs.sum())
    assert abs(share - 0.3) < 1e-9 and switched.engine.num_steps == 8
