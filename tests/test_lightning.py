"""The Lightning surface: exactness against plain SAM, masks, schedulers, checkpoints."""

from __future__ import annotations

import copy
import csv
import os

import lightning as L
import pytest
import torch
from helpers import (
    LitModel,
    ResumableLoader,
    Snapshots,
    loader,
    make_data,
    make_mlp,
    reference_sam_adamw,
    trainer,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_slsam import SparseLayerSAM


def _batches(dataset, batch_size):
    return [(x, y) for x, y in loader(dataset, batch_size)]


def test_layer_ratio_one_equals_hand_written_sam_adamw():
    data = make_data(64)
    net = make_mlp()
    reference = reference_sam_adamw(
        net, _batches(data, 16) * 2, rho=0.05, lr=1e-2, weight_decay=0.01
    )

    model = LitModel(copy.deepcopy(net), lr=1e-2, weight_decay=0.01)
    snaps = Snapshots()
    cb = SparseLayerSAM(rho=0.05, layer_ratio=1.0)
    trainer(callbacks=[cb, snaps], max_epochs=2).fit(model, loader(data, 16))

    assert len(snaps.after) == len(reference) == 8
    assert all(bool(mask.all()) for mask in snaps.masks)
    for step, (ours, ref) in enumerate(zip(snaps.after, reference)):
        for name, value in ref.items():
            torch.testing.assert_close(
                ours[f"net.{name}"], value, rtol=0, atol=1e-6, msg=f"step {step} {name}"
            )
    # The run moved far from the start: the comparison is not trivially satisfied.
    start = dict(net.named_parameters())
    moved = max((reference[-1][n] - start[n]).abs().max().item() for n in start)
    assert moved > 1e-2


def test_sparse_step_changes_exactly_the_active_tensors():
    model = LitModel(make_mlp(), lr=1e-2, weight_decay=0.1)
    snaps = Snapshots()
    cb = SparseLayerSAM(rho=0.05, layer_ratio=0.3, seed=3)
    trainer(callbacks=[cb, snaps], max_epochs=3).fit(model, loader(make_data(64), 16))

    names = cb.layer_names
    assert names == [n for n, _ in model.named_parameters()]
    previous = snaps.before
    partial = 0
    for after, mask in zip(snaps.after, snaps.masks):
        changed = [not torch.equal(after[n], previous[n]) for n in names]
        assert changed == mask.tolist()
        partial += 0 < int(mask.sum()) < len(names)
        previous = after
    assert partial >= 6  # most steps trained a strict subset


def test_frozen_tensors_keep_no_grad_no_state_and_no_decay():
    model = LitModel(make_mlp(), lr=1e-2, weight_decay=0.5)
    seen = {}

    class Probe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            mask = cb.engine.last_result  # not yet set for this step
            seen["grads"] = {n: p.grad is not None for n, p in pl_module.named_parameters()}
            seen["requires"] = {n: p.requires_grad for n, p in pl_module.named_parameters()}
            del mask

    cb = SparseLayerSAM(rho=0.05, layer_ratio=0.3, seed=1)
    trainer(callbacks=[cb, Probe()], max_steps=1).fit(model, loader(make_data(32), 16))
    mask = cb.active_mask.tolist()
    names = cb.layer_names
    assert [seen["grads"][n] for n in names] == mask
    assert [seen["requires"][n] for n in names] == mask  # frozen during the step
    # Outside the step every tensor is trainable again.
    assert all(p.requires_grad for p in model.parameters())
    opt = model.trainer.optimizers[0]
    params = dict(model.named_parameters())
    for name, active in zip(names, mask):
        state = opt.state.get(params[name], {})
        assert (len(state) > 0) == active


def test_without_callback_module_trains_as_plain_automatic_optimization():
    data = make_data(48)
    net = make_mlp()
    model = LitModel(copy.deepcopy(net), lr=1e-2)
    snaps = Snapshots()
    trainer(callbacks=[snaps], max_epochs=1).fit(model, loader(data, 16))
    assert model.automatic_optimization is True

    ref = copy.deepcopy(net)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for x, y in _batches(data, 16):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    for name, value in ref.named_parameters():
        torch.testing.assert_close(snaps.after[-1][f"net.{name}"], value, rtol=0, atol=1e-6)


def test_global_step_checkpoints_and_step_scheduler(tmp_path):
    model = LitModel(
        make_mlp(),
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        scheduler_config={"interval": "step", "frequency": 2},
    )
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    cb = SparseLayerSAM(layer_ratio=0.5)
    t = trainer(callbacks=[cb, ckpt], max_epochs=2, enable_checkpointing=True)
    t.fit(model, loader(make_data(96), 16))  # 6 batches per epoch, 12 steps
    assert t.global_step == 12
    files = sorted(os.listdir(tmp_path / "ckpt"))
    assert files == sorted(f"epoch={(s - 1) // 6}-step={s}.ckpt" for s in (3, 6, 9, 12))
    # frequency=2 counts the batch index within the epoch, as Lightning does: 3 per epoch.
    lr = t.optimizers[0].param_groups[0]["lr"]
    assert lr == pytest.approx(1e-2 * 0.5**6)


def test_epoch_interval_scheduler_and_plateau():
    model = LitModel(
        make_mlp(),
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1),
        scheduler_config={"interval": "epoch"},
    )
    t = trainer(callbacks=[SparseLayerSAM(layer_ratio=0.5)], max_epochs=3)
    t.fit(model, loader(make_data(32), 16))
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.1**3)

    plateau = LitModel(
        make_mlp(),
        lr=1e-2,
        scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(
            opt, mode="max", factor=0.5, patience=0
        ),
        scheduler_config={"monitor": "const", "interval": "epoch"},
    )

    class Const(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            pl_module.log("const", 1.0)

    t = trainer(callbacks=[SparseLayerSAM(layer_ratio=0.5), Const()], max_epochs=4)
    t.fit(plateau, loader(make_data(32), 16))
    # "const" never improves after epoch 0: halved after epochs 1 and 2; epoch 3's update
    # would come at the start of a next epoch that does not run.
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**2)


@pytest.mark.parametrize(
    "options",
    [
        {"alpha_p": 0.05},
        # The rank loss and a dense warm-up that spans the checkpoint (steps 0-11 of 16).
        {"bandit_loss": "rank", "alpha_p": 0.5, "dense_warmup": 12},
    ],
)
def test_resume_equals_uninterrupted(tmp_path, options):
    data = make_data(64)
    net = make_mlp(seed=5)

    def run(max_epochs, ckpt_path=None, callbacks=()):
        L.seed_everything(7)
        model = LitModel(copy.deepcopy(net))
        cb = SparseLayerSAM(layer_ratio=0.3, **options)
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
    (key,) = [k for k in state if "SparseLayerSAM" in k]
    assert state[key]["layer_names"] == full_cb.layer_names


def test_mid_epoch_resume_equals_uninterrupted(tmp_path):
    """From a step checkpoint mid-epoch; the loader must be resumable (Lightning's rule)."""
    data = make_data(96)  # 6 batches per epoch
    net = make_mlp(seed=5)

    def run(max_epochs, ckpt_path=None, callbacks=()):
        L.seed_everything(7)
        model = LitModel(copy.deepcopy(net))
        cb = SparseLayerSAM(layer_ratio=0.3, alpha_p=0.05)
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

    from torch.utils.data import DataLoader, DistributedSampler

    docs = Path(__file__).resolve().parents[1] / "docs" / "methods.md"
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


def test_metrics_logged_every_step_and_frequency_record(tmp_path):
    logger = CSVLogger(tmp_path, name="run")
    cb = SparseLayerSAM(layer_ratio=0.5, seed=0)
    t = trainer(callbacks=[cb], max_epochs=2, logger=logger, log_every_n_steps=1)
    t.fit(LitModel(make_mlp()), loader(make_data(64), 16))

    with open(os.path.join(logger.log_dir, "metrics.csv")) as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("slsam/active_ratio")]
    assert len(rows) == 8
    for row in rows:
        ratio = float(row["slsam/active_ratio"])
        per_pass = float(row["slsam/active_ratio_pass1"])
        assert ratio == pytest.approx(2 * per_pass)
        assert 0 < per_pass <= 1
        assert 1 <= float(row["slsam/active_layers"]) <= 6
        assert 0 < float(row["slsam/entropy"]) <= 1
        assert float(row["slsam/backward_passes"]) == 2
    mean = sum(float(r["slsam/active_ratio"]) for r in rows) / len(rows)
    assert cb.mean_active_ratio == pytest.approx(mean, rel=1e-5)

    assert cb.frequency_csv_path == os.path.join(logger.log_dir, "slsam_layer_frequency.csv")
    with open(cb.frequency_csv_path) as handle:
        table = list(csv.DictReader(handle))
    assert [r["layer"] for r in table] == cb.layer_names
    assert [int(r["activations"]) for r in table] == cb.engine.counts.tolist()
    assert sum(int(r["activations"]) for r in table) == sum(
        float(r["slsam/active_layers"]) for r in rows
    )
    assert os.path.getsize(cb.frequency_plot_path) > 10_000  # a real PNG chart


def test_gradient_clipping_option_clips_the_update_gradient():
    norms = []

    class Probe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))

    cb = SparseLayerSAM(layer_ratio=1.0, gradient_clip_val=0.01)
    # The SAM callback's hook runs first (it is listed first), then the probe.
    trainer(callbacks=[cb, Probe()], max_steps=3).fit(
        LitModel(make_mlp()), loader(make_data(48), 16)
    )
    assert len(norms) == 3
    assert all(n <= 0.01 + 1e-6 for n in norms)


def test_accumulation_equals_large_batch_step():
    data = make_data(64)
    net = make_mlp()
    big = Snapshots()
    trainer(callbacks=[SparseLayerSAM(layer_ratio=1.0), big], max_steps=2).fit(
        LitModel(copy.deepcopy(net)), loader(data, 32)
    )
    small = Snapshots()
    t = trainer(
        callbacks=[SparseLayerSAM(layer_ratio=1.0, accumulate_grad_batches=4), small],
        max_steps=2,
    )
    t.fit(LitModel(copy.deepcopy(net)), loader(data, 8))
    assert t.global_step == 2
    stepped = [small.after[3], small.after[7]]
    for ours, ref in zip(stepped, big.after):
        for name in ref:
            torch.testing.assert_close(ours[name], ref[name], rtol=0, atol=1e-5)


def test_resume_with_changed_options_keeps_distribution_and_applies_new_options(tmp_path):
    data = make_data(64)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    first = SparseLayerSAM(preset="paper", layer_ratio=0.3, alpha_p=0.05, seed=0)
    trainer(callbacks=[first, saver], max_epochs=1, enable_checkpointing=True).fit(
        LitModel(make_mlp()), loader(data, 16)
    )
    learned = first.probs.clone()

    resumed = SparseLayerSAM(preset="paper", layer_ratio=0.5, alpha_p=0.0, seed=0)
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


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "64-true"])
def test_precisions_keep_the_contract(precision):
    model = LitModel(make_mlp())
    snaps = Snapshots()
    cb = SparseLayerSAM(layer_ratio=0.4, seed=0)
    trainer(callbacks=[cb, snaps], max_steps=6, precision=precision).fit(
        model, loader(make_data(96), 16)
    )
    previous = snaps.before
    for after, mask in zip(snaps.after, snaps.masks):
        assert [not torch.equal(after[n], previous[n]) for n in cb.layer_names] == mask.tolist()
        previous = after
    assert cb.engine.num_skipped == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # The default's compute budget: 40% of the parameters drawn per step, in expectation.
    costs, probs = cb.engine.selection.costs, cb.engine.selection.probs
    assert float((costs * probs).sum()) == pytest.approx(0.4 * float(costs.sum()))


@pytest.mark.parametrize(("max_epochs", "max_steps", "expected"), [(2, -1, 6), (2, 5, 5)])
def test_estimated_stepping_batches_counts_the_plugins_accumulation(
    max_epochs, max_steps, expected
):
    from lightning_slsam import estimated_stepping_batches

    seen = {}

    class Probe(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            seen["estimate"] = estimated_stepping_batches(trainer)

    cb = SparseLayerSAM(layer_ratio=0.5, accumulate_grad_batches=4)
    t = trainer(callbacks=[cb, Probe()], max_epochs=max_epochs, max_steps=max_steps)
    t.fit(LitModel(make_mlp()), loader(make_data(80), 8))  # 10 batches: groups of 4, 4, 2
    assert seen["estimate"] == expected == t.global_step
