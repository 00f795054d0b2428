"""The Lightning step driver (:mod:`lightning_slsam.lightning.driver`): LR schedulers,
clipping, gradient accumulation, the fp16 gradient scaler, and what a step hands back."""

from __future__ import annotations

import copy
import os
import re

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import LitModel, Snapshots, loader, make_data, make_mlp, trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from probes import fp16

from examples.methods import SLSAMAblation
from lightning_slsam import ESAM, SAM, SparseLayerSAM
from lightning_slsam.core.passes import read_output
from lightning_slsam.lightning.driver import StepDriver, driver_of, find_sam_callback

# -- LR schedulers ---------------------------------------------------------------------------------


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


# -- clipping --------------------------------------------------------------------------------------


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


def test_clip_by_value_in_fp32():
    seen = []

    class Probe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(max(p.grad.abs().max().item() for p in pl_module.parameters()))

    trainer(
        callbacks=[SAM(gradient_clip_val=2e-3, gradient_clip_algorithm="value"), Probe()],
        max_steps=3,
    ).fit(LitModel(make_mlp()), loader(make_data(48), 16))
    assert max(seen) == pytest.approx(2e-3)


# -- accumulation ----------------------------------------------------------------------------------


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


def test_sl_sam_accumulation_equals_the_large_batch_step():
    data, net = make_data(64), make_mlp()
    runs = []
    for accumulate, batch in ((1, 32), (4, 8)):
        snaps = Snapshots()
        cb = SLSAMAblation(
            layer_ratio=0.4, alpha_p=0.05, seed=3, accumulate_grad_batches=accumulate
        )
        t = trainer(callbacks=[cb, snaps], max_steps=2)
        t.fit(LitModel(copy.deepcopy(net)), loader(data, batch))
        runs.append((snaps.after[accumulate - 1 :: accumulate], cb))
    (big, big_cb), (small, small_cb) = runs
    assert small_cb.engine.selection.num_updates == big_cb.engine.selection.num_updates == 2
    assert torch.equal(small_cb.engine.counts, big_cb.engine.counts)
    for ours, ref in zip(small, big):
        for name in ref:
            torch.testing.assert_close(ours[name], ref[name], rtol=0, atol=1e-5)
    torch.testing.assert_close(small_cb.probs, big_cb.probs, rtol=1e-5, atol=1e-7)


# -- the fp16 gradient scaler ----------------------------------------------------------------------


class Spiky(LitModel):
    """Overflows (loss * inf) in one pass of one step."""

    def __init__(self, bad_step: int, bad_pass: int, **kwargs):
        super().__init__(make_mlp(), **kwargs)
        self.bad_step, self.bad_pass = bad_step, bad_pass

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == self.bad_step and self.sam_pass == self.bad_pass:
            loss = loss * float("inf")
        return loss


class StepState(L.Callback):
    """Weights, optimizer state, probabilities and loss scale after every step."""

    def __init__(self, cb):
        self.cb, self.states = cb, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = trainer.optimizers[0]
        self.states.append(
            {
                "weights": [p.detach().clone() for p in pl_module.parameters()],
                "adam": copy.deepcopy(opt.state_dict()["state"]),
                "probs": self.cb.probs.clone(),
                "scale": trainer.precision_plugin.scaler.get_scale(),
                "global_step": trainer.global_step,
            }
        )


def test_fp16_selection_learns_from_unscaled_norms():
    cb = SparseLayerSAM(layer_ratio=0.5, seed=0)
    seen = []
    model = LitModel(make_mlp())
    data = make_data(32)

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            reference = copy.deepcopy(pl_module.net).float()
            F.cross_entropy(reference(batch[0]), batch[1]).backward()
            seen.append(torch.stack([p.grad.norm() for p in reference.parameters()]))
            update = cb.engine.selection.update
            cb.engine.selection.update = lambda a, n: seen.append((a, n)) or update(a, n)

    trainer(callbacks=[cb, Watch()], max_steps=1, plugins=[fp16(2.0**14)]).fit(
        model, loader(data, 32)
    )
    reference, (active, norms) = seen
    ratio = norms[active] / reference[active].double()
    assert ratio.min() > 0.95 and ratio.max() < 1.05  # not 2**14 times larger


@pytest.mark.parametrize("bad_pass", [1, 2])
def test_fp16_overflow_in_either_pass_skips_the_step_and_backs_off_the_scaler(bad_pass):
    cb = SLSAMAblation(layer_ratio=0.5, alpha_p=0.05, seed=0, gradient_clip_val=1.0)
    state = StepState(cb)
    model = Spiky(bad_step=2, bad_pass=bad_pass)
    with pytest.warns(
        RuntimeWarning, match=f"skipped step 2.*{'first' if bad_pass == 1 else 'second'} pass"
    ):
        t = trainer(callbacks=[cb, state], max_steps=4, plugins=[fp16()])
        t.fit(model, loader(make_data(64), 16))
    before, skipped, after = state.states[1], state.states[2], state.states[3]
    assert all(torch.equal(a, b) for a, b in zip(before["weights"], skipped["weights"]))
    torch.testing.assert_close(skipped["adam"], before["adam"], rtol=0, atol=0)
    assert torch.equal(skipped["probs"], before["probs"])
    assert skipped["scale"] == before["scale"] * 0.5  # the scaler backed off once
    assert skipped["global_step"] == before["global_step"] + 1
    assert not all(torch.equal(a, b) for a, b in zip(skipped["weights"], after["weights"]))
    assert cb.engine.num_skipped == 1


def test_fp16_clipping_applies_to_the_unscaled_update_gradient():
    seen = []

    class Probe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(max(p.grad.abs().max().item() for p in pl_module.parameters()))

    cb = SAM(gradient_clip_val=1e-3, gradient_clip_algorithm="value")
    trainer(callbacks=[cb, Probe()], max_steps=3, plugins=[fp16(2.0**12)]).fit(
        LitModel(make_mlp()), loader(make_data(48), 16)
    )
    assert len(seen) == 3 and all(v <= 1e-3 + 1e-9 for v in seen)


# -- what a step hands to training_step and back to Lightning -----------------------------------


class PassLog(LitModel):
    """Records each training_step call: (pass, batch index, samples, first sample's loss);
    returns per-sample losses in a dict with one more key."""

    def __init__(self) -> None:
        super().__init__(make_mlp())
        self.calls: list[tuple[int, int, int, float]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        losses = F.cross_entropy(self(x), y, reduction="none")
        self.calls.append((self.sam_pass, batch_idx, len(x), losses.mean().item()))
        return {"loss": losses, "seen": len(x)}


class Outputs(L.Callback):
    """What Lightning received from each training batch, and the step count after it."""

    def __init__(self) -> None:
        self.outputs: list[dict] = []
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.outputs.append(dict(outputs))
        self.steps.append(trainer.global_step)


def test_read_output_reads_a_scalar_per_sample_losses_or_a_dict():
    def loss_of(output):
        out = read_output(output, MisconfigurationException)
        return out.loss, out.per_sample

    loss, per_sample = loss_of(torch.tensor(2.5))
    assert loss.shape == () and float(loss) == 2.5 and per_sample is None
    losses = torch.tensor([1.0, 2.0, 6.0], requires_grad=True)
    loss, per_sample = loss_of(losses)  # a vector: per-sample losses, averaged for the update
    assert loss.item() == 3.0 and loss.requires_grad
    assert per_sample.tolist() == [1.0, 2.0, 6.0] and not per_sample.requires_grad
    loss, per_sample = loss_of({"loss": losses, "logits": None})
    assert float(loss) == 3.0 and per_sample.tolist() == [1.0, 2.0, 6.0]
    given = {"loss": torch.tensor([[0.5]]), "per_sample_loss": torch.tensor([[1.0], [0.0]])}
    loss, per_sample = loss_of(given)
    assert loss.shape == () and float(loss) == 0.5 and per_sample.tolist() == [1.0, 0.0]
    for bad, words in [(None, "It returned NoneType."), (torch.ones(2, 2), "of shape (2, 2)."),
                       ({"logits": torch.ones(1)}, "It returned dict.")]:  # fmt: skip
        with pytest.raises(MisconfigurationException, match=re.escape(words)):
            loss_of(bad)


@pytest.mark.parametrize(
    ("callback", "per_step"),
    [(SAM(rho=0.05), [(1, 16), (2, 16)]),
     # ESAM: the selection's forward at the perturbed weights, then the sharpest half.
     (ESAM(rho=0.05, seed=0), [(1, 16), (2, 16), (2, 8)])],
    ids=["sam", "esam"],
)  # fmt: skip
def test_each_pass_runs_training_step_with_its_pass_number_and_its_samples(callback, per_step):
    model, outputs = PassLog(), Outputs()
    trainer(callbacks=[callback, outputs], max_steps=2).fit(model, loader(make_data(32), 16))
    assert [(p, n) for p, _, n, _ in model.calls] == per_step * 2
    assert [i for _, i, _, _ in model.calls] == [0] * len(per_step) + [1] * len(per_step)
    assert model.sam_pass == 0  # outside a step
    # Lightning gets the first pass's output: its loss averaged and detached, its other keys.
    first = [loss for p, _, n, loss in model.calls if p == 1]
    assert [o["loss"].item() for o in outputs.outputs] == pytest.approx(first, rel=1e-6)
    assert all(not o["loss"].requires_grad and o["seen"] == 16 for o in outputs.outputs)


def test_accumulated_batches_step_once_per_group_and_the_epoch_closes_a_partial_one():
    model, outputs = PassLog(), Outputs()
    cb = SAM(rho=0.05, accumulate_grad_batches=3)
    trainer(callbacks=[cb, outputs], max_epochs=1).fit(model, loader(make_data(56), 8))
    # 7 batches: groups (0, 1, 2), (3, 4, 5) and the epoch's last batch alone.
    assert outputs.steps == [0, 0, 1, 1, 1, 2, 3] and cb.engine.num_steps == 3
    assert [bool(o) for o in outputs.outputs] == [False, False, True, False, False, True, True]
    # Each pass runs every micro-batch of its group, in order.
    order = [(p, i) for p, i, _, _ in model.calls]
    assert order == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2),
                     (1, 3), (1, 4), (1, 5), (2, 3), (2, 4), (2, 5), (1, 6), (2, 6)]  # fmt: skip
    # A group hands Lightning its first micro-batch's first-pass output.
    losses = {i: loss for p, i, _, loss in model.calls if p == 1}
    stepped = [o["loss"].item() for o in outputs.outputs if o]
    assert stepped == pytest.approx([losses[0], losses[3], losses[6]], rel=1e-6)


@pytest.mark.parametrize("strict", [True, False])
def test_a_plateau_scheduler_without_its_metric_fails_when_strict_and_waits_otherwise(strict):
    model = LitModel(
        make_mlp(),
        lr=1e-2,
        scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5),
        scheduler_config={"monitor": "missing", "interval": "epoch", "strict": strict},
    )
    t = trainer(callbacks=[SAM()], max_epochs=2)
    if strict:  # raised at the next epoch's first step, where the plateau step falls due
        with pytest.raises(MisconfigurationException, match="conditioned on metric missing"):
            t.fit(model, loader(make_data(32), 16))
        assert t.global_step == 2
    else:
        t.fit(model, loader(make_data(32), 16))
        assert t.global_step == 4
    assert t.optimizers[0].param_groups[0]["lr"] == 1e-2  # never stepped


def test_each_fit_gets_a_driver_of_its_own_that_reads_its_sam_callback():
    model = LitModel(make_mlp())
    assert driver_of(model) is None  # before the first SAM step
    first_cb, other = SAM(), Outputs()
    first = trainer(callbacks=[other, first_cb], max_steps=1)
    assert find_sam_callback(first) is first_cb
    assert find_sam_callback(trainer(callbacks=[other])) is None
    first.fit(model, loader(make_data(32), 16))
    driver = driver_of(model)
    assert isinstance(driver, StepDriver)
    assert driver.controller is first_cb and driver.trainer is first and driver.averager is None
    second_cb = SAM()
    trainer(callbacks=[second_cb], max_steps=1).fit(model, loader(make_data(32), 16))
    assert driver_of(model) is not driver and driver_of(model).controller is second_cb
