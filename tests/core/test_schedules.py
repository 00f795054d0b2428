"""Iteration-axis schedules (:mod:`lightning_slsam.core.schedules`): which kind each step is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_slsam import RST
from lightning_slsam.core.schedules import (
    STEP_KINDS,
    EveryStep,
    IntervalSchedule,
    RandomSchedule,
    SingleStepSchedule,
)


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


# -- the schedules, directly --------------------------------------------------------------------


def test_the_coin_resumes_from_its_state_and_its_extremes_are_fixed():
    coin = RandomSchedule(0.3, generator=torch.Generator().manual_seed(3))
    first = [coin.kind(t) for t in range(40)]
    assert 0.1 < first.count("sam") / 40 < 0.5 and set(first) == {"sam", "plain"}
    state = coin.state_dict()
    again = RandomSchedule(0.3)  # another stream until it loads the state
    again.load_state_dict(state)
    assert [again.kind(t) for t in range(40, 100)] == [coin.kind(t) for t in range(40, 100)]
    assert {RandomSchedule(0.0).kind(t) for t in range(50)} == {"plain"}
    assert {RandomSchedule(1.0).kind(t) for t in range(50)} == {"sam"}
    # The same seed, the same pattern; the state is the generator's alone.
    twin = RandomSchedule(0.3, generator=torch.Generator().manual_seed(3))
    assert [twin.kind(t) for t in range(40)] == first


def test_interval_and_single_step_schedules_name_their_kinds_by_step():
    assert [IntervalSchedule(4).kind(t) for t in range(9)] == ["sam", "reuse", "reuse", "reuse",
                                                              "sam", "reuse", "reuse", "reuse",
                                                              "sam"]  # fmt: skip
    assert {IntervalSchedule(1).kind(t) for t in range(10)} == {"sam"}
    assert {SingleStepSchedule().kind(t) for t in range(10)} == {"single"}
    assert {EveryStep().kind(t) for t in range(10)} == {"sam"}
    assert set(STEP_KINDS) == {"sam", "plain", "reuse", "single"}


@pytest.mark.parametrize(
    ("build", "name"),
    [(lambda: RandomSchedule(1.5), "sam_probability"),
     (lambda: RandomSchedule("half"), "sam_probability"),
     (lambda: IntervalSchedule(0), "sam_interval"),
     (lambda: IntervalSchedule(2.0), "sam_interval"),
     (lambda: IntervalSchedule(3, alpha=-0.1), "looksam_alpha")],
)  # fmt: skip
def test_schedule_options_are_checked_naming_the_option(build, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        build()
