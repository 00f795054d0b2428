"""The SAM callback's contract (:mod:`lightning_slsam.lightning.callback`): exactly
hand-written SAM with every layer, exactly the active tensors changed, and the run length
it estimates."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from helpers import LitModel, Snapshots, loader, make_data, make_mlp, reference_sam, trainer
from probes import batches

from lightning_slsam import SparseLayerSAM


def test_layer_ratio_one_equals_hand_written_sam_adamw():
    data = make_data(64)
    net = make_mlp()
    reference = reference_sam(net, batches(data, 16) * 2, rho=0.05, lr=1e-2, weight_decay=0.01)

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


@pytest.mark.parametrize(("max_epochs", "max_steps", "expected"), [(2, -1, 6), (2, 5, 5)])
def test_estimated_stepping_batches_counts_the_plugins_accumulation(
    max_epochs, max_steps, expected
):
    from lightning_slsam.lightning.callback import estimated_stepping_batches

    seen = {}

    class Probe(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            seen["estimate"] = estimated_stepping_batches(trainer)

    cb = SparseLayerSAM(layer_ratio=0.5, accumulate_grad_batches=4)
    t = trainer(callbacks=[cb, Probe()], max_epochs=max_epochs, max_steps=max_steps)
    t.fit(LitModel(make_mlp()), loader(make_data(80), 8))  # 10 batches: groups of 4, 4, 2
    assert seen["estimate"] == expected == t.global_step


@pytest.mark.parametrize("bar", ["rich", "tqdm"])
def test_the_progress_bar_shows_the_layer_count_as_an_integer(bar):
    # Lightning's bars format numbers with decimals (Rich: ".3f"): `sl_layers` is a count.
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from tqdm import tqdm

    progress = RichProgressBar() if bar == "rich" else TQDMProgressBar()
    model = LitModel(make_mlp())
    cb = SparseLayerSAM(layer_ratio=0.5, seed=0)
    t = trainer(callbacks=[cb, progress], max_steps=3, enable_progress_bar=True)
    t.fit(model, loader(make_data(64), 16))

    shown = t.progress_bar_callback.get_metrics(t, model)
    layers = shown["sl_layers"]
    assert isinstance(layers, int) and layers == int(cb.active_mask.sum()) > 0
    if bar == "rich":
        assert f"{layers:{progress.theme.metrics_format}}" == str(layers)  # not "4.000"
    else:
        assert tqdm.format_num(layers) == str(layers)
    assert isinstance(shown["sl_ratio"], float) and isinstance(shown["sl_entropy"], float)
    # Loggers keep the namespaced float; the short name stays a callback metric.
    assert t.logged_metrics["slsam/active_layers"].dtype == torch.float32
    assert "sl_layers" not in t.logged_metrics
    assert float(t.callback_metrics["sl_layers"]) == layers
