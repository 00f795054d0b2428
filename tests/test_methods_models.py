"""Every method trains the small timm ViT and Transformers models through the same surface,
and reports its cost the same way (the paper's "Active Ratio", backward passes)."""

from __future__ import annotations

import pytest
import torch
from helpers import MODELS, Wrapped, trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_slsam import METHODS, make_callback

DENSE = {"sam", "s2sam", "rst", "looksam", "ssamf", "momentum_sam", "arwp", "mesa", "saf"}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("method", list(METHODS))
def test_method_trains_model_and_reports_comparable_metrics(method, model, tmp_path):
    net, data, loss_fn = MODELS[model](per_sample=True)  # ESAM needs per-sample losses
    start = {n: p.detach().clone() for n, p in net.named_parameters()}
    cb = make_callback(method, seed=0) if method != "adamw" else None
    t = trainer(
        callbacks=[cb] if cb else [],
        max_steps=5,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
    )
    module = Wrapped(net, loss_fn)
    t.fit(module, DataLoader(data, batch_size=4))

    assert t.global_step == 5
    changed = sum(not torch.equal(p, start[n]) for n, p in net.named_parameters())
    assert changed > 0 and all(torch.isfinite(p).all() for p in net.parameters())
    if cb is None:
        assert module.automatic_optimization
        return
    engine = cb.engine
    assert engine.num_steps == 5 and engine.num_skipped == 0
    for key in ("slsam/active_ratio", "slsam/active_ratio_pass1", "slsam/backward_passes",
                "slsam/never_selected", "slsam/entropy", "slsam/sam_step"):  # fmt: skip
        assert key in t.callback_metrics, key
    kinds = engine.kind_counts
    passes = 2 * kinds.get("sam", 0) + sum(kinds.get(k, 0) for k in ("plain", "reuse", "single"))
    if method in DENSE:
        # Every pass computes every layer: the ratio counts the passes exactly.
        assert cb.mean_active_ratio == pytest.approx(passes / 5)
    else:
        assert 0 < cb.mean_active_ratio < passes / 5
    expected = {"sam": 2.0, "s2sam": 1.0, "ssamf": 2.0, "looksam": 1.2, "sl_s2sam": None,
                "momentum_sam": 1.0, "arwp": 1.0, "mesa": 1.0, "saf": 1.0}  # fmt: skip
    if expected.get(method) is not None:
        assert cb.mean_active_ratio == pytest.approx(expected[method])
    if method == "esam":
        assert engine.last_result.active_ratio_per_pass[1] == 1.0
        assert engine.last_result.active_ratio_per_pass[0] < 1.0
