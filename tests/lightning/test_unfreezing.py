"""Tensors whose ``requires_grad`` the model or another callback switches mid-run (Lightning's
``BackboneFinetuning``): sampled like any layer from the next step on, with the selection's
state carried over and resume exact across the change."""

from __future__ import annotations

import csv
import logging

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import loader, make_data, trainer
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn

from lightning_slsam import SAMMixin, SparseLayerSAM
from lightning_slsam.core.partition import build_partition
from lightning_slsam.methods.registry import method_spec

UNFREEZE_AT = 2  # epoch; 4 steps per epoch
BACKBONE = ["backbone.0.weight", "backbone.0.bias", "backbone.2.weight", "backbone.2.bias"]
HEAD = ["head.weight", "head.bias"]


class Finetune(SAMMixin, L.LightningModule):
    """A backbone that Lightning's BackboneFinetuning keeps frozen until an epoch, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(torch.tanh(self.backbone(x))), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-2)


class Watch(L.Callback):
    """Which tensors each step changed, and the step's drawn layers."""

    def __init__(self, sam: SparseLayerSAM) -> None:
        self.sam, self.steps = sam, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        changed = {n for n, p in pl_module.named_parameters() if not torch.equal(p, self.before[n])}
        drawn = {n for n, on in zip(self.sam.layer_names, self.sam.active_mask.tolist()) if on}
        self.steps.append((changed, drawn, list(self.sam.layer_names)))


def _fit(callbacks, max_epochs, ckpt_path=None, **kwargs):
    model = Finetune()
    run = trainer(callbacks=callbacks, max_epochs=max_epochs, **kwargs)
    run.fit(model, loader(make_data(64), 16), ckpt_path=ckpt_path)
    return run, model


def test_tensors_unfrozen_by_backbone_finetuning_are_sampled_from_then_on(caplog):
    sam = SparseLayerSAM(layer_ratio=0.5, seed=0)
    watch = Watch(sam)
    with caplog.at_level(logging.INFO):
        _, model = _fit([BackboneFinetuning(UNFREEZE_AT), sam, watch], max_epochs=5)
    assert len(watch.steps) == 20
    before, after = watch.steps[: 4 * UNFREEZE_AT], watch.steps[4 * UNFREEZE_AT :]
    assert all(names == HEAD for _, _, names in before)
    assert all(names == BACKBONE + HEAD for _, _, names in after)
    # Each step changed exactly the layers it drew: the backbone is sampled, not trained
    # densely (before this, it changed in every step after the unfreeze).
    for changed, drawn, _ in watch.steps:
        assert changed == drawn
    for name in BACKBONE:
        assert 0 < sum(name in changed for changed, _, _ in after) < len(after), name
    engine = sam.engine
    assert engine.joined.tolist() == [8, 8, 8, 8, 0, 0]
    assert engine.layer_steps().tolist() == [12, 12, 12, 12, 20, 20]
    # The record: a joined layer's frequency is over the 12 steps it could be drawn in.
    with open(sam.frequency_csv_path) as handle:
        rows = {r["layer"]: r for r in csv.DictReader(handle)}
    for i, name in enumerate(BACKBONE + HEAD):
        want = int(engine.counts[i]) / (12 if name in BACKBONE else 20)
        assert rows[name]["frequency"] == f"{want:.6f}"
    assert int(engine.counts[:4].max()) <= 12 and int(engine.counts[:4].sum()) > 0
    # The bandit grew: every layer has a probability, and the budget holds.
    costs = torch.tensor(engine.partition.numel, dtype=torch.float64)
    assert sam.probs.numel() == 6
    torch.testing.assert_close((costs * sam.probs).sum(), 0.5 * costs.sum(), rtol=1e-9, atol=0)
    # The active ratio counts the backbone once it trains.
    total = sum(p.numel() for p in model.parameters())
    assert engine.last_result.trainable_numel == total
    assert (
        "SparseLayerSAM, before step 8: 4 tensors became trainable and are sampled as 4 new"
        " layers (backbone.0.weight, backbone.0.bias, backbone.2.weight, backbone.2.bias);"
        " 6 layers are sampled now."
    ) in caplog.text


class KeepUnfrozen(BackboneFinetuning):
    """BackboneFinetuning that unfreezes the backbone again when resumed after its epoch
    (Lightning's own restores the optimizer's groups, but leaves the backbone frozen)."""

    def finetune_function(self, pl_module, epoch, optimizer):
        super().finetune_function(pl_module, epoch, optimizer)
        if epoch > self.unfreeze_backbone_at_epoch:
            self.make_trainable(pl_module.backbone)


@pytest.mark.parametrize("stop", [UNFREEZE_AT, UNFREEZE_AT + 1], ids=["before", "after"])
def test_resume_across_the_change_is_exact(tmp_path, stop):
    def sam():
        return SparseLayerSAM(layer_ratio=0.5, seed=0)

    one, whole = sam(), None
    _, whole = _fit([KeepUnfrozen(UNFREEZE_AT), one], max_epochs=5)
    first, second = sam(), sam()
    run, _ = _fit([KeepUnfrozen(UNFREEZE_AT), first], max_epochs=stop)
    path = str(tmp_path / "stop.ckpt")
    run.save_checkpoint(path)
    _, resumed = _fit([KeepUnfrozen(UNFREEZE_AT), second], max_epochs=5, ckpt_path=path)
    for (name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(one.probs, second.probs)
    assert torch.equal(one.engine.counts, second.engine.counts)
    assert torch.equal(one.engine.joined, second.engine.joined)


def test_lightnings_backbone_finetuning_resumed_after_its_epoch_is_said_and_runs(tmp_path):
    """Resumed after the unfreeze epoch, Lightning's BackboneFinetuning leaves the backbone
    frozen: the run continues on the head, and a warning says what changed."""
    run, _ = _fit([BackboneFinetuning(UNFREEZE_AT), SparseLayerSAM(seed=0)], max_epochs=3)
    path = str(tmp_path / "after.ckpt")
    run.save_checkpoint(path)
    resumed = SparseLayerSAM(seed=0)
    with pytest.warns(UserWarning, match=r"saved with 6 sampled layers and the model now has 2"):
        _, model = _fit([BackboneFinetuning(UNFREEZE_AT), resumed], max_epochs=4, ckpt_path=path)
    assert resumed.layer_names == HEAD
    assert resumed.engine.num_steps == 16
    assert not any(p.requires_grad for p in model.backbone.parameters())


def test_a_frozen_layer_leaves_and_the_budget_is_projected_back():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    spec = method_spec("slsam_paper", layer_ratio=0.5)
    engine = spec.build_engine(net, seed=0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    for _ in range(5):
        engine.train_step(lambda: F.cross_entropy(net(x), y), opt)
    assert not engine.freezer.trainable_changed(net)
    net[1].requires_grad_(False)
    assert engine.freezer.trainable_changed(net)
    new, change = spec.follow_trainable(engine, net)
    assert change == (
        "2 tensors were frozen and 2 layers left the sampling (1.weight, 1.bias);"
        " 4 layers are sampled now."
    )
    kept = [0, 1, 4, 5]
    assert new.partition.names == [engine.partition.names[i] for i in kept]
    assert torch.equal(new.counts, engine.counts[kept])
    assert abs(float(new.selection.probs.sum()) - 0.5 * 4) < 1e-9
    assert bool((new.selection.probs >= 1e-3).all())
    for _ in range(3):
        new.train_step(lambda: F.cross_entropy(net(x), y), opt)
    assert not any(p.requires_grad for p in net[1].parameters())  # the user's freeze holds
    assert new.num_steps == 8


def test_trainable_changed_sees_only_the_models_own_switches():
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    net[0].weight.requires_grad_(False)
    freezer = method_spec("slsam").build_engine(net, seed=0).freezer
    assert not freezer.trainable_changed(net)
    freezer.activate(torch.tensor([False, True, False]))  # inside a step
    freezer.release()
    assert not freezer.trainable_changed(net)
    net[0].weight.requires_grad_(True)
    assert freezer.trainable_changed(net)
    assert build_partition(net).tensor_names() == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_fabric_samples_tensors_the_loop_unfreezes():
    """FabricSAM notices a tensor the loop unfroze between steps, as the callback does."""
    from lightning_slsam import FabricSAM

    L.seed_everything(0)
    fabric = L.Fabric(accelerator="cpu", devices=1)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    net[0].requires_grad_(False)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)  # all tensors: frozen ones idle
    model, optimizer = fabric.setup(net, optimizer)
    sam = FabricSAM(fabric, model, optimizer, "slsam_paper", layer_ratio=0.5, seed=0)
    x, y = make_data(16).tensors

    def loss_fn(batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    first = [p.detach().clone() for p in net[0].parameters()]
    for _ in range(3):
        sam.step(loss_fn, (x, y))
    assert sam.partition.names == ["2.weight", "2.bias"]
    assert all(torch.equal(a, b) for a, b in zip(first, net[0].parameters()))
    net[0].requires_grad_(True)
    masks = []
    for _ in range(6):
        before = [p.detach().clone() for p in net[0].parameters()]
        masks.append(sam.step(loss_fn, (x, y)).active_mask)
        moved = [not torch.equal(a, b) for a, b in zip(before, net[0].parameters())]
        assert moved == masks[-1][:2].tolist()  # trained exactly when drawn
    assert sam.partition.names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert sam.engine.joined.tolist() == [3, 3, 0, 0] and sam.engine.num_steps == 9
    assert any(bool(m[:2].any()) for m in masks) and not all(bool(m[:2].all()) for m in masks)
