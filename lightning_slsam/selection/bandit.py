"""EXP3-style layer sampler of SL-SAM (the paper's Algorithm 2, "Update Distribution").

SL-SAM keeps one probability ``p_l`` per layer (``N`` layers), with ``sum(p) = s`` where
``s = layer_ratio * N`` is the expected number of active layers per step. Each step:

1. :meth:`LayerBandit.sample` draws layer ``l`` independently with probability ``p_l``
   (redrawing the whole vector if nothing was drawn, as the released code does).
2. The optimizer runs sparse SAM on the active layers and measures ``r_l``, the L2 norm of
   each active layer's first (unperturbed) gradient.
3. :meth:`LayerBandit.update` turns the norms into a loss ``k_l`` (``0`` for inactive
   layers), forms ``u_l = p_l * exp(-alpha_p * k_l / p_l)`` and sets the new ``p`` to the KL
   projection of ``u`` onto ``{q : sum(q) = s, p_min <= q_l <= 1}`` (:func:`kl_projection`).

Three loss forms are offered:

* ``"paper"``: Algorithm 2 literally, ``k_l = G**2 / p_min**2 - r_l**2 / p_l**2`` with
  ``G = max_{j active} r_j``.
* ``"shifted"`` (default): ``k_l = max_{j active} (r_j / p_j)**2 - (r_l / p_l)**2``, the form
  in the authors' released code. The literal form charges every sampled layer the constant
  ``G**2 / p_min**2`` that unsampled layers (``k = 0``) do not pay; with the paper's constants
  (``p_min = alpha_p = 1e-3``) and unit norms, ``alpha_p * k_l / p_l ~ 1e3 / p_l`` (5000 at
  ``p_l = 0.2``), so one step drives every sampled layer to the floor whatever its norm. The
  shift (best active layer has loss 0) keeps only the differences between layers.
* ``"rank"`` (scale-free, beyond the paper): ``k_l`` is layer ``l``'s rank among the active
  layers by ``r_l / p_l``, scaled to ``[0, 1]`` (0 for the largest, 1 for the smallest; ties
  share their mean rank). Both forms above grow with the *square of the raw gradient norms*,
  so the same ``alpha_p`` barely moves the distribution when norms are ~0.1 (a pretrained
  Transformer) and sends most sampled layers to the floor in one step when one norm is ~40
  (a CNN's stem at its first step). The rank loss is bounded and unit-free: multiplying
  every norm by any constant leaves the trajectory unchanged. Its fixed point is the same
  as the others' -- equal expected loss for every free layer means equal ``r_l / p_l``, i.e.
  ``p`` proportional to the gradient norms, the distribution minimising the variance
  ``sum(r**2 / p)`` that Algorithm 2 descends. Its step size is chosen by measurement (see
  ``docs/results.md``): 0.03.

``update`` divides each loss by the layer's *true* inclusion probability ``q_l``
(``inclusion``), which is ``p_l`` when the bandit alone draws the active set, and more or
less when a wrapper changes the draw (a dense warm-up, a depth cut).

Unlike the released code (which only clips at 1e-8), the lower bound ``p_min`` is enforced
exactly, so every layer keeps at least a ``p_min`` chance of being sampled. ``u`` is formed
in log space (float64), so it never under- or overflows.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any

import torch

from lightning_slsam.core.seeding import Seeded, seeded_generator
from lightning_slsam.core.validation import RATIO, number
from lightning_slsam.selection.projection import REL_TOL, kl_projection, weighted_kl_projection
from lightning_slsam.selection.rules import LayerSelection

__all__ = ["LayerBandit", "kl_projection"]

_LOSSES = ("shifted", "paper", "rank")
#: Step size used when ``alpha_p`` is None: the paper's 1e-3 for its losses; for the rank
#: loss, the value measured to track the gradient norms within a short fine-tune.
DEFAULT_ALPHA = {"shifted": 1e-3, "paper": 1e-3, "rank": 0.03}


def _validated(
    num_layers: int, layer_ratio: float, p_min: float, alpha_p: float | None, loss: str
) -> tuple[int, float, float, float, str]:
    """Check the bandit's hyper-parameters; raise ValueError naming the bad one and the fix.

    ``alpha_p=None`` resolves to the loss's default (:data:`DEFAULT_ALPHA`).
    """
    if loss not in _LOSSES:
        raise ValueError(f"loss={loss!r} is invalid: use one of {_LOSSES}.")
    if alpha_p is None:
        alpha_p = DEFAULT_ALPHA[loss]
    integral = isinstance(num_layers, numbers.Integral) and not isinstance(num_layers, bool)
    if not integral or num_layers < 1:
        raise ValueError(f"num_layers={num_layers!r} is invalid: pass an int >= 1.")
    n = int(num_layers)
    ratio = RATIO("layer_ratio", layer_ratio)
    floor = number(0, 1, low_open=True, high_open=True, note=", e.g. 1e-3")("p_min", p_min)
    if floor * n > ratio * n * (1.0 + REL_TOL):
        raise ValueError(
            f"p_min={p_min!r} is too large for {n} layers at layer_ratio={ratio}: the floors "
            f"alone exceed the budget s={ratio * n:g}; use p_min <= s/N = {ratio:g}."
        )
    step = number(0, note=", e.g. 1e-3")("alpha_p", alpha_p)
    return n, ratio, floor, step, loss


class LayerBandit(LayerSelection, Seeded):
    """EXP3 sampler of active layers with a KL-projected, floor-bounded distribution.

    Args:
        num_layers: Number of layers ``N`` (int, ``>= 1``).
        layer_ratio: Expected fraction of active layers, in ``(0, 1]``; the budget is
            ``s = layer_ratio * N`` expected active layers. Default 0.2 (the paper's ``s/N``).
        p_min: Floor of every probability, in ``(0, 1)`` with ``p_min <= s / N``. Default
            1e-3 (the paper's value).
        alpha_p: Step size of the exponential update, ``>= 0`` (0 freezes the distribution).
            With the ``"shifted"`` and ``"paper"`` losses its effect scales with the squared
            gradient norms, which are not normalised. ``None`` (default): the loss's own
            value, 1e-3 (the paper's) for ``"shifted"`` and ``"paper"``, 0.03 for ``"rank"``.
        loss: ``"shifted"`` (default, the released code's loss), ``"paper"`` (Algorithm 2
            literally) or ``"rank"`` (scale-free); see the module docstring.
        generator: CPU ``torch.Generator`` used only by :meth:`sample`. If None, a private one
            is seeded with ``torch.initial_seed()``, so a global seed (e.g. Lightning's
            ``seed_everything``) makes sampling reproducible without consuming the global
            RNG stream.
        costs: ``[N]`` positive cost of drawing each layer (beyond the paper). ``None``
            (default): the paper's count budget, ``sum(p) = s``. Given: a compute budget,
            ``sum(costs * p) = layer_ratio * sum(costs)``: the expected cost of a draw is
            ``layer_ratio`` of drawing everything, whichever layers the bandit favours
            (:func:`~lightning_slsam.selection.projection.weighted_kl_projection`). The losses then
            compare ``r / sqrt(cost)`` instead of ``r``: the distribution minimising the
            variance ``sum(r**2 / p)`` under that budget is ``p ~ r / sqrt(cost)``.

    Attributes:
        num_samples: Masks returned by :meth:`sample`.
        num_redraws: Empty draws that were discarded and redrawn.
        num_updates: Updates applied. ``num_skipped``: updates skipped for bad norms.

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

    def __init__(
        self,
        num_layers: int,
        layer_ratio: float = 0.2,
        p_min: float = 1e-3,
        alpha_p: float | None = None,
        loss: str = "shifted",
        generator: torch.Generator | None = None,
        costs: torch.Tensor | None = None,
    ) -> None:
        cfg = _validated(num_layers, layer_ratio, p_min, alpha_p, loss)
        self._n, self._ratio, self._p_min, self._alpha, self._loss = cfg
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

    @property
    def always_all(self) -> bool:
        """True at ``layer_ratio=1``: every probability is 1, every layer always sampled."""
        return self._ratio >= 1.0

    @property
    def budget(self) -> float:
        """Expected number of active layers per step, ``s = layer_ratio * N``; under a
        compute budget, the expected cost of a draw, ``layer_ratio * sum(costs)``."""
        return self._budget

    @property
    def costs(self) -> torch.Tensor | None:
        """Each layer's cost under a compute budget (float64 ``[N]``), else ``None``."""
        return None if self._costs is None else self._costs.clone()

    def _project(self, log_u: torch.Tensor) -> torch.Tensor:
        if self._costs is None:
            return kl_projection(log_u, self._budget, self._p_min, 1.0)
        return weighted_kl_projection(log_u, self._costs, self._budget, self._p_min, 1.0)

    def sample(self) -> torch.Tensor:
        """Draw the active set: bool ``[N]``, layer ``l`` True with probability ``p_l``.

        Draws are independent Bernoulli trials from the bandit's own generator; an all-False
        draw is discarded and redrawn (counted in ``num_redraws``), so at least one layer is
        always active and the marginals are ``p_l / (1 - prod(1 - p))``.
        """
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
            norms: ``[N]`` float L2 norms of each layer's unperturbed gradient (any device or
                dtype); entries of inactive layers are ignored and may hold anything.
            inclusion: ``[N]`` probability with which each layer was actually drawn into
                ``active``, for the importance weights; ``None`` (default) means the
                bandit's own :attr:`probs` (it drew the mask alone). Entries of inactive
                layers are ignored; active ones must be in ``(0, 1]``.

        Returns:
            True if the distribution was updated; False if no layer was active, or (with a
            RuntimeWarning) if an active norm was NaN, infinite or negative.
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

        p = self._probs
        q = p if inclusion is None else self._inclusion(inclusion, active)
        r = torch.where(active, r, 0.0)
        r = _per_root_cost(r, self._costs)
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
        new = self._project(torch.log(p) - expo)
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


def _per_root_cost(r: torch.Tensor, costs: torch.Tensor | None) -> torch.Tensor:
    """The norms the losses compare: ``r`` (count budget), or ``r / sqrt(cost)`` under a
    compute budget, where the variance ``sum(r**2 / p)`` is least at ``p ~ r / sqrt(cost)``
    rather than ``p ~ r``: a large layer must earn its price."""
    return r if costs is None else r / (costs / costs.mean()).sqrt()


def _rank_loss(z: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Each active entry's rank by ``z`` in ``[0, 1]``: 0 for the largest, 1 for the smallest.

    Ties share their mean rank; inactive entries get 0; a lone active entry gets 0.
    """
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
