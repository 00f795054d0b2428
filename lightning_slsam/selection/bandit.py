"""SL-SAM's layer sampler (Algorithm 2), :class:`LayerBandit`, and its exact KL projections.

Layer ``l`` has probability ``p_l``, summing to ``s = layer_ratio * N``. :meth:`LayerBandit.update`
turns the drawn layers' gradient norms ``r_l`` into losses ``k_l`` (0 for the others), forms
``u_l = p_l * exp(-alpha_p * k_l / q_l)`` (``q_l``: inclusion probability) and projects ``u``
onto ``{q : sum(q) = s, p_min <= q_l <= 1}`` (:func:`kl_projection`). Losses: ``"shifted"``
(default) ``max_j (r_j / p_j)**2 - (r_l / p_l)**2``; ``"paper"`` ``G**2 / p_min**2 - r_l**2 /
p_l**2``, ``G = max_j r_j``; ``"rank"``: the rank of ``r_l / p_l`` among the drawn layers in
``[0, 1]`` (0: largest, ties share their mean). Why: docs/paper-and-code.md.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any

import torch

from lightning_slsam.selection.rules import LayerSelection, Seeded, seeded_generator

__all__ = ["DEFAULT_ALPHA", "REL_TOL", "LayerBandit", "kl_projection", "weighted_kl_projection"]

_LOSSES = ("shifted", "paper", "rank")
#: The step size ``alpha_p=None`` stands for, per loss (docs/paper-and-code.md).
DEFAULT_ALPHA = {"shifted": 1e-3, "paper": 1e-3, "rank": 0.03}


def _validated(
    num_layers: int, layer_ratio: float, p_min: float, alpha_p: float | None, loss: str
) -> tuple[int, float, float, float, str]:
    """Checked bandit hyper-parameters (ValueError if corrupt), ``alpha_p=None`` resolved."""
    if loss not in _LOSSES:
        raise ValueError(f"loss={loss!r} is invalid: use one of {_LOSSES}.")
    if alpha_p is None:
        alpha_p = DEFAULT_ALPHA[loss]
    integral = isinstance(num_layers, numbers.Integral) and not isinstance(num_layers, bool)
    if not integral or num_layers < 1:
        raise ValueError(f"num_layers={num_layers!r} is invalid: pass an int >= 1.")
    n, ratio, floor, step = int(num_layers), float(layer_ratio), float(p_min), float(alpha_p)
    if not (0 < ratio <= 1 and 0 < floor < 1 and 0 <= step < math.inf):
        raise ValueError(
            f"Bandit state has layer_ratio={layer_ratio!r}, p_min={p_min!r},"
            f" alpha_p={alpha_p!r}: outside (0, 1], (0, 1) and [0, inf)."
        )
    if floor * n > ratio * n * (1.0 + REL_TOL):
        raise ValueError(
            f"p_min={p_min!r} is too large for {n} layers at layer_ratio={ratio}: the floors "
            f"alone exceed the budget s={ratio * n:g}; use p_min <= s/N = {ratio:g}."
        )
    return n, ratio, floor, step, loss


class LayerBandit(LayerSelection, Seeded):
    """EXP3 sampler of active layers with a KL-projected, floor-bounded distribution.

    Args:
        num_layers: number of layers ``N`` (``>= 1``).
        layer_ratio: budget ``s = layer_ratio * N`` expected active layers, in ``(0, 1]`` (0.2).
        p_min: floor of every probability, in ``(0, s / N]`` (default 1e-3, the paper's).
        alpha_p: step size, ``>= 0`` (0 freezes the distribution); ``None`` (default): 1e-3
            (the paper's) for ``"shifted"`` and ``"paper"``, 0.03 for ``"rank"``.
        loss: ``"shifted"`` (default), ``"paper"`` or ``"rank"`` (the module docstring).
        generator: :meth:`sample`'s CPU generator (default: seeded by ``torch.initial_seed()``).
        costs: ``[N]`` positive layer costs for the compute budget ``sum(costs * p) =
            layer_ratio * sum(costs)`` (docs/methods.md); ``None`` (default): ``sum(p) = s``.

    Attributes:
        num_samples, num_redraws: draws returned, and empty ones redrawn.
        num_updates, num_skipped: updates applied, and skipped for bad norms.

    Example:
        >>> import torch
        >>> bandit = LayerBandit(10, layer_ratio=0.3, loss="rank",
        ...                      generator=torch.Generator().manual_seed(0))
        >>> float(bandit.probs.sum())  # the budget: 0.3 * 10 layers expected active
        3.0
        >>> active = bandit.sample()  # bool [10], redrawn while empty
        >>> norms = torch.linspace(0.1, 1.0, 10)  # each layer's gradient norm
        >>> bandit.update(active, norms)
        True
        >>> round(float(bandit.probs.sum()), 6), bool((bandit.probs >= 1e-3).all())
        (3.0, True)
    """

    def __init__(self, num_layers: int, layer_ratio: float = 0.2, p_min: float = 1e-3,
                 alpha_p: float | None = None, loss: str = "shifted",
                 generator: torch.Generator | None = None,
                 costs: torch.Tensor | None = None) -> None:  # fmt: skip
        self._n, self._ratio, self._p_min = int(num_layers), float(layer_ratio), float(p_min)
        self._alpha = float(DEFAULT_ALPHA[loss] if alpha_p is None else alpha_p)
        self._loss = loss
        self._costs = _costs(costs, self._n)
        self._budget = self._ratio * float(self._n if costs is None else self._costs.sum())
        if generator is not None and generator.device.type != "cpu":
            raise ValueError(f"generator must be a CPU torch.Generator, got {generator.device}.")
        self._gen = seeded_generator(generator)
        start = self._budget / self._n if self._costs is None else self._ratio  # uniform
        self._probs = torch.full((self._n,), start, dtype=torch.float64)
        self.num_samples = self.num_redraws = self.num_updates = self.num_skipped = 0

    @property
    def num_layers(self) -> int:  # type: ignore[override]
        """Number of layers ``N``."""
        return self._n

    @property
    def probs(self) -> torch.Tensor:
        """Copy of the sampling probabilities: float64 CPU ``[N]``, summing to :attr:`budget`."""
        return self._probs.clone()

    def inclusion(self) -> torch.Tensor:
        """The probability that :meth:`sample` drew each layer: :attr:`probs`."""
        return self._probs.clone()

    @property
    def always_all(self) -> bool:
        """True at ``layer_ratio=1``: every probability is 1, every layer always sampled."""
        return self._ratio >= 1.0

    @property
    def budget(self) -> float:
        """Expected active layers per step, ``s`` (compute: ``layer_ratio * sum(costs)``)."""
        return self._budget

    @property
    def costs(self) -> torch.Tensor | None:
        """Each layer's cost under a compute budget (float64 ``[N]``), else ``None``."""
        return None if self._costs is None else self._costs.clone()

    def sample(self) -> torch.Tensor:
        """Bool ``[N]`` active set: independent Bernoulli(``p``) draws; an empty one redrawn."""
        mask = torch.rand(self._n, generator=self._gen, dtype=torch.float64) < self._probs
        while not bool(mask.any()):
            self.num_redraws += 1
            mask = torch.rand(self._n, generator=self._gen, dtype=torch.float64) < self._probs
        self.num_samples += 1
        return mask

    @property
    def alpha_p(self) -> float:
        """The step size in use (``alpha_p=None`` resolved to the loss's default)."""
        return self._alpha

    @property
    def loss(self) -> str:
        """The loss form: ``"shifted"``, ``"paper"`` or ``"rank"``."""
        return self._loss

    def update(
        self, active: torch.Tensor, norms: torch.Tensor, inclusion: torch.Tensor | None = None
    ) -> bool:
        """Apply one step of Algorithm 2 from the active layers' gradient norms.

        Args:
            active: bool ``[N]``, the mask the norms were measured on.
            norms: ``[N]`` L2 norms of each layer's unperturbed gradient (inactive ignored).
            inclusion: ``[N]`` draw probabilities, ``(0, 1]`` if active (default: :attr:`probs`).

        Returns:
            Whether it changed: not with no active layer, nor (RuntimeWarning) bad norms.
        """
        active = torch.as_tensor(active).detach().to("cpu", torch.bool).reshape(-1)
        r = torch.as_tensor(norms).detach().to("cpu", torch.float64).reshape(-1)
        if active.numel() != self._n or r.numel() != self._n:
            raise ValueError(
                f"active and norms must have {self._n} entries (num_layers), got "
                f"{active.numel()} and {r.numel()}."
            )
        bad = active & ~((r >= 0.0) & (r < math.inf))  # both comparisons are False for NaN
        n_active, n_bad = torch.stack([active.sum(), bad.sum()]).tolist()
        if n_active == 0:
            return False
        if n_bad:
            layers = torch.nonzero(bad).flatten()[:5].tolist()
            warnings.warn(
                f"LayerBandit.update skipped: {n_bad} active layer(s) had a NaN, infinite or "
                f"negative gradient norm (first: {layers}); the sampling probabilities are "
                "unchanged. Check for overflow in the loss or gradients.",
                RuntimeWarning,
                stacklevel=2,
            )
            self.num_skipped += 1
            return False

        p, costs = self._probs, self._costs
        q = p if inclusion is None else self._inclusion(inclusion, active)
        r = torch.where(active, r, 0.0)
        if costs is not None:  # a compute budget: the losses compare r / sqrt(cost)
            r = r / (costs / costs.mean()).sqrt()
        if self._loss == "rank":
            expo = self._alpha * _rank_loss(r / p, active) / q
        else:
            # Work with r / G so squares cannot overflow; G**2 is folded back in at the end.
            g = r.max()
            z = r / torch.where(g > 0, g, 1.0) / p
            shifted = self._loss == "shifted"
            z_ref = z.max() if shifted else (z.max() > 0).double() / self._p_min
            k = torch.where(active, (z_ref - z) * (z_ref + z), 0.0)  # difference of squares
            # Gate on k > 0 so an overflowing G**2 cannot turn 0 * inf into NaN.
            expo = torch.where(k > 0, self._alpha * k / q * g * g, 0.0)
        log_u = torch.log(p) - expo
        if costs is None:
            new = kl_projection(log_u, self._budget, self._p_min, 1.0)
        else:
            new = weighted_kl_projection(log_u, costs, self._budget, self._p_min, 1.0)
        if not bool(torch.isfinite(new).all()):  # defensive: never store a broken state
            warnings.warn("LayerBandit.update skipped: projection failed.", RuntimeWarning, 2)
            self.num_skipped += 1
            return False
        self._probs = new
        self.num_updates += 1
        return True

    def _inclusion(self, inclusion: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        q = torch.as_tensor(inclusion).detach().to("cpu", torch.float64).reshape(-1)
        if q.numel() != self._n:
            raise ValueError(f"inclusion must have {self._n} entries, got {q.numel()}.")
        if not bool(((q > 0) & (q <= 1.0 + 1e-12) | ~active).all()):
            raise ValueError("inclusion probabilities of active layers must be in (0, 1].")
        return torch.where(active, q, 1.0)

    def state_dict(self) -> dict:
        """Everything needed to resume bit-identically, including the generator state."""
        return {
            "probs": self._probs.clone(),
            **self.generator_state(),
            "num_layers": self._n,
            "layer_ratio": self._ratio,
            "p_min": self._p_min,
            "alpha_p": self._alpha,
            "loss": self._loss,
            "costs": self.costs,
            "num_updates": self.num_updates,
            "num_samples": self.num_samples,
            "num_redraws": self.num_redraws,
            "num_skipped": self.num_skipped,
        }

    def carry_state(self, state: dict, index: list[int]) -> dict:
        """Another bandit's state mapped onto these layers (``index[i]``: layer ``i``'s position
        there, -1: new, starts at ``layer_ratio``), re-projected onto the budget if needed.

        Example:
            >>> import torch
            >>> old = LayerBandit(4, layer_ratio=0.5, generator=torch.Generator().manual_seed(0))
            >>> _ = old.update(torch.tensor([True, True, False, False]),
            ...                torch.tensor([1.0, 3.0, 0.0, 0.0]))
            >>> new = LayerBandit(6, layer_ratio=0.5)
            >>> state = new.carry_state(old.state_dict(), [0, 1, 2, 3, -1, -1])
            >>> new.load_state_dict(state)
            >>> torch.equal(new.probs[:4], old.probs), new.probs[4:].tolist()
            (True, [0.5, 0.5])
        """
        old = torch.as_tensor(state["probs"]).detach().to("cpu", torch.float64).reshape(-1)
        start = self._budget / self._n if self._costs is None else self._ratio
        probs = torch.tensor([float(old[j]) if j >= 0 else start for j in index],
                             dtype=torch.float64)  # fmt: skip
        weights = torch.ones(self._n, dtype=torch.float64) if self._costs is None else self._costs
        if abs(float((weights * probs).sum()) - self._budget) > 1e-12 * self._budget:
            log_u = torch.log(probs)
            probs = (
                kl_projection(log_u, self._budget, self._p_min, 1.0)
                if self._costs is None
                else weighted_kl_projection(log_u, self._costs, self._budget, self._p_min, 1.0)
            )
        return {**state, "probs": probs, "num_layers": self._n, "costs": self.costs}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output; ``num_layers`` must match this bandit's."""
        if int(state["num_layers"]) != self._n:
            raise ValueError(
                f"Bandit state is for num_layers={state['num_layers']} but this bandit has "
                f"num_layers={self._n}; the model's layer list changed since the checkpoint."
            )
        cfg = _validated(
            self._n, state["layer_ratio"], state["p_min"], state["alpha_p"], state["loss"]
        )
        saved_costs = state.get("costs")  # absent in checkpoints from before compute budgets
        if (saved_costs is None) != (self._costs is None) or (
            saved_costs is not None and not torch.equal(_costs(saved_costs, self._n), self._costs)
        ):
            raise ValueError(
                "Bandit state was saved under another budget (a count budget against a"
                " compute budget, or other layer costs); resume with the same `budget` option."
            )
        weights = torch.ones(self._n, dtype=torch.float64) if self._costs is None else self._costs
        budget = cfg[1] * float(weights.sum())
        probs = torch.as_tensor(state["probs"]).detach().to("cpu", torch.float64).reshape(-1)
        if probs.numel() != self._n or not (
            bool(((probs >= cfg[2]) & (probs <= 1.0)).all())
            and abs(float((weights * probs).sum()) - budget) <= 1e-9 * budget
        ):
            raise ValueError(
                f"state['probs'] must be {self._n} values in [p_min={cfg[2]}, 1] summing to "
                f"the budget {budget:g}; the checkpoint is corrupt or from another bandit."
            )
        self._n, self._ratio, self._p_min, self._alpha, self._loss = cfg
        self._budget = budget
        self.load_generator_state(state)
        self._probs = probs.clone()
        for key in ("num_updates", "num_samples", "num_redraws", "num_skipped"):
            setattr(self, key, int(state[key]))


def _costs(costs: Any, n: int) -> torch.Tensor | None:
    """``costs`` as a float64 CPU ``[n]`` tensor of positive finite values (or ``None``)."""
    if costs is None:
        return None
    c = torch.as_tensor(costs).detach().to("cpu", torch.float64).reshape(-1)
    if c.numel() != n or not bool(((c > 0) & (c < math.inf)).all()):
        raise ValueError(f"costs must be {n} positive finite values (one per layer).")
    return c


def _rank_loss(z: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Active entries' rank by ``z`` in ``[0, 1]`` (0: largest); inactive and lone ones 0."""
    values = z[active]
    n = values.numel()
    if n < 2:
        return torch.zeros_like(z)
    _, inverse, counts = torch.unique(values, return_inverse=True, return_counts=True)
    below = (torch.cumsum(counts, 0) - counts).double()  # entries strictly smaller
    rank = below[inverse] + (counts[inverse].double() - 1.0) / 2.0  # 0 = smallest
    loss = torch.zeros_like(z)
    loss[active] = 1.0 - rank / (n - 1)
    return loss


# Largest |log-weight| used; beyond it the weights are clipped (still ordered, still finite).
_LOG_CLAMP = 1e300
#: Relative slack when comparing the budget with N * bound (float sums of equal parts).
REL_TOL = 1e-12


def _trivial(
    x: torch.Tensor, total: float, budget: float, lower: float, upper: float, what: str
) -> torch.Tensor | None:
    """Check a projection's input (``total``: sum of costs or ``N``); the solution if forced."""
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
    """Log-weights clamped to +-1e300, -inf below all: a max-shift never gives inf - inf."""
    return torch.where(x == -math.inf, -3 * _LOG_CLAMP, x.clamp(-_LOG_CLAMP, _LOG_CLAMP))


def kl_projection(
    log_u: torch.Tensor, budget: float, lower: float, upper: float = 1.0
) -> torch.Tensor:
    """Exact KL projection of ``u = exp(log_u)`` onto ``{q : sum(q) = budget, lower <= q_l <=
    upper}``: ``q_l = clip(c * u_l, lower, upper)`` for the ``c > 0`` meeting the budget.

    Args:
        log_u: ``[N]`` log-weights (``-inf``: zero weight; NaN and ``+inf`` raise).
        budget: required sum, in ``[N * lower, N * upper]`` (else ValueError).
        lower, upper: the bounds of every entry, ``0 < lower <= upper`` (default 1.0).

    Returns:
        ``[N]`` float64 tensor on ``log_u``'s device (``c`` exact, O(N log N)).

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
    # Solve only the cluster (gaps > log(upper/lower) split them) where the budget runs out,
    # relative to its own top, so the breakpoint arithmetic stays exact for any spread.
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=x.device), xs[:-1] - xs[1:] > width])
    fill = upper * idx.double() + lower * (n - idx).double()  # entries before idx at `upper`
    first = torch.where(starts & (fill <= budget), idx, 0).max()
    last = torch.where(starts & (idx > first), idx, n).min() - 1
    top, bottom = xs[first], xs[last]
    low = bottom - top - width - 1.0  # always at `lower` on the solved cluster's range of t
    xs = torch.where(idx < first, width, torch.where(idx <= last, xs - top, low))
    ta = log_a - xs  # ascending: the t at which each entry rises above `lower`
    tb = log_a + width - xs  # ascending: the t at which each entry reaches `upper`
    # Suffix log-sums: the free entries at any t are a contiguous run of the sorted order.
    lse = torch.cat([torch.logcumsumexp(xs.flip(0), 0).flip(0), xs.new_full((1,), -math.inf)])

    # Counts capped / above `lower` at each breakpoint from one sort (not searchsorted).
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

    # Rounding may leave an entry a hair outside the box: clip, the free entries absorb it.
    q = q.clamp(lower, upper)
    free_mask = (q > lower) & (q < upper)
    free_sum = torch.where(free_mask, q, 0.0).sum()
    fix = (budget - torch.where(free_mask, 0.0, q).sum()) / free_sum
    q = torch.where(free_mask & (free_sum > 0), q * fix, q).clamp(lower, upper)
    return torch.empty_like(q).scatter_(0, order, q)


def weighted_kl_projection(log_u: torch.Tensor, costs: torch.Tensor, budget: float, lower: float,
                           upper: float = 1.0) -> torch.Tensor:  # fmt: skip
    """Exact minimiser of ``sum(costs * KL(q_l || u_l))`` over ``{q : sum(costs * q) = budget,
    lower <= q_l <= upper}``: ``q_l = clip(t * u_l, lower, upper)`` for one ``t > 0``.

    Args:
        log_u: ``[N]`` log-weights (as :func:`kl_projection`).
        costs: ``[N]`` positive, finite costs; only their ratios matter.
        budget: required ``sum(costs * q)``, in ``[lower * sum(costs), upper * sum(costs)]``.
        lower, upper: the bounds of every entry, ``0 < lower <= upper`` (default 1.0).

    Returns:
        ``[N]`` float64 tensor on ``log_u``'s device (``t`` exact).

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

    # Breakpoints: entry l leaves `lower` at log(lower) - x_l, reaches `upper` at log(upper) - x_l.
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
