"""The KL projection the SL-SAM bandit uses to renormalise its distribution: the closest
vector (in KL divergence) with a given sum and per-entry bounds.

>>> import torch
>>> q = kl_projection(torch.log(torch.tensor([1.0, 1.0, 6.0])), budget=2.0, lower=0.1)
>>> [round(v, 3) for v in q.tolist()]
[0.5, 0.5, 1.0]
"""

from __future__ import annotations

import math

import torch

__all__ = ["REL_TOL", "kl_projection", "weighted_kl_projection"]

# Largest |log-weight| used; beyond it the weights are clipped (still ordered, still finite).
_LOG_CLAMP = 1e300
#: Relative slack when comparing the budget with N * bound (float sums of equal parts).
REL_TOL = 1e-12


def _trivial(
    x: torch.Tensor, total: float, budget: float, lower: float, upper: float, what: str
) -> torch.Tensor | None:
    """Check a projection's input (``total``: the sum of the costs, ``N`` without costs);
    return the solution when the budget leaves no choice (everything at a bound)."""
    if not (math.isfinite(upper) and 0.0 < lower <= upper):
        raise ValueError(f"Need 0 < lower <= upper < inf, got lower={lower}, upper={upper}.")
    lo_sum, hi_sum = total * lower, total * upper
    if not lo_sum - REL_TOL * hi_sum <= budget <= hi_sum * (1.0 + REL_TOL):
        raise ValueError(
            f"budget={budget} is infeasible for {what} in [{lower}, {upper}]: "
            f"it must lie in [{lo_sum}, {hi_sum}]."
        )
    if not bool((x < math.inf).all()):
        raise ValueError("log_u contains NaN or +inf; pass finite log-weights (or -inf).")
    if budget >= hi_sum:
        return torch.full_like(x, upper)
    if budget <= lo_sum:
        return torch.full_like(x, lower)
    return None


def _clamped(x: torch.Tensor) -> torch.Tensor:
    """Finite log-weights clamped to +-1e300, and -inf (u == 0) sent strictly below all of
    them, so a max-shift can neither overflow nor produce inf - inf."""
    return torch.where(x == -math.inf, -3 * _LOG_CLAMP, x.clamp(-_LOG_CLAMP, _LOG_CLAMP))


def kl_projection(
    log_u: torch.Tensor, budget: float, lower: float, upper: float = 1.0
) -> torch.Tensor:
    """Exact KL projection of positive weights ``u = exp(log_u)`` onto a capped simplex.

    Returns the minimiser of ``KL(q || u) = sum(q * log(q / u) - q + u)`` over
    ``{q : sum(q) = budget, lower <= q_l <= upper}``, which is ``q_l = clip(c * u_l, lower,
    upper)`` for the scalar ``c > 0`` making the sum equal ``budget``.

    Args:
        log_u: ``[N]`` log-weights, any float dtype/device. NaN and ``+inf`` raise; very
            negative values and ``-inf`` mean "(almost) zero weight".
        budget: Required sum, in ``[N * lower, N * upper]`` (else ValueError).
        lower: Lower bound of every entry, ``> 0``.
        upper: Upper bound of every entry, ``>= lower``; default 1.0.

    Returns:
        ``[N]`` float64 tensor on ``log_u``'s device.

    The scalar is found exactly, not iteratively: with ``t = log(c)``, ``h(t) = sum(clip(
    exp(t + log_u), lower, upper))`` is piecewise with breakpoints where an entry leaves
    ``lower`` or reaches ``upper``. ``h`` is evaluated at all ``2N`` breakpoints with suffix
    log-sum-exps (O(N log N)), and on the segment where it crosses ``budget`` the free entries
    share the remaining budget in proportion to ``u``.

    Example:
        >>> import torch
        >>> q = kl_projection(torch.log(torch.tensor([1.0, 2.0, 3.0, 10.0])), 2.0, lower=0.1)
        >>> [round(v, 6) for v in q.tolist()]  # 10 capped at 1; the rest share 1 as 1:2:3
        [0.166667, 0.333333, 0.5, 1.0]
    """
    x = torch.as_tensor(log_u).detach().to(dtype=torch.float64).reshape(-1)
    n = x.numel()
    lower, upper, budget = float(lower), float(upper), float(budget)
    if n == 0:
        raise ValueError("log_u must have at least one entry.")
    trivial = _trivial(x, float(n), budget, lower, upper, f"{n} entries")
    if trivial is not None:
        return trivial
    x = _clamped(x)
    xs, order = torch.sort(x - x.max(), descending=True)
    log_a, width = math.log(lower), math.log(upper) - math.log(lower)
    idx = torch.arange(n, device=x.device)
    # A gap wider than log(upper/lower) splits the sorted weights into clusters: while any entry
    # of a cluster is inside the box, all higher clusters sit at `upper` and all lower ones at
    # `lower`. So only the cluster where the budget runs out is solved, in coordinates relative
    # to its own top; this keeps the breakpoint arithmetic exact whatever the spread of log_u.
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=x.device), xs[:-1] - xs[1:] > width])
    fill = upper * idx.double() + lower * (n - idx).double()  # entries before idx at `upper`
    first = torch.where(starts & (fill <= budget), idx, 0).max()
    last = torch.where(starts & (idx > first), idx, n).min() - 1
    top, bottom = xs[first], xs[last]
    low = bottom - top - width - 1.0  # always at `lower` on the solved cluster's range of t
    xs = torch.where(idx < first, width, torch.where(idx <= last, xs - top, low))
    ta = log_a - xs  # ascending: the t at which each entry rises above `lower`
    tb = log_a + width - xs  # ascending: the t at which each entry reaches `upper`
    # Suffix log-sums: the free entries at any t are a contiguous run of the sorted order, and
    # a suffix difference never cancels badly (the tail below the run is at most N times it).
    lse = torch.cat([torch.logcumsumexp(xs.flip(0), 0).flip(0), xs.new_full((1,), -math.inf)])

    # Count, at every breakpoint, the entries already capped / above `lower` by merging both
    # breakpoint lists with one sort (torch.searchsorted would spawn intra-op threads for a few
    # hundred values, which costs milliseconds when the cores are busy). Equal breakpoints give
    # equal h whatever the partial counts (the entries in transition sit exactly on a bound),
    # and the last of them, which has the full counts, is the one picked below.
    t, perm = torch.sort(torch.cat([ta, tb]))
    n_hi = torch.cat([torch.zeros_like(xs), torch.ones_like(xs)])[perm].cumsum(0)  # capped
    pos = torch.arange(2 * n, device=x.device)
    n_up = (pos + 1).double() - n_hi  # above `lower`
    i_hi, i_up = n_hi.long(), n_up.long()
    gap = (lse[i_up] - lse[i_hi]).clamp_max(0.0)
    free = torch.exp(t + lse[i_hi] + torch.log1p(-torch.exp(gap)))
    h = upper * n_hi + lower * (n - n_up) + torch.where(i_up > i_hi, free, 0.0)
    # h at the first breakpoint is n * lower <= budget; the floor at 0 only guards rounding.
    k = torch.where(h <= budget, pos, 0).max()
    n_hi, n_up = n_hi[k], n_up[k]
    is_hi, is_free = idx < n_hi, (idx >= n_hi) & (idx < n_up)
    rest = budget - upper * n_hi - lower * (n - n_up)
    # Shift by the largest free weight so no share underflows.
    w = torch.where(is_free, torch.exp(xs - xs[n_hi.long().clamp_max(n - 1)]), 0.0)
    q = torch.where(is_hi, upper, torch.where(is_free, rest * w / w.sum().clamp_min(1.0), lower))

    # Rounding at a near-tie may leave one entry a hair outside the box; clip and give the
    # difference back to the free entries so the sum stays exact.
    q = q.clamp(lower, upper)
    free_mask = (q > lower) & (q < upper)
    free_sum = torch.where(free_mask, q, 0.0).sum()
    fix = (budget - torch.where(free_mask, 0.0, q).sum()) / free_sum
    q = torch.where(free_mask & (free_sum > 0), q * fix, q).clamp(lower, upper)
    return torch.empty_like(q).scatter_(0, order, q)


def weighted_kl_projection(
    log_u: torch.Tensor,
    costs: torch.Tensor,
    budget: float,
    lower: float,
    upper: float = 1.0,
) -> torch.Tensor:
    """Exact projection of ``u = exp(log_u)`` onto a cost-weighted capped simplex, in the
    cost-weighted KL divergence.

    Returns the minimiser of ``sum(costs * KL(q_l || u_l))`` over ``{q : sum(costs * q) =
    budget, lower <= q_l <= upper}``: the constraint of a compute budget, where drawing entry
    ``l`` costs ``costs[l]``. The optimality conditions give ``q_l = clip(t * u_l, lower,
    upper)`` for the scalar ``t > 0`` making the weighted sum equal ``budget``: one common
    factor, as in :func:`kl_projection` (which this is with equal costs), so the budget a
    penalised entry frees goes to the others in proportion to their weights.

    Weighting the divergence by the costs is what keeps that proportion. The plain
    ``KL(q || u)`` under the same constraint gives ``q_l = clip(u_l * exp(-lam * costs[l]))``,
    a factor that depends on the cost: budget freed by cheap entries flows to the expensive
    ones first, and a bandit whose costly layer keeps a large gradient starves every cheap
    layer (measured: MiniLM's word embedding at its cap, 86 of its 102 other tensors below 0.01).

    Args:
        log_u: ``[N]`` log-weights (as :func:`kl_projection`).
        costs: ``[N]`` positive, finite costs; only their ratios matter.
        budget: required ``sum(costs * q)``, in ``[lower * sum(costs), upper * sum(costs)]``.
        lower: lower bound of every entry, ``> 0``.
        upper: upper bound of every entry, ``>= lower``; default 1.0.

    Returns:
        ``[N]`` float64 tensor on ``log_u``'s device.

    ``h(s) = sum(costs * clip(exp(s + log_u)))`` is non-decreasing in ``s = log(t)``, with
    breakpoints where an entry leaves ``lower`` or reaches ``upper``. A binary search over
    the ``2N`` sorted breakpoints (``h`` evaluated ``O(log N)`` times) finds the segment where
    ``h`` crosses the budget; there the free entries are fixed and ``t`` is in closed form,
    ``(budget - cost at the bounds) / sum(costs * u)`` over the free entries.

    Example:
        >>> import torch
        >>> log_u = torch.log(torch.tensor([0.2, 0.2, 0.2]))
        >>> costs = torch.tensor([1.0, 1.0, 8.0])  # the third entry costs 8 times more
        >>> q = weighted_kl_projection(log_u, costs, budget=0.2 * 10.0, lower=1e-3)
        >>> [round(v, 6) for v in q.tolist()]  # a uniform start is already feasible
        [0.2, 0.2, 0.2]
        >>> q = weighted_kl_projection(log_u, costs, budget=1.0, lower=1e-3)
        >>> [round(v, 6) for v in q.tolist()], round(float((costs * q).sum()), 9)
        ([0.1, 0.1, 0.1], 1.0)
    """
    x = torch.as_tensor(log_u).detach().to(dtype=torch.float64).reshape(-1)
    c = torch.as_tensor(costs).detach().to(dtype=torch.float64, device=x.device).reshape(-1)
    n = x.numel()
    lower, upper, budget = float(lower), float(upper), float(budget)
    if n == 0 or c.numel() != n:
        raise ValueError(
            f"log_u and costs must have the same N >= 1 entries, got {n}, {c.numel()}."
        )
    if not bool(((c > 0) & (c < math.inf)).all()):
        raise ValueError("costs must be positive and finite.")
    trivial = _trivial(x, float(c.sum()), budget, lower, upper, "these costs")
    if trivial is not None:
        return trivial
    scale = float(c.mean())
    c, budget = c / scale, budget / scale
    x = _clamped(x)
    x = x - x.max()  # u <= 1: the shift is part of t
    log_lo, log_hi, log_c = math.log(lower), math.log(upper), torch.log(c)

    def q_at(s: float) -> torch.Tensor:  # exactly `lower` / `upper` at the bounds
        z = x + s
        return torch.where(z <= log_lo, lower, torch.where(z >= log_hi, upper, torch.exp(z)))

    # Breakpoints in s: entry l leaves `lower` at log(lower) - x_l, reaches `upper` at
    # log(upper) - x_l. h(first) = lower * sum(c) < budget < upper * sum(c) = h(last).
    t = torch.sort(torch.cat([log_lo - x, log_hi - x])).values
    left, right = 0, 2 * n - 1
    while right - left > 1:  # keep h(t[left]) <= budget <= h(t[right])
        mid = (left + right) // 2
        if float((c * q_at(float(t[mid]))).sum()) <= budget:
            left = mid
        else:
            right = mid
    middle = x + 0.5 * float(t[left] + t[right])
    free = (middle > log_lo) & (middle < log_hi)  # the same on the whole segment
    at_bounds = torch.where(middle >= log_hi, upper, torch.full_like(x, lower))  # float64
    rest = budget - float((c * torch.where(free, 0.0, at_bounds)).sum())
    if bool(free.any()) and rest > 0:
        log_t = math.log(rest) - float(torch.logsumexp((log_c + x)[free], 0))
        q = torch.where(free, torch.exp(x + log_t), at_bounds).clamp(lower, upper)
    else:
        q = at_bounds
    # Rounding may leave the weighted sum a hair off: the free entries absorb it.
    is_free = free & (q > lower) & (q < upper)
    free_sum = float((c * torch.where(is_free, q, 0.0)).sum())
    if free_sum > 0:
        fix = (budget - float((c * torch.where(is_free, 0.0, q)).sum())) / free_sum
        q = torch.where(is_free, q * fix, q).clamp(lower, upper)
    return q
