"""SL-SAM on RST's coin (:mod:`lightning_slsam.methods.slsam_rst`): sparse layers on every
step, SAM on a random share of them; with ``preset="paper"`` what the name ``slsam_rst``
ran before 0.3 (the paper's SL-SAM with an RST coin)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp
from torch import nn

from lightning_slsam import SLSAMRST, make_callback
from lightning_slsam.core.step import MethodParts
from lightning_slsam.methods.options import number
from lightning_slsam.methods.rst import Coin
from lightning_slsam.methods.slsam import SLSAMSpec
from lightning_slsam.methods.spec import option


def test_sl_sam_with_rst_coin_samples_layers_on_every_step_and_sam_on_about_half():
    net = nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)])
    cb = SLSAMRST(layer_ratio=0.3, seed=5)
    engine = cb.spec.build_engine(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(6, 3), torch.randint(0, 3, (6,))
    results = [engine.train_step(lambda: F.cross_entropy(net(x), y), opt) for _ in range(200)]
    sam = [r for r in results if r.kind == "sam"]
    plain = [r for r in results if r.kind == "plain"]
    assert 80 < len(sam) < 120 and len(sam) + len(plain) == 200
    assert all(r.num_backward == 2 for r in sam) and all(r.num_backward == 1 for r in plain)
    # The bandit's sample applies to both kinds of step: layers are sparse on each.
    assert sum(bool(r.active_mask.all()) for r in results) < 20
    assert engine.selection.num_updates == 200
    assert type(engine.parts) is Coin and cb.probability == 0.5


def test_the_name_and_the_options():
    assert make_callback("slsam_rst").preset == "default"  # was the paper's before 0.3
    assert make_callback("slsam_rst", preset="paper").preset == "paper"
    assert SLSAMRST(probability=0.3).probability == 0.3
    with pytest.raises(ValueError, match=r"^SLSAMRST: `probability` must be"):
        SLSAMRST(probability=1.5)


class _OwnCoin(MethodParts):
    """An RST coin written here: SAM when a float64 draw of the method's generator falls
    below ``probability``, else a plain step."""

    def __init__(self, probability: float, generator: torch.Generator) -> None:
        self.probability, self.generator = probability, generator

    def kind(self, step: int) -> str:
        draw = float(torch.rand((), generator=self.generator, dtype=torch.float64))
        return "sam" if draw < self.probability else "plain"


@dataclass(kw_only=True, eq=False)
class _PaperWithCoin(SLSAMSpec):
    """SL-SAM with the coin above: with ``preset="paper"``, what ``slsam_rst`` named before
    0.3."""

    name: ClassVar[str] = "paper_with_coin"
    probability: float = option(0.5, number(0, 1))

    def parts(self, generator: torch.Generator) -> MethodParts:
        return _OwnCoin(self.probability, generator)


def _train(spec, steps=12):
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


@pytest.mark.parametrize("probability", [0.3, 0.7])
def test_the_paper_preset_trains_as_the_papers_sl_sam_with_an_rst_coin(probability):
    kinds, weights, engine = _train(SLSAMRST(probability=probability, preset="paper", seed=4).spec)
    own_kinds, own_weights, own_engine = _train(
        _PaperWithCoin(probability=probability, preset="paper", seed=4)
    )
    assert kinds == own_kinds and {"sam", "plain"} == set(kinds)
    assert all(torch.equal(a, b) for a, b in zip(weights, own_weights))
    assert torch.equal(engine.selection.probs, own_engine.selection.probs)
    assert torch.equal(engine.counts, own_engine.counts)
    assert engine.update_scale is None and engine.partition.always_active_names == []
