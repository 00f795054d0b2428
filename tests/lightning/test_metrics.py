"""What SL-SAM reports: entropy, rank correlation, the per-layer record."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp
from scipy.stats import spearmanr

from lightning_slsam import SparseLayerSAM
from lightning_slsam.lightning.metrics import (
    normalized_entropy,
    rank_correlation,
    write_layer_frequency_csv,
)


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
