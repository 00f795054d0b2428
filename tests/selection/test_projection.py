"""The KL projection the bandit renormalises with (:mod:`lightning_slsam.selection.projection`):
the count projection and the cost-weighted one of the compute budget, each against an
independent bisection solver, and their invariants."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from probes import bisect_projection

from lightning_slsam.selection.projection import kl_projection, weighted_kl_projection

# -- the count projection (the paper's budget) -----------------------------------------------------


def test_projection_matches_bisection_on_random_inputs():
    rng = np.random.default_rng(0)
    both_clipped = 0
    for case in range(400):
        n = int(rng.integers(1, 80))
        lower = float(10 ** rng.uniform(-5, -1))
        upper = float(rng.choice([1.0, 0.5, 3.0]))
        scale = [0.01, 0.5, 2.0, 8.0, 50.0][case % 5]
        log_u = rng.normal(size=n) * scale + rng.normal() * 100
        budget = float(rng.uniform(n * lower, n * upper))
        got = kl_projection(torch.tensor(log_u), budget, lower, upper)
        want = bisect_projection(log_u, budget, lower, upper)
        assert got.dtype == torch.float64 and got.shape == (n,)
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-9)
        assert abs(got.sum().item() - budget) <= 1e-12 * budget
        assert got.min().item() >= lower and got.max().item() <= upper
        both_clipped += bool((got == lower).any() and (got == upper).any())
    assert both_clipped > 100  # the cases really exercise clipping at both bounds


def test_projection_without_clipping_is_plain_rescaling():
    u = torch.tensor([0.3, 0.2, 0.25, 0.25], dtype=torch.float64)
    q = kl_projection(u.log(), 1.4, 1e-3, 1.0)
    torch.testing.assert_close(q, u * 1.4 / u.sum(), rtol=0, atol=1e-15)
    torch.testing.assert_close(q, torch.tensor([0.42, 0.28, 0.35, 0.35], dtype=torch.float64))


def test_projection_hand_computed_with_clipping():
    # u = [8, 1, 1, 0.001], budget 2.5, box [0.1, 1]: entry 0 caps at 1, entry 3 floors at
    # 0.1, entries 1 and 2 share the remaining 1.4 equally.
    u = torch.tensor([8.0, 1.0, 1.0, 0.001], dtype=torch.float64)
    q = kl_projection(u.log(), 2.5, 0.1, 1.0)
    torch.testing.assert_close(q, torch.tensor([1.0, 0.7, 0.7, 0.1], dtype=torch.float64))


def test_projection_degenerate_inputs():
    full = kl_projection(torch.randn(5), 5.0, 0.01, 1.0)
    assert torch.equal(full, torch.ones(5, dtype=torch.float64))
    floor = kl_projection(torch.randn(5), 0.05, 0.01, 1.0)
    assert torch.equal(floor, torch.full((5,), 0.01, dtype=torch.float64))
    equal = kl_projection(torch.full((6,), 7.0), 1.5, 1e-3, 1.0)
    torch.testing.assert_close(equal, torch.full((6,), 0.25, dtype=torch.float64))
    single = kl_projection(torch.tensor([-3.0]), 0.4, 1e-3, 1.0)
    torch.testing.assert_close(single, torch.tensor([0.4], dtype=torch.float64))
    # Weights 1e300 orders of magnitude apart: still feasible, exact and NaN-free.
    # -inf (u == 0) ranks strictly below every finite weight.
    log_u = torch.tensor([0.0, -1e300, -1e300, -math.inf], dtype=torch.float64)
    tiny = kl_projection(log_u, 2.0, 1e-3, 1.0)
    torch.testing.assert_close(tiny, torch.tensor([1.0, 0.4995, 0.4995, 1e-3], dtype=torch.float64))
    huge = torch.tensor([-1.7e308, 1.7e308, 0.0, 1.7e308], dtype=torch.float64)
    torch.testing.assert_close(
        kl_projection(huge, 2.5, 1e-3), torch.tensor([1e-3, 1.0, 0.499, 1.0], dtype=torch.float64)
    )
    far = kl_projection(torch.tensor([0.0, -2000.0, -2000.5], dtype=torch.float64), 2.5, 1e-3)
    np.testing.assert_allclose(
        far.numpy(), bisect_projection([0.0, -2000.0, -2000.5], 2.5, 1e-3, 1.0), atol=1e-12
    )


def test_projection_stays_feasible_for_extreme_spreads():
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        lower = float(10 ** rng.uniform(-6, -1))
        mags = 10 ** rng.uniform(0, 300, size=n)
        log_u = np.where(rng.random(n) < 0.5, -mags, rng.normal(size=n) * 10 ** rng.uniform(0, 20))
        budget = float(rng.uniform(n * lower, n))
        q = kl_projection(torch.tensor(log_u), budget, lower, 1.0)
        assert bool(torch.isfinite(q).all())
        assert abs(q.sum().item() - budget) <= 1e-12 * budget
        assert q.min().item() >= lower and q.max().item() <= 1.0


@pytest.mark.parametrize(
    ("log_u", "budget", "lower", "upper", "match"),
    [
        (torch.zeros(4), 4.5, 0.1, 1.0, "budget"),
        (torch.zeros(4), 0.2, 0.1, 1.0, "budget"),
        (torch.zeros(4), 1.0, 0.0, 1.0, "lower"),
        (torch.zeros(4), 1.0, 0.5, 0.4, "lower"),
        (torch.tensor([0.0, math.nan]), 1.0, 0.1, 1.0, "log_u"),
        (torch.tensor([0.0, math.inf]), 1.0, 0.1, 1.0, "log_u"),
        (torch.zeros(0), 0.0, 0.1, 1.0, "log_u"),
    ],
)
def test_projection_rejects_bad_input(log_u, budget, lower, upper, match):
    with pytest.raises(ValueError, match=match):
        kl_projection(log_u, budget, lower, upper)


# -- the cost-weighted projection (the compute budget) ---------------------------------------------


def _bisect_weighted(log_u, costs, budget: float, lower: float, upper: float) -> np.ndarray:
    """Independent reference: bisection on s for sum(c * clip(exp(s + x))) == budget, in
    NumPy, with a bracket wide enough for every entry to reach both bounds."""
    x, c = np.asarray(log_u, dtype=float), np.asarray(costs, dtype=float)
    ends = np.concatenate([math.log(lower) - x, math.log(upper) - x])
    lo, hi = ends.min() - 1.0, ends.max() + 1.0

    def q(s):
        return np.exp(np.clip(s + x, math.log(lower), math.log(upper)))

    for _ in range(400):
        mid = 0.5 * (lo + hi)
        if (c * q(mid)).sum() < budget:
            lo = mid
        else:
            hi = mid
    return q(0.5 * (lo + hi))


def test_weighted_projection_matches_bisection_on_random_inputs():
    rng = np.random.default_rng(0)
    both_clipped = 0
    for case in range(300):
        n = int(rng.integers(1, 60))
        lower = float(10 ** rng.uniform(-4, -1.5))
        upper = float(rng.choice([1.0, 0.5]))
        spread = [0.01, 0.5, 2.0, 6.0][case % 4]
        log_u = rng.normal(size=n) * spread + math.log(0.2)
        # Costs like parameter counts: from a LayerNorm bias to a vocabulary embedding.
        costs = np.exp(rng.uniform(math.log(10), math.log(1e7), size=n))
        total = costs.sum()
        budget = float(rng.uniform(lower * total, upper * total))
        got = weighted_kl_projection(torch.tensor(log_u), torch.tensor(costs), budget, lower,
                                     upper)  # fmt: skip
        want = _bisect_weighted(log_u, costs, budget, lower, upper)
        assert got.dtype == torch.float64 and got.shape == (n,)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-9, atol=1e-11)
        assert abs(float((torch.tensor(costs) * got).sum()) - budget) <= 1e-10 * budget
        assert got.min().item() >= lower and got.max().item() <= upper
        both_clipped += bool((got == lower).any() and (got == upper).any())
    assert both_clipped > 30  # the cases really exercise clipping at both bounds


@pytest.mark.parametrize("n", [1, 2, 7, 50])
def test_equal_costs_give_the_count_projection(n):
    rng = np.random.default_rng(n)
    log_u = torch.tensor(rng.normal(size=n) * 3)
    budget = 0.3 * n
    costs = torch.full((n,), 123.0)
    got = weighted_kl_projection(log_u, costs, budget * 123.0, 1e-3)
    torch.testing.assert_close(got, kl_projection(log_u, budget, 1e-3), rtol=0, atol=1e-12)


def test_a_uniform_start_is_feasible_and_kept():
    costs = torch.tensor([11_720_448.0, 384.0, 147_456.0, 384.0, 589_824.0, 2.0])
    ratio = 0.2
    start = torch.full((6,), ratio, dtype=torch.float64)
    got = weighted_kl_projection(start.log(), costs, ratio * float(costs.sum()), 1e-3)
    torch.testing.assert_close(got, start, rtol=0, atol=1e-12)


def test_the_free_entries_keep_their_proportions():
    # One common factor: what a penalised entry frees goes to the others in proportion to
    # their weights, whatever their costs (the cost-weighted divergence's property).
    costs = torch.tensor([100.0, 1.0, 1.0, 1.0])
    log_u = torch.log(torch.tensor([0.1, 0.2, 0.4, 0.001], dtype=torch.float64))
    budget = 0.2 * float(costs.sum())
    q = weighted_kl_projection(log_u, costs, budget, 1e-3)
    assert abs(float((costs * q).sum()) - budget) < 1e-9
    ratios = (q / log_u.exp())[:3]
    torch.testing.assert_close(ratios, ratios[:1].expand(3), rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("costs", "budget", "match"),
    [
        ([1.0, 0.0], 0.5, "positive and finite"),
        ([1.0, float("inf")], 0.5, "positive and finite"),
        ([1.0, 2.0], 5.0, "infeasible"),
        ([1.0, 2.0], 1e-6, "infeasible"),
        ([1.0], 0.5, "same N"),
    ],
)
def test_weighted_projection_rejects_bad_input(costs, budget, match):
    with pytest.raises(ValueError, match=match):
        weighted_kl_projection(torch.zeros(2), torch.tensor(costs), budget, 1e-3)


def test_weighted_projection_degenerate_budgets():
    costs = torch.tensor([1.0, 5.0, 10.0])
    top = weighted_kl_projection(torch.zeros(3), costs, 16.0, 1e-3)
    bottom = weighted_kl_projection(torch.zeros(3), costs, 16e-3, 1e-3)
    assert top.tolist() == [1.0, 1.0, 1.0] and bottom.tolist() == [1e-3] * 3
    # Log-weights far apart and -inf stay finite and feasible.
    q = weighted_kl_projection(torch.tensor([0.0, -2000.0, -math.inf]), costs, 3.0, 1e-3)
    assert bool(torch.isfinite(q).all()) and abs(float((costs * q).sum()) - 3.0) < 1e-9
