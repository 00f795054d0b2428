"""What a SAM callback logs each step (:func:`lightning_slsam.lightning.callback.step_metrics`)
and writes at the end of fit (:mod:`lightning_slsam.lightning.record`): entropy, rank
correlation, the per-layer record."""

from __future__ import annotations

import csv
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import LitModel, loader, make_data, make_mlp, trainer
from lightning.pytorch.loggers import CSVLogger
from scipy.stats import spearmanr

from lightning_slsam import SparseLayerSAM
from lightning_slsam.lightning.callback import normalized_entropy
from lightning_slsam.lightning.record import rank_correlation, write_layer_frequency_csv


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


def test_rank_correlation_matches_scipy_with_ties_and_skips_nan():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(3, 40))
        x = rng.integers(0, 6, size=n).astype(float)  # many ties
        y = x + rng.normal(size=n)
        want = spearmanr(x, y).statistic
        assert rank_correlation(torch.tensor(x), torch.tensor(y)) == pytest.approx(want, abs=1e-12)
    x = torch.tensor([1.0, 2.0, math.nan, 4.0])
    y = torch.tensor([10.0, 30.0, 5.0, 20.0])
    assert rank_correlation(x, y) == pytest.approx(spearmanr([1, 2, 4], [10, 30, 20]).statistic)
    assert math.isnan(rank_correlation(torch.ones(5), torch.arange(5.0)))


def test_normalized_entropy_bounds():
    assert normalized_entropy(torch.full((7,), 0.2)) == pytest.approx(1.0)
    concentrated = torch.tensor([1.0, 1e-3, 1e-3, 1e-3])
    assert normalized_entropy(concentrated) < 0.05


def test_engine_records_each_layers_mean_first_pass_norm(tmp_path):
    net = make_mlp()
    engine = SparseLayerSAM(layer_ratio=0.5, seed=0).spec.build_engine(net)
    x, y = make_data(16).tensors
    opt = torch.optim.SGD(net.parameters(), lr=0.0)  # weights fixed: norms are reproducible
    reference = []
    for p in net.parameters():
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
        reference.append(float(p.grad.norm()))
    for _ in range(30):
        engine.train_step(lambda: F.cross_entropy(net(x), y), opt)
    # With lr 0 every measurement of a layer is the same: the dense gradient's norm.
    torch.testing.assert_close(
        engine.mean_norms(), torch.tensor(reference, dtype=torch.float64), rtol=1e-5, atol=1e-7
    )
    assert int(engine.norm_counts.sum()) == int(engine.counts.sum())
    path = write_layer_frequency_csv(
        str(tmp_path / "f.csv"), engine.partition.names, engine.partition.numel,
        engine.counts, engine.num_steps, engine.selection.probs, engine.mean_norms(),
    )  # fmt: skip
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    assert float(rows[0]["mean_grad_norm"]) == pytest.approx(reference[0], rel=1e-5)
