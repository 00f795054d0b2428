"""What a SAM callback logs each step and writes at the end of fit
(:mod:`lightning_slsam.lightning.step_logging`)."""

from __future__ import annotations

import csv
import os

import pytest
from helpers import LitModel, loader, make_data, make_mlp, trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_slsam import SparseLayerSAM


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
