"""RST (:mod:`lightning_slsam.methods.rst`): its coin names each step SAM or plain, seeded,
and resumes from its state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_slsam import RST
from lightning_slsam.methods.rst import Coin


def _kinds(cb, steps=200):
    net = nn.Linear(3, 2)
    engine = cb.spec.build_engine(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    results = [engine.train_step(lambda: F.cross_entropy(net(x), y), opt) for _ in range(steps)]
    return [r.kind for r in results], [r.num_backward for r in results]


def test_rst_does_sam_on_about_half_the_steps_reproducibly():
    kinds, backward = _kinds(RST(seed=3))
    sam = sum(k == "sam" for k in kinds)
    assert 0.4 * 200 < sam < 0.6 * 200
    assert backward == [2 if k == "sam" else 1 for k in kinds]
    assert set(kinds) == {"sam", "plain"}
    assert _kinds(RST(seed=3))[0] == kinds
    assert _kinds(RST(seed=4))[0] != kinds
    assert {k for k in _kinds(RST(probability=1.0))[0]} == {"sam"}


# -- the coin, directly -------------------------------------------------------------------------


def test_the_coin_resumes_from_its_state_and_its_extremes_are_fixed():
    coin = Coin(0.3, generator=torch.Generator().manual_seed(3))
    first = [coin.kind(t) for t in range(40)]
    assert 0.1 < first.count("sam") / 40 < 0.5 and set(first) == {"sam", "plain"}
    state = coin.state_dict({})
    again = Coin(0.3, torch.Generator().manual_seed(99))  # another stream until it loads
    again.load_state_dict(state, [])
    assert [again.kind(t) for t in range(40, 100)] == [coin.kind(t) for t in range(40, 100)]
    gen = torch.Generator().manual_seed(0)
    assert {Coin(0.0, gen).kind(t) for t in range(50)} == {"plain"}
    assert {Coin(1.0, gen).kind(t) for t in range(50)} == {"sam"}
    # The same seed, the same pattern; the state is the generator's alone.
    twin = Coin(0.3, generator=torch.Generator().manual_seed(3))
    assert [twin.kind(t) for t in range(40)] == first


def test_the_engine_saves_the_coin_and_a_resumed_engine_flips_the_same_coins():
    net = nn.Linear(3, 2)
    engine = RST(seed=5).spec.build_engine(net)
    assert type(engine.parts) is Coin and engine.parts.probability == 0.5
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    for _ in range(7):
        engine.train_step(lambda: F.cross_entropy(net(x), y), opt)
    again = RST(seed=6).spec.build_engine(net)  # another seed until it loads the state
    again.load_state_dict(engine.state_dict())
    assert [again.parts.kind(t) for t in range(30)] == [engine.parts.kind(t) for t in range(30)]


@pytest.mark.parametrize("value", [1.5, -0.1, "half", True])
def test_the_probability_is_checked_naming_it(value):
    with pytest.raises(ValueError, match=r"^RST: `probability` must be"):
        RST(probability=value)
