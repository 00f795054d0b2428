"""SL-SAM's layer bandit (:mod:`lightning_slsam.selection.bandit`, the paper's Algorithm 2):
its update rule against hand computations and a NumPy reference, sampling, state, the checks
of its options and of a saved state, the rank loss, importance weights, the compute budget,
and the KL projections it renormalises with (the count projection and the cost-weighted one
of the compute budget), each against an independent bisection solver."""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
import pytest
import torch
from probes import bisect_projection

from examples.methods import SLSAMAblationSpec
from lightning_slsam.methods.registry import method_spec
from lightning_slsam.selection.bandit import (
    DEFAULT_ALPHA,
    REL_TOL,
    LayerBandit,
    kl_projection,
    weighted_kl_projection,
)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- update rule


def _uniform_losses(active: list[bool], norms: list[float], p: float, ref: float) -> list[float]:
    """k_l = ref**2 - (r_l / p)**2 on active layers (all probs equal to p), 0 elsewhere."""
    return [ref**2 - (r / p) ** 2 if a else 0.0 for a, r in zip(active, norms)]


def test_shifted_loss_hand_computed_no_clipping():
    bandit = LayerBandit(4, layer_ratio=0.5, p_min=0.01, alpha_p=0.1, loss="shifted")
    active = [True, True, False, True]
    norms = [1.0, 0.5, math.nan, 0.2]
    assert bandit.update(torch.tensor(active), torch.tensor(norms, dtype=torch.float64))
    # p = 0.5 everywhere; max (r/p)^2 = 4 -> k = [0, 3, 0, 3.84].
    k = _uniform_losses(active, [1.0, 0.5, 0.0, 0.2], 0.5, 2.0)
    assert k == pytest.approx([0.0, 3.0, 0.0, 3.84])
    u = [0.5 * math.exp(-0.1 * kl / 0.5) for kl in k]
    want = torch.tensor([ui * 2.0 / sum(u) for ui in u], dtype=torch.float64)
    assert min(want) > 0.01 and max(want) < 1.0  # no clipping in this case
    torch.testing.assert_close(bandit.probs, want, rtol=0, atol=1e-14)
    assert bandit.num_updates == 1


def test_shifted_loss_hand_computed_floor():
    bandit = LayerBandit(4, layer_ratio=0.5, p_min=0.01, alpha_p=1.0, loss="shifted")
    assert bandit.update(torch.tensor([True, True, False, True]), torch.tensor([1.0, 0, 9, 0]))
    # u = 0.5 * exp(-[0, 8, 0, 8]): layers 1 and 3 fall below the floor; 0 and 2 share 1.98.
    want = torch.tensor([0.99, 0.01, 0.99, 0.01], dtype=torch.float64)
    torch.testing.assert_close(bandit.probs, want, rtol=0, atol=1e-14)


def test_paper_loss_hand_computed_no_clipping():
    bandit = LayerBandit(4, layer_ratio=0.5, p_min=0.4, alpha_p=0.01, loss="paper")
    active = [True, True, False, True]
    norms = torch.tensor([1.0, 0.5, -7.0, 0.2], dtype=torch.float64)
    assert bandit.update(torch.tensor(active), norms)
    # G = 1: k = 1/0.4^2 - (r/0.5)^2 = [2.25, 5.25, 0, 6.09].
    k = _uniform_losses(active, [1.0, 0.5, 0.0, 0.2], 0.5, 1.0 / 0.4)
    assert k == pytest.approx([2.25, 5.25, 0.0, 6.09])
    u = [0.5 * math.exp(-0.01 * kl / 0.5) for kl in k]
    want = torch.tensor([ui * 2.0 / sum(u) for ui in u], dtype=torch.float64)
    assert min(want) > 0.4 and max(want) < 1.0
    torch.testing.assert_close(bandit.probs, want, rtol=0, atol=1e-14)


def test_paper_loss_sampled_layers_hit_floor():
    bandit = LayerBandit(4, layer_ratio=0.5, p_min=0.1, alpha_p=0.1, loss="paper")
    assert bandit.update(torch.tensor([True, True, False, False]), torch.tensor([1.0, 0.3, 0, 0]))
    # k ~ 100 -> u_active ~ 0.5 * exp(-20): both sampled layers at p_min, the rest share 1.8.
    want = torch.tensor([0.1, 0.1, 0.9, 0.9], dtype=torch.float64)
    torch.testing.assert_close(bandit.probs, want, rtol=0, atol=1e-14)


def _reference_step(p, active, norms, loss, p_min, alpha_p, budget) -> np.ndarray:
    """Algorithm 2 with plain NumPy floats and the bisection projection."""
    p, r = np.asarray(p, dtype=float), np.where(active, norms, 0.0)
    if loss == "shifted":
        k = np.max((r / p)[active] ** 2) - (r / p) ** 2
    else:
        k = r[active].max() ** 2 / p_min**2 - (r / p) ** 2
    log_u = np.log(p) - alpha_p * np.where(active, k, 0.0) / p
    return bisect_projection(log_u, budget, p_min, 1.0)


@pytest.mark.parametrize("loss", ["shifted", "paper"])
def test_update_matches_numpy_reference_step_by_step(loss):
    bandit = LayerBandit(8, 0.375, p_min=0.02, alpha_p=0.05, loss=loss, generator=_seeded(5))
    rng = np.random.default_rng(6)
    for _ in range(300):
        before, active = bandit.probs, bandit.sample()
        norms = rng.lognormal(0.0, 1.0, size=8)
        assert bandit.update(active, torch.from_numpy(norms))
        want = _reference_step(before.numpy(), active.numpy(), norms, loss, 0.02, 0.05, 3.0)
        np.testing.assert_allclose(bandit.probs.numpy(), want, rtol=0, atol=1e-9)


def test_paper_constants_do_not_overflow_and_floor_sampled_layers():
    bandit = LayerBandit(10, layer_ratio=0.2, p_min=1e-3, alpha_p=1e-3, loss="paper")
    active = torch.zeros(10, dtype=torch.bool)
    active[[1, 4, 7]] = True
    norms = torch.tensor([0.0, 1.0, 0, 0, 0.9, 0, 0, 1.1, 0, 0])
    assert bandit.update(active, norms)  # exponents ~ -5000: exp would underflow to 0
    p = bandit.probs
    assert bool(torch.isfinite(p).all())
    assert torch.equal(p[active], torch.full((3,), 1e-3, dtype=torch.float64))
    torch.testing.assert_close(p[~active], torch.full((7,), (2.0 - 3e-3) / 7, dtype=torch.float64))
    # The released code's shifted loss barely moves on the same input.
    shifted = LayerBandit(10, layer_ratio=0.2, p_min=1e-3, alpha_p=1e-3, loss="shifted")
    shifted.update(active, norms)
    assert shifted.probs[active].min().item() > 0.15


def test_alpha_zero_keeps_distribution():
    bandit = LayerBandit(6, layer_ratio=0.5, p_min=0.05, alpha_p=0.0)
    bandit.update(torch.tensor([True, False] * 3), torch.tensor([1e3, 0, 1.0, 0, 0.0, 0]))
    torch.testing.assert_close(bandit.probs, torch.full((6,), 0.5, dtype=torch.float64))


def test_shifted_loss_converges_to_probabilities_proportional_to_norms():
    # Fixed norms [3, 1, ..., 1] and s = 3: the shifted loss is zero for every layer exactly
    # when r_l / p_l is equal across layers, i.e. p = [0.75, 0.25, ..., 0.25].
    bandit = LayerBandit(10, layer_ratio=0.3, p_min=0.01, alpha_p=1e-3, generator=_seeded(3))
    norms = torch.ones(10, dtype=torch.float64)
    norms[0] = 3.0
    for _ in range(1000):
        bandit.update(bandit.sample(), norms)
    want = torch.tensor([0.75] + [0.25] * 9, dtype=torch.float64)
    torch.testing.assert_close(bandit.probs, want, rtol=0, atol=0.02)


def _adversarial_norms(step: int, n: int, gen: torch.Generator) -> torch.Tensor:
    kind = step % 6
    if kind == 0:
        return torch.zeros(n)
    if kind == 1:
        return torch.full((n,), 1e-30, dtype=torch.float64)
    if kind == 2:
        return torch.full((n,), 1e30, dtype=torch.float64)
    if kind == 3:  # one layer dominates by 33 orders of magnitude
        norms = torch.full((n,), 1e-3, dtype=torch.float64)
        norms[torch.randint(n, (1,), generator=gen)] = 1e30
        return norms
    if kind == 4:
        return 10 ** (torch.rand(n, generator=gen, dtype=torch.float64) * 60 - 30)
    return torch.rand(n, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("loss", ["shifted", "paper"])
@pytest.mark.parametrize(
    ("n", "ratio", "p_min", "alpha_p"),
    [(10, 0.2, 1e-3, 1e-3), (40, 0.8, 1e-2, 0.5), (200, 0.5, 1e-4, 10.0)],
)
def test_invariants_under_adversarial_updates(loss, n, ratio, p_min, alpha_p):
    bandit = LayerBandit(n, ratio, p_min, alpha_p, loss, generator=_seeded(n))
    gen = _seeded(1000 + n)
    history = []
    for step in range(3000):
        if step % 2:
            active = bandit.sample()
        else:  # arbitrary active sets, including empty and full ones
            active = torch.rand(n, generator=gen) < torch.rand(1, generator=gen)
        norms = _adversarial_norms(step // 2, n, gen)
        norms[~active] = math.nan  # garbage on inactive layers must be ignored
        assert bandit.update(active, norms) == bool(active.any())
        history.append(bandit.probs)
    probs = torch.stack(history)
    budget = ratio * n
    assert bandit.budget == budget
    assert bool(torch.isfinite(probs).all())
    assert (probs.sum(1) - budget).abs().max().item() <= 1e-12 * budget
    assert probs.min().item() >= p_min and probs.max().item() <= 1.0
    assert bandit.num_skipped == 0


def test_inactive_norms_are_ignored():
    active = torch.tensor([True, False, True, False, False])
    a = LayerBandit(5, layer_ratio=0.4, p_min=0.01, alpha_p=0.5)
    b = LayerBandit(5, layer_ratio=0.4, p_min=0.01, alpha_p=0.5)
    assert a.update(active, torch.tensor([0.3, 0.0, 2.0, 0.0, 0.0]))
    assert b.update(active, torch.tensor([0.3, math.nan, 2.0, math.inf, -5.0]))
    assert torch.equal(a.probs, b.probs)
    assert not torch.equal(a.probs, torch.full((5,), 0.4, dtype=torch.float64))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_bad_active_norm_skips_update_with_warning(bad):
    bandit = LayerBandit(5, layer_ratio=0.4, p_min=0.01, alpha_p=0.5)
    bandit.update(torch.tensor([True, True, False, False, False]), torch.tensor([1.0, 2, 0, 0, 0]))
    before = bandit.probs
    with pytest.warns(RuntimeWarning, match="skipped"):
        applied = bandit.update(
            torch.tensor([True, False, True, False, False]), torch.tensor([1.0, 0, bad, 0, 0])
        )
    assert applied is False
    assert torch.equal(bandit.probs, before)
    assert (bandit.num_skipped, bandit.num_updates) == (1, 1)


def test_update_with_no_active_layer_is_a_silent_no_op():
    bandit = LayerBandit(5, layer_ratio=0.4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bandit.update(torch.zeros(5, dtype=torch.bool), torch.full((5,), math.nan)) is False
    assert torch.equal(bandit.probs, torch.full((5,), 0.4, dtype=torch.float64))
    assert bandit.num_updates == 0 and bandit.num_skipped == 0


def test_update_rejects_wrong_length():
    bandit = LayerBandit(5)
    with pytest.raises(ValueError, match="num_layers"):
        bandit.update(torch.ones(4, dtype=torch.bool), torch.ones(4))


def test_full_layer_ratio_keeps_every_layer_active():
    bandit = LayerBandit(7, layer_ratio=1.0, p_min=0.1, alpha_p=1.0, generator=_seeded(0))
    gen = _seeded(1)
    for _ in range(50):
        mask = bandit.sample()
        assert bool(mask.all())
        assert bandit.update(mask, torch.rand(7, generator=gen) * 100)
        assert torch.equal(bandit.probs, torch.ones(7, dtype=torch.float64))


# --------------------------------------------------------------------------- sampling, state


def test_sampling_is_reproducible_from_seed():
    a = LayerBandit(30, generator=_seeded(42))
    b = LayerBandit(30, generator=_seeded(42))
    c = LayerBandit(30, generator=_seeded(43))
    masks_a = torch.stack([a.sample() for _ in range(100)])
    masks_b = torch.stack([b.sample() for _ in range(100)])
    masks_c = torch.stack([c.sample() for _ in range(100)])
    assert masks_a.dtype == torch.bool and masks_a.shape == (100, 30)
    assert torch.equal(masks_a, masks_b)
    assert not torch.equal(masks_a, masks_c)


def test_default_generator_follows_global_seed_without_consuming_it():
    torch.manual_seed(123)
    first = torch.stack([LayerBandit(20).sample() for _ in range(3)])
    torch.manual_seed(123)
    bandit = LayerBandit(20)
    second = torch.stack([bandit.sample()] + [LayerBandit(20).sample() for _ in range(2)])
    assert torch.equal(first[0], second[0])
    torch.manual_seed(124)
    assert not torch.equal(first, torch.stack([LayerBandit(20).sample() for _ in range(3)]))
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    for _ in range(10):
        bandit.sample()
    assert torch.equal(torch.rand(3), expected)


def test_sample_frequencies_match_probabilities():
    probs = torch.tensor([0.9, 0.05, 0.5, 0.3, 0.25], dtype=torch.float64)
    bandit = LayerBandit(5, layer_ratio=0.4, p_min=0.01, generator=_seeded(7))
    state = bandit.state_dict()
    state["probs"] = probs
    bandit.load_state_dict(state)
    draws = 20000
    masks = torch.stack([bandit.sample() for _ in range(draws)])
    assert bool(masks.any(1).all())  # never empty
    # Redrawing empty masks conditions on "not empty": marginals are p / (1 - P(empty)).
    p_empty = torch.prod(1 - probs).item()
    expected = probs / (1 - p_empty)
    stderr = (expected * (1 - expected) / draws).sqrt()
    assert bool(((masks.double().mean(0) - expected).abs() < 4 * stderr).all())
    mean_redraws = draws * p_empty / (1 - p_empty)
    assert abs(bandit.num_redraws - mean_redraws) < 5 * math.sqrt(mean_redraws)
    assert bandit.num_samples == draws


def test_state_dict_round_trip_continues_identically():
    src = LayerBandit(12, 0.3, p_min=0.01, alpha_p=0.2, loss="paper", generator=_seeded(8))
    gen = _seeded(9)
    for _ in range(20):
        src.update(src.sample(), torch.rand(12, generator=gen))
    buffer = io.BytesIO()
    torch.save(src.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    dst = LayerBandit(12, 0.5, p_min=0.1, alpha_p=0.0, loss="shifted", generator=_seeded(99))
    dst.load_state_dict(state)
    assert torch.equal(dst.probs, src.probs)
    assert {k: v for k, v in dst.state_dict().items() if k not in ("probs", "generator")} == {
        k: v for k, v in src.state_dict().items() if k not in ("probs", "generator")
    }
    for _ in range(50):
        mask_src, mask_dst = src.sample(), dst.sample()
        assert torch.equal(mask_src, mask_dst)
        norms = torch.rand(12, generator=gen)
        assert src.update(mask_src, norms) == dst.update(mask_dst, norms)
        assert torch.equal(src.probs, dst.probs)
    assert dst.num_samples == src.num_samples == 70


def test_state_dict_is_a_snapshot():
    bandit = LayerBandit(6, 0.5, p_min=0.05, alpha_p=1.0)
    state = bandit.state_dict()
    bandit.update(torch.tensor([True] + [False] * 5), torch.tensor([1.0] + [0.0] * 5))
    assert torch.equal(state["probs"], torch.full((6,), 0.5, dtype=torch.float64))


def test_load_state_dict_rejects_mismatched_layers_or_probs():
    state = LayerBandit(8).state_dict()
    with pytest.raises(ValueError, match=r"num_layers=8.*num_layers=9"):
        LayerBandit(9).load_state_dict(state)
    state["probs"] = torch.full((8,), 0.5, dtype=torch.float64)  # sums to 4, not 1.6
    with pytest.raises(ValueError, match="probs"):
        LayerBandit(8).load_state_dict(state)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"layer_ratio": 0.0}, "layer_ratio"),
        ({"layer_ratio": 1.5}, "layer_ratio"),
        ({"layer_ratio": math.nan}, "layer_ratio"),
        ({"layer_ratio": "big"}, "layer_ratio"),
        ({"p_min": 0.0}, "p_min"),
        ({"p_min": 1.0}, "p_min"),
        ({"p_min": -1e-3}, "p_min"),
        ({"p_min": math.nan}, "p_min"),
        ({"p_min": 0.3}, "p_min"),  # 0.3 * N layers > s = 0.2 * N
        ({"alpha_p": -1e-3}, "alpha_p"),
        ({"alpha_p": math.inf}, "alpha_p"),
        ({"alpha_p": math.nan}, "alpha_p"),
        ({"bandit_loss": "literal"}, "bandit_loss"),
    ],
)
def test_invalid_bandit_options_are_refused_by_the_spec_with_the_option_name(options, name):
    # The bandit's options are checked once, by the method's specification.
    with pytest.raises(ValueError, match=f"`{name}`"):
        SLSAMAblationSpec(**options)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("layer_ratio", 0.0, "layer_ratio=0.0"),
        ("layer_ratio", 1.5, "layer_ratio=1.5"),
        ("p_min", 1.0, "p_min=1.0"),
        ("p_min", math.nan, "p_min=nan"),
        ("alpha_p", -1e-3, "alpha_p=-0.001"),
        ("alpha_p", math.inf, "alpha_p=inf"),
        ("loss", "literal", "loss='literal' is invalid"),
    ],
)
def test_a_state_with_invalid_hyperparameters_is_refused(key, value, match):
    state = LayerBandit(10).state_dict()
    state[key] = value
    bandit = LayerBandit(10)
    with pytest.raises(ValueError, match=match):
        bandit.load_state_dict(state)
    assert torch.equal(bandit.probs, torch.full((10,), 0.2, dtype=torch.float64))


def test_p_min_too_large_message_suggests_a_fix():
    with pytest.raises(ValueError, match=r"`p_min` must be at most layer_ratio=0\.2"):
        method_spec("slsam", layer_ratio=0.2, p_min=0.3)
    state = LayerBandit(10, layer_ratio=0.2).state_dict()
    state["p_min"] = 0.3
    with pytest.raises(ValueError, match=r"p_min=0\.3 is too large.*p_min <= s/N = 0\.2"):
        LayerBandit(10, layer_ratio=0.2).load_state_dict(state)
    # Exactly s/N is allowed: uniform forever.
    assert method_spec("slsam", layer_ratio=0.2, p_min=0.2).p_min == 0.2
    bandit = LayerBandit(10, layer_ratio=0.2, p_min=0.2, alpha_p=1.0)
    assert bandit.update(torch.tensor([True] * 3 + [False] * 7), torch.arange(1.0, 11.0))
    torch.testing.assert_close(bandit.probs, torch.full((10,), 0.2, dtype=torch.float64))


def test_initial_distribution_is_uniform():
    bandit = LayerBandit(25, layer_ratio=0.2)
    assert bandit.budget == pytest.approx(5.0)
    assert torch.equal(bandit.probs, torch.full((25,), 0.2, dtype=torch.float64))
    assert bandit.probs.dtype == torch.float64 and bandit.probs.device.type == "cpu"


# --------------------------------------------------------------------------- rank loss


def test_rank_loss_hand_computed_with_ties():
    bandit = LayerBandit(5, layer_ratio=0.4, p_min=0.01, alpha_p=0.2, loss="rank")
    p = bandit.probs.numpy()
    active = torch.tensor([True, True, True, True, False])
    norms = torch.tensor([0.4, 0.1, 0.4, 0.2, 99.0])  # r/p ranks: 0.4 tie on top, 0.1 last
    bandit.update(active, norms)
    # Ranks by r / p (equal p): 0.1 -> 0, 0.2 -> 1, the two 0.4 share (2 + 3) / 2 = 2.5.
    loss = 1.0 - np.array([2.5, 0.0, 2.5, 1.0]) / 3.0
    log_u = np.log(p) - 0.2 * np.append(loss, 0.0) / p
    want = bisect_projection(log_u, 2.0, 0.01, 1.0)
    np.testing.assert_allclose(bandit.probs.numpy(), want, rtol=0, atol=1e-12)


def test_rank_loss_alpha_default_and_paper_losses_keep_theirs():
    assert DEFAULT_ALPHA == {"shifted": 1e-3, "paper": 1e-3, "rank": 0.03}
    assert LayerBandit(10, loss="rank").alpha_p == 0.03
    assert LayerBandit(10, loss="shifted").alpha_p == 1e-3
    assert LayerBandit(10, loss="paper").alpha_p == 1e-3
    assert LayerBandit(10, alpha_p=0.5, loss="rank").alpha_p == 0.5


@pytest.mark.parametrize("k", [-3, -2, -1, 1, 2, 3])
def test_rank_loss_trajectory_is_invariant_to_the_norms_units(k):
    """Multiplying every gradient norm by 10**k leaves the whole trajectory unchanged:
    the same masks drawn and the same probabilities after every update."""
    rng = np.random.default_rng(0)
    n, steps = 60, 150
    # Norms spread over five orders of magnitude, as a CNN's are (a stem ~10, biases ~1e-4).
    base = torch.tensor(10 ** rng.uniform(-4, 1, size=n))
    trace = [base * torch.tensor(rng.lognormal(0, 0.3, size=n)) for _ in range(steps)]
    runs = []
    for scale in (1.0, 10.0**k):
        bandit = LayerBandit(n, 0.2, p_min=1e-3, loss="rank", generator=_seeded(1))
        masks, probs = [], []
        for norms in trace:
            mask = bandit.sample()
            bandit.update(mask, norms * scale)
            masks.append(mask)
            probs.append(bandit.probs)
        runs.append((torch.stack(masks), torch.stack(probs)))
    assert torch.equal(runs[0][0], runs[1][0])
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-12, atol=1e-15)
    assert runs[0][1][-1].std() > 0.05  # the distribution really moved


def test_shifted_loss_is_not_scale_free():
    """The released code's loss, kept as it is: its step grows with the squared norms."""
    moved = []
    for scale in (1e-2, 1.0, 1e2):
        bandit = LayerBandit(6, 0.5, p_min=1e-3, loss="shifted", generator=_seeded(0))
        bandit.update(torch.ones(6, dtype=torch.bool), torch.arange(1.0, 7.0) * scale)
        moved.append(float((bandit.probs - 0.5).abs().max()))
    assert moved[0] < 1e-4 < moved[1] < moved[2]


def test_rank_loss_tracks_the_gradient_norms():
    """Sampling from the bandit, frequencies end up ordered like the layers' norms (the
    fixed point is p proportional to the norms), within a few hundred steps."""
    from examples.report import rank_correlation

    n = 40
    rng = np.random.default_rng(3)
    mean = torch.tensor(10 ** rng.uniform(-3, 1, size=n))
    noise = [torch.tensor(rng.lognormal(0, 0.2, size=n)) for _ in range(300)]
    spearman = {}
    for loss in ("rank", "shifted"):
        bandit = LayerBandit(n, 0.25, p_min=1e-3, loss=loss, generator=_seeded(2))
        counts = torch.zeros(n)
        for factor in noise:
            mask = bandit.sample()
            counts += mask
            bandit.update(mask, mean * factor)
        spearman[loss] = rank_correlation(counts, mean), rank_correlation(bandit.probs, mean)
    assert spearman["rank"][0] > 0.85 and spearman["rank"][1] > 0.75
    # The released code's loss on the same norms: driven by the few largest ones.
    assert spearman["shifted"][0] < spearman["rank"][0] - 0.25


# --------------------------------------------------------------------------- inclusion


def test_update_uses_the_true_inclusion_probability_as_importance_weight():
    p_min, alpha = 0.01, 0.05
    for loss in ("shifted", "paper", "rank"):
        a = LayerBandit(6, 0.5, p_min=p_min, alpha_p=alpha, loss=loss)
        b = LayerBandit(6, 0.5, p_min=p_min, alpha_p=alpha, loss=loss)
        active = torch.tensor([True, True, False, True, True, False])
        norms = torch.tensor([0.5, 0.2, 0.0, 0.9, 0.1, 0.0])
        q = torch.tensor([0.9, 0.6, 0.3, 0.75, 0.5, 1.0], dtype=torch.float64)
        a.update(active, norms)  # drawn by the bandit alone: q = p
        b.update(active, norms, inclusion=q)
        # The exponent is divided by q instead of p: compare with the reference.
        p = np.full(6, 0.5)
        z = norms.numpy() / p
        if loss == "rank":
            k = np.array([1 / 3, 2 / 3, 0, 0, 1, 0])
        else:
            ref = z[active.numpy()].max() if loss == "shifted" else 1.0 / p_min * 0.9
            k = np.where(active.numpy(), ref**2 - z**2, 0.0)
            if loss == "paper":
                k = np.where(active.numpy(), (0.9 / p_min) ** 2 - z**2, 0.0)
        want = bisect_projection(np.log(p) - alpha * k / q.numpy(), 3.0, p_min, 1.0)
        np.testing.assert_allclose(b.probs.numpy(), want, rtol=0, atol=1e-9)
        assert not torch.allclose(a.probs, b.probs)


def test_update_rejects_bad_inclusion():
    bandit = LayerBandit(4, 0.5, p_min=0.01)
    active = torch.tensor([True, False, True, False])
    with pytest.raises(ValueError, match="4 entries"):
        bandit.update(active, torch.ones(4), inclusion=torch.ones(3))
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        bandit.update(active, torch.ones(4), inclusion=torch.tensor([0.0, 0.5, 0.5, 0.5]))
    # Inactive entries are ignored.
    assert bandit.update(active, torch.ones(4), inclusion=torch.tensor([0.5, 0.0, 1.0, 7.0]))


# --------------------------------------------------------------------------- the compute budget
COSTS = torch.tensor([11_720_448.0, 384.0, 147_456.0, 384.0, 589_824.0, 2.0, 147_456.0, 384.0])


@pytest.mark.parametrize("loss", ["shifted", "rank"])
def test_bandit_keeps_the_compute_budget_under_adversarial_updates(loss):
    bandit = LayerBandit(8, 0.2, 1e-3, alpha_p=0.5, loss=loss, costs=COSTS,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert torch.equal(bandit.probs, torch.full((8,), 0.2, dtype=torch.float64))
    rng = torch.Generator().manual_seed(1)
    budget = 0.2 * float(COSTS.sum())
    for _ in range(200):
        active = bandit.sample()
        norms = torch.rand(8, generator=rng, dtype=torch.float64) * 10 ** torch.randint(
            -3, 3, (8,), generator=rng
        )
        assert bandit.update(active, norms)
        p = bandit.probs
        assert abs(float((COSTS.double() * p).sum()) - budget) <= 1e-9 * budget
        assert bool((p >= 1e-3).all() and (p <= 1).all())


def test_the_compute_budget_keeps_a_favoured_embedding_at_its_share():
    # The embedding has the largest gradient norm every step: under the count budget the
    # bandit draws it almost always, under the compute budget it pays for it.
    norms = torch.tensor([8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])

    def final(costs):
        bandit = LayerBandit(8, 0.2, 1e-3, loss="rank", costs=costs,
                             generator=torch.Generator().manual_seed(0))  # fmt: skip
        for _ in range(300):
            bandit.update(bandit.sample(), norms)
        return bandit.probs

    count, compute = final(None), final(COSTS)
    assert count[0] > 0.8  # the count budget's bandit trains the embedding most steps
    active = float((COSTS.double() * compute).sum() / COSTS.sum())
    assert compute[0] < 0.25 and abs(active - 0.2) < 1e-9
    assert float((COSTS.double() * count).sum() / COSTS.sum()) > 0.75


def test_bandit_state_round_trips_and_refuses_another_budget():
    bandit = LayerBandit(8, 0.2, costs=COSTS, generator=torch.Generator().manual_seed(0))
    bandit.update(bandit.sample(), torch.arange(1.0, 9.0))
    state = bandit.state_dict()
    again = LayerBandit(8, 0.2, costs=COSTS)
    again.load_state_dict(state)
    assert torch.equal(again.probs, bandit.probs) and torch.equal(again.sample(), bandit.sample())
    with pytest.raises(ValueError, match="another budget"):
        LayerBandit(8, 0.2).load_state_dict(state)
    with pytest.raises(ValueError, match="another budget"):
        LayerBandit(8, 0.2, costs=COSTS * 2).load_state_dict(state)
    count_state = LayerBandit(8, 0.2).state_dict()
    with pytest.raises(ValueError, match="another budget"):
        LayerBandit(8, 0.2, costs=COSTS).load_state_dict(count_state)
    with pytest.raises(ValueError, match="positive finite"):
        LayerBandit(8, 0.2, costs=torch.zeros(8))


def test_under_a_compute_budget_the_bandit_tracks_norm_over_root_cost():
    # The variance sum(r**2 / p) under sum(c * p) = B is least at p ~ r / sqrt(c): with fixed
    # norms the rank bandit settles near that (within the floor and its step noise).
    costs = torch.tensor([400.0, 100.0, 25.0, 1.0, 1.0, 4.0], dtype=torch.float64)
    norms = torch.tensor([8.0, 2.0, 2.0, 0.5, 0.25, 1.0], dtype=torch.float64)
    bandit = LayerBandit(6, 0.3, 1e-3, alpha_p=0.05, loss="rank", costs=costs,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
    history = []
    for step in range(3000):
        bandit.update(bandit.sample(), norms)
        if step >= 1000:
            history.append(bandit.probs)
    mean = torch.stack(history).mean(0)
    target = norms / costs.sqrt()
    target = target * (0.3 * float(costs.sum()) / float((costs * target).sum()))
    assert bool(((mean - target).abs() / target < 0.35).all()), (mean, target)
    # The count budget's fixed point, p ~ r, would put the costly first layer far higher.
    assert mean[0] < 0.5 * float(norms[0] / norms.sum() * 6 * 0.3)


# --------------------------------------------------------------------------- the KL projection


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
    torch.testing.assert_close(q, u * 1.4 / u.sum(), rtol=0, atol=1e-14)  # float64 ulps
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
    # A budget a rounding error above N * upper is N * upper (a float sum of equal parts).
    over = kl_projection(torch.randn(5), 5.0 * (1 + REL_TOL / 2), 0.01, 1.0)
    assert torch.equal(over, torch.ones(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="infeasible"):
        kl_projection(torch.randn(5), 5.0 * (1 + 4 * REL_TOL), 0.01, 1.0)
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


# ------------------------------------------------------------------------- the weighted projection


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
