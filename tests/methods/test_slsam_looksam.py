"""SL-SAM on LookSAM's interval (:mod:`lightning_slsam.methods.slsam_looksam`): sparse layers
on every step, SAM every ``interval`` steps and LookSAM's reuse in between; with
``preset="paper"`` what the name ``slsam_looksam`` ran before 0.3."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp
from torch import nn

from lightning_slsam import SLSAMLookSAM, make_callback
from lightning_slsam.core.step import MethodParts
from lightning_slsam.methods.looksam import Lookahead
from lightning_slsam.methods.slsam import SLSAMSpec


def test_sl_sam_with_looksam_interval_keeps_sparse_layers_and_the_interval():
    net = nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)])
    cb = SLSAMLookSAM(layer_ratio=0.3, interval=4, seed=5)
    engine = cb.spec.build_engine(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(6, 3), torch.randint(0, 3, (6,))
    results = [engine.train_step(lambda: F.cross_entropy(net(x), y), opt) for _ in range(12)]
    assert [r.kind for r in results] == ["sam", "reuse", "reuse", "reuse"] * 3
    assert sum(bool(r.active_mask.all()) for r in results) < 4
    assert engine.parts.vertical  # the orthogonal components of the SAM steps were stored
    assert set(engine.parts.vertical) <= {id(p) for p in net.parameters()}


def test_the_name_and_the_options():
    assert make_callback("slsam_looksam").preset == "default"  # was the paper's before 0.3
    cb = SLSAMLookSAM(interval=3, alpha=0.5)
    assert (cb.interval, cb.alpha) == (3, 0.5)
    with pytest.raises(ValueError, match=r"^SLSAMLookSAM: `interval` must be"):
        SLSAMLookSAM(interval=0)


@dataclass(kw_only=True, eq=False)
class _PaperWithLookahead(SLSAMSpec):
    """SL-SAM with LookSAM's parts at interval 3: with ``preset="paper"``, what
    ``slsam_looksam`` named before 0.3 (with ``sam_interval=3``)."""

    name: ClassVar[str] = "paper_with_lookahead"

    def parts(self, generator: torch.Generator) -> MethodParts:
        return Lookahead(3, 0.7, self.make_perturbation().eps)


def _train(spec, steps=9):
    """``steps`` AdamW steps of ``spec``'s engine on a small MLP: each step's kind, the
    weights after, the engine."""
    net = make_mlp(seed=2)
    engine = spec.build_engine(net)
    x, y = make_data(64).tensors
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    kinds = []
    for step in range(steps):
        xb, yb = x[16 * (step % 4) :][:16], y[16 * (step % 4) :][:16]
        result = engine.train_step(lambda xb=xb, yb=yb: F.cross_entropy(net(xb), yb), opt)
        kinds.append(result.kind)
    return kinds, [p.detach().clone() for p in net.parameters()], engine


def test_the_paper_preset_trains_as_the_papers_sl_sam_with_looksams_parts():
    kinds, weights, engine = _train(SLSAMLookSAM(interval=3, preset="paper", seed=4).spec)
    own_kinds, own_weights, own_engine = _train(_PaperWithLookahead(preset="paper", seed=4))
    assert kinds == own_kinds == ["sam", "reuse", "reuse"] * 3
    assert all(torch.equal(a, b) for a, b in zip(weights, own_weights))
    assert torch.equal(engine.selection.probs, own_engine.selection.probs)
    assert engine.update_scale is None and engine.partition.always_active_names == []
