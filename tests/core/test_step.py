"""One training step (:mod:`lightning_slsam.core.step`): one gradient pass, SAM's two passes
and the hooks a method plugs into them, the plain step, single-step SAM, and the end of the
step (``commit``): the skip of a non-finite step and the inverse-inclusion update scaling."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp
from probes import (
    RHO,
    FixedSelection,
    Recorder,
    fixed_engine,
    gradients,
    loss_closure,
    setup_engine,
    shifted,
)
from tolerance import offset_atol
from torch import nn

from examples.methods import SLSAMAblationSpec
from lightning_slsam import SLS2SAM, make_callback, make_engine
from lightning_slsam.core.engine import SAMEngine
from lightning_slsam.core.partition import LayerFreezer, build_partition
from lightning_slsam.core.passes import LossOutput, PassRunner, read_output
from lightning_slsam.core.perturbation import SAMPerturbation
from lightning_slsam.core.step import (
    STEP_KINDS,
    LoopHooks,
    MethodParts,
    Passed,
    StepContext,
    commit,
    gradient_pass,
    plain_step,
    sam_step,
    single_step,
)
from lightning_slsam.methods.esam import SharpestSamples
from lightning_slsam.methods.looksam import Lookahead
from lightning_slsam.methods.registry import method_spec
from lightning_slsam.methods.s2sam import SingleStepParts
from lightning_slsam.methods.slsam import PRESETS
from lightning_slsam.parallel.ddp import average_grads, check_same_draw
from lightning_slsam.parallel.shards import WHOLE
from lightning_slsam.selection.bandit import LayerBandit
from lightning_slsam.selection.rules import UniformSelection

# -- the end of a step: a non-finite pass skips it ------------------------------------------


@pytest.mark.parametrize("bad_pass", [1, 2])
def test_non_finite_pass_skips_the_step_untouched(bad_pass):
    net = make_mlp()
    x, y = make_data(16).tensors
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    # One good step first so the optimizer has state to protect.
    partition = build_partition(net)
    bandit = LayerBandit(partition.num_layers, layer_ratio=0.5, alpha_p=0.1)
    engine = SAMEngine(partition, bandit, SAMPerturbation(0.05))
    engine.train_step(loss_closure(net, x, y), opt)
    weights = [p.detach().clone() for p in net.parameters()]
    opt_state = copy.deepcopy(opt.state_dict())
    probs = bandit.probs.clone()

    calls = [0]

    def poisoned(batch):  # one micro-batch's loss; the pass loop back-propagates it
        calls[0] += 1
        loss = F.cross_entropy(net(batch[0]), batch[1])
        if calls[0] == bad_pass:
            loss = loss * float("nan")
        return LossOutput(loss)

    stepped = []
    loop = LoopHooks(
        PassRunner([(x, y)], poisoned, torch.Tensor.backward),
        lambda: opt.zero_grad(set_to_none=True),
        stepped.append,
    )
    with pytest.warns(RuntimeWarning, match="skipped"):
        result = engine.step(loop)
    assert result.skipped and stepped == [True]
    assert f"{'first' if bad_pass == 1 else 'second'} pass" in result.skip_reason
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), weights))
    assert all(p.grad is None for p in net.parameters())
    assert torch.equal(bandit.probs, probs)
    torch.testing.assert_close(opt.state_dict(), opt_state, rtol=0, atol=0)
    assert engine.num_skipped == 1 and engine.num_steps == 2


# -- the step functions, each driven through the engine -------------------------------------


@pytest.mark.parametrize("method", ["s2sam", "sl_s2sam"])
def test_single_step_methods_perturb_along_each_layers_last_gradient(method):
    cb = make_callback(method, rho=RHO, seed=1)
    net, x, y, engine, opt = setup_engine(cb)
    last: dict[int, torch.Tensor] = {}
    for step in range(8):
        rec = Recorder(net, x, y)
        before = [p.detach().clone() for p in net.parameters()]
        result = engine.train_step(rec, opt)
        assert len(rec.passes) == 1 and result.num_backward == 1  # one pass per step
        offsets = [d - b for d, b in zip(rec.passes[0]["weights"], before)]
        if step == 0:
            assert result.kind == "plain" and bool(result.active_mask.all())
            assert all(float(o.abs().max()) == 0 for o in offsets)
        else:
            active = result.active_mask.tolist()
            directions = [last[i] for i in range(8) if active[i]]
            norm = torch.sqrt(sum(d.square().sum() for d in directions))
            for i in range(8):
                expected = RHO * last[i] / norm if active[i] else torch.zeros_like(offsets[i])
                torch.testing.assert_close(
                    offsets[i], expected, atol=offset_atol(before[i]), rtol=1e-4
                )
        for i, p in enumerate(net.parameters()):
            if p.grad is not None:
                last[i] = p.grad.clone()  # this step's gradient, at the perturbed point
    if method == "sl_s2sam":
        assert 0 < engine.frequencies()[0] < 1  # layers really were sampled after step 0


def test_sl_s2_sam_first_step_is_dense_and_does_not_teach_the_bandit():
    """The first step of SL-S2-SAM trains every layer without a draw: the bandit must not
    learn from it (its 1/p weights would treat an all-ones mask as a rare draw)."""
    cb = SLS2SAM(rho=RHO, layer_ratio=0.25, seed=3)
    net, x, y, engine, opt = setup_engine(cb)
    uniform = engine.selection.probs
    first = engine.train_step(Recorder(net, x, y), opt)
    assert first.kind == "plain" and bool(first.active_mask.all())
    torch.testing.assert_close(engine.selection.probs, uniform, rtol=0, atol=0)
    assert engine.selection.num_updates == 0 and not first.drawn
    second = engine.train_step(Recorder(net, x, y), opt)
    assert second.drawn and engine.selection.num_updates == 1
    assert not torch.allclose(engine.selection.probs, uniform)


class Always(MethodParts):
    """Every step of one kind."""

    def __init__(self, kind: str) -> None:
        self.name = kind

    def kind(self, step: int) -> str:
        return self.name


class Narrowing(FixedSelection):
    """A fixed draw that the second pass narrows to ``keep`` (as Top-SL-SAM's refine does),
    recording the norms it is given."""

    refines = True
    refine_uses_norms = True

    def __init__(self, mask: list[bool], keep: list[bool]) -> None:
        super().__init__(mask)
        self.keep = torch.tensor(keep)
        self.refined: list[tuple[torch.Tensor, torch.Tensor]] = []

    def refine(self, active, norms):
        self.refined.append((active.clone(), norms.clone()))
        return self.keep.clone()


class FirstHalf(MethodParts):
    """Chooses the first half of the batch for the second pass; records what it was given."""

    needs_per_sample = True

    def __init__(self) -> None:
        self.seen: list[tuple[float, list[int]]] = []

    def choose_samples(self, ctx, first, isolated):
        sizes = list(ctx.loop.forward_backward.batch_sizes)
        self.seen.append((float(first.loss), sizes))
        return [torch.arange(sizes[0] // 2)]


class FirstEntry(MethodParts):
    """Ascent masks that keep the first row (first entry of a vector) of every tensor."""

    def ascent_masks(self, ctx, params):
        return [torch.zeros_like(p).index_fill_(0, torch.tensor([0]), 1.0) for p in params]


class Storing(MethodParts):
    """Keeps what the SAM step hands over after its second pass (what LookSAM stores)."""

    keeps_first_grads = True

    def __init__(self) -> None:
        self.stored: list[tuple] = []

    def after_sam_step(self, ctx, pp, pg, params, grads):
        self.stored.append(
            (list(pp), [t.clone() for t in pg], list(params), [t.clone() for t in grads])
        )


def _engine_with(net, selection, **kwargs) -> SAMEngine:
    return SAMEngine(build_partition(net), selection, SAMPerturbation(RHO), **kwargs)


def _ascent(g, mask):
    """SAM's ascent on the tensors in ``mask``: rho * g / ||g|| over them, zero elsewhere."""
    norm = torch.sqrt(sum(gi.square().sum() for gi, on in zip(g, mask) if on))
    return [RHO * gi / norm if on else torch.zeros_like(gi) for gi, on in zip(g, mask)]


def test_plain_step_runs_one_pass_on_the_drawn_layers_and_steps_along_its_gradient():
    net = make_mlp()
    x, y = make_data(16).tensors
    mask = [True, False, False, True, False, False, True, True]
    engine = _engine_with(net, FixedSelection(mask), parts=Always("plain"))
    g = gradients(net, x, y)
    before = [p.detach().clone() for p in net.parameters()]
    rec = Recorder(net, x, y)
    result = engine.train_step(rec, torch.optim.SGD(net.parameters(), lr=0.1))
    assert result.kind == "plain" and result.num_backward == 1 and len(rec.passes) == 1
    assert rec.passes[0]["trainable"] == mask  # at the weights, unperturbed:
    assert all(torch.equal(w, b) for w, b in zip(rec.passes[0]["weights"], before))
    numel = [p.numel() for p in net.parameters()]
    assert result.pass_numel == [sum(n for n, on in zip(numel, mask) if on)]
    assert result.pass_numel == [8 * 16 + 16 + 16 * 3 + 3]  # 0.weight, 2.bias, 5.weight, 5.bias
    for p, b, gi, on in zip(net.parameters(), before, g, mask):
        expected = b - 0.1 * gi if on else b
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-7)
    # The selection learns the draw's first-pass norms, 0 for the layers left out.
    ((active, norms),) = engine.selection.updates
    want = [float(gi.norm()) if on else 0.0 for gi, on in zip(g, mask)]
    assert active.tolist() == mask
    torch.testing.assert_close(norms, torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=0)


def test_sam_step_hands_its_store_both_passes_gradients_of_the_perturbed_tensors():
    net = make_mlp()
    x, y = make_data(16).tensors
    mask = [True, True, False, False, True, True, False, False]
    parts = Storing()
    engine = _engine_with(net, FixedSelection(mask), parts=parts)
    g = gradients(net, x, y)
    g_at = gradients(shifted(net, _ascent(g, mask)), x, y)
    before = [p.detach().clone() for p in net.parameters()]
    result = engine.train_step(loss_closure(net, x, y), torch.optim.SGD(net.parameters(), lr=0.1))
    assert result.kind == "sam" and result.num_backward == 2
    ((pp, pg, params, grads),) = parts.stored
    every = list(net.parameters())
    active = [i for i, on in enumerate(mask) if on]
    assert [id(p) for p in pp] == [id(every[i]) for i in active] == [id(p) for p in params]
    for i, first, second in zip(active, pg, grads):
        torch.testing.assert_close(first, g[i], rtol=1e-5, atol=1e-7)  # at the weights
        torch.testing.assert_close(second, g_at[i], rtol=1e-4, atol=1e-7)  # at w + e
    # Restored exactly, then stepped along the second pass's gradient.
    for i, (p, b) in enumerate(zip(every, before)):
        expected = b - 0.1 * g_at[i] if mask[i] else b
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-7)


def test_sam_step_runs_its_second_pass_on_the_samples_its_choice_returns():
    net = make_mlp()
    x, y = make_data(16).tensors
    choice = FirstHalf()
    engine = _engine_with(net, FixedSelection([True] * 8), parts=choice)
    assert engine.needs_per_sample  # the choice reads per-sample losses
    g = gradients(net, x, y)
    g_half = gradients(shifted(net, _ascent(g, [True] * 8)), x[:8], y[:8])
    before = [p.detach().clone() for p in net.parameters()]
    loss = F.cross_entropy(net(x), y).item()
    rec = Recorder(net, x, y, per_sample=True)
    engine.train_step(rec, torch.optim.SGD(net.parameters(), lr=0.1), batch_size=16)
    first, second = rec.passes
    assert first["index"] is None and second["index"].tolist() == list(range(8))
    ((seen_loss, sizes),) = choice.seen
    # the mean of per-sample losses against the fused loss: float32 rounding apart
    assert sizes == [16] and seen_loss == pytest.approx(loss, rel=1e-5)
    for p, b, gi in zip(net.parameters(), before, g_half):
        torch.testing.assert_close(p.detach(), b - 0.1 * gi, rtol=1e-4, atol=1e-7)


def test_sam_step_perturbs_only_the_coordinates_its_ascent_masks_keep():
    net = make_mlp()
    x, y = make_data(16).tensors
    mask = [True, True, True, True, False, False, True, True]
    engine = _engine_with(net, FixedSelection(mask), parts=FirstEntry())
    g = gradients(net, x, y)
    before = [p.detach().clone() for p in net.parameters()]
    rec = Recorder(net, x, y)
    engine.train_step(rec, torch.optim.SGD(net.parameters(), lr=0.0))
    # The masks apply after the normalisation: rho * g * m / ||g||, the norm over all of g.
    ascent = _ascent(g, mask)
    for during, b, e, p in zip(rec.passes[1]["weights"], before, ascent, net.parameters()):
        keep = torch.zeros_like(p).index_fill_(0, torch.tensor([0]), 1.0)
        torch.testing.assert_close(during - b, e * keep, rtol=1e-4, atol=offset_atol(b))
    moved = [float((w - b).abs().sum()) > 0 for w, b in zip(rec.passes[1]["weights"], before)]
    assert moved == mask
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))  # restored, lr 0


def test_a_narrowing_selection_trains_its_refined_layers_and_learns_from_its_draw():
    net = make_mlp()
    x, y = make_data(16).tensors
    draw = [True, True, False, True, True, False, True, False]
    keep = [True, False, False, False, True, False, False, False]
    selection = Narrowing(draw, keep)
    engine = _engine_with(net, selection)
    g = gradients(net, x, y)
    before = [p.detach().clone() for p in net.parameters()]
    rec = Recorder(net, x, y)
    result = engine.train_step(rec, torch.optim.SGD(net.parameters(), lr=0.1))
    first, second = rec.passes
    assert first["trainable"] == draw and second["trainable"] == keep
    numel = [p.numel() for p in net.parameters()]
    assert result.pass_numel == [sum(n for n, on in zip(numel, m) if on) for m in (draw, keep)]
    assert result.active_mask.tolist() == keep and engine.counts.tolist() == [int(k) for k in keep]
    # refine() saw the first pass's norms; the ascent used the kept layers' gradients only.
    ((active, norms),) = selection.refined
    want = torch.tensor([float(gi.norm()) if on else 0.0 for gi, on in zip(g, draw)])
    assert active.tolist() == draw
    torch.testing.assert_close(norms, want.double(), rtol=1e-5, atol=0)
    for during, b, e in zip(second["weights"], before, _ascent(g, keep)):
        torch.testing.assert_close(during - b, e, rtol=1e-4, atol=offset_atol(b))
    changed = [not torch.equal(p, b) for p, b in zip(net.parameters(), before)]
    assert changed == keep
    ((learned, _),) = selection.updates
    assert learned.tolist() == draw  # the rule learns from the layers it drew


def test_single_step_state_is_saved_by_tensor_position_and_resumes_identically():
    x, y = make_data(16).tensors

    def start():
        net = make_mlp()
        return net, make_engine("s2sam", net, seed=0), torch.optim.SGD(net.parameters(), lr=0.1)

    def steps(net, engine, opt, n):
        return [engine.train_step(loss_closure(net, x, y), opt).kind for _ in range(n)]

    whole = start()
    assert not whole[1].last_grad  # no previous gradient yet: the first step is dense
    assert steps(*whole, 4) == ["plain", "single", "single", "single"]
    half = start()
    steps(*half, 2)
    state = half[1].state_dict()
    assert sorted(state["last_grad"]) == list(range(8))  # keyed by position, not id
    for i, p in enumerate(half[0].parameters()):
        assert torch.equal(state["last_grad"][i], p.grad)  # the last step's gradient
    net = copy.deepcopy(half[0])
    resumed = (net, make_engine("s2sam", net, seed=0), torch.optim.SGD(net.parameters(), lr=0.1))
    resumed[1].load_state_dict(state)
    assert resumed[1].last_grad  # the loaded gradients: the next step is a single-step one
    assert steps(*resumed, 2) == ["single", "single"]
    for a, b in zip(whole[0].parameters(), resumed[0].parameters()):
        assert torch.equal(a, b)


class Doubling(MethodParts):
    """Doubles the gradients of a ``"reuse"`` step (where LookSAM adds its component)."""

    def __init__(self, kind: str) -> None:
        self.name = kind
        self.adjusted = 0

    def kind(self, step: int) -> str:
        return self.name

    def adjust_grads(self, ctx, params, grads):
        self.adjusted += 1
        torch._foreach_mul_(grads, 2.0)


def test_what_each_kind_of_step_runs():
    assert STEP_KINDS == ("sam", "plain", "reuse", "single")
    base = MethodParts()  # SAM on every step, no hook, nothing per sample
    assert [base.kind(t) for t in range(3)] == ["sam"] * 3 and not base.needs_per_sample
    assert SharpestSamples(0.5).needs_per_sample and not base.keeps_first_grads
    assert [SingleStepParts().kind(t) for t in range(3)] == ["single"] * 3
    assert [Lookahead(3, 0.7, 1e-12).kind(t) for t in range(4)] == ["sam", "reuse", "reuse", "sam"]
    x, y = make_data(16).tensors
    g = gradients(make_mlp(), x, y)
    runs = {}
    for kind in ("sam", "plain", "reuse", "single"):
        net = make_mlp()
        parts = Doubling(kind)
        engine = _engine_with(net, FixedSelection([True] * 8), parts=parts)
        assert engine.needs_per_sample is False
        before = [p.detach().clone() for p in net.parameters()]
        result = engine.train_step(loss_closure(net, x, y), torch.optim.SGD(net.parameters(), 0.1))
        runs[kind] = (result.kind, result.num_backward, parts.adjusted)
        if kind in ("plain", "reuse"):  # one pass at the weights; reuse adjusts its gradient
            factor = 2.0 if kind == "reuse" else 1.0
            for p, b, gi in zip(net.parameters(), before, g):
                torch.testing.assert_close(p.detach(), b - 0.1 * factor * gi, rtol=1e-5, atol=1e-7)
    # Single-step SAM's first step has no previous gradient: a plain step, not a draw.
    assert runs == {"sam": ("sam", 2, 0), "plain": ("plain", 1, 0), "reuse": ("reuse", 1, 1),
                    "single": ("plain", 1, 0)}  # fmt: skip


# -- one gradient pass --------------------------------------------------------------------


def test_unused_sampled_tensor_counts_as_zero_norm():
    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(8, 3)
            self.unused = nn.Linear(8, 3)

        def forward(self, x):
            return self.used(x)

    net = WithUnused()
    x, y = make_data(16).tensors
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    unused_before = [p.detach().clone() for p in net.unused.parameters()]
    engine = fixed_engine(net, [True, False, True, True])
    result = engine.train_step(loss_closure(net, x, y), opt)
    assert not result.skipped
    ((_, norms),) = engine.selection.updates
    assert norms[2].item() == 0 and norms[3].item() == 0
    assert norms[0].item() > 0
    assert all(torch.equal(a, b) for a, b in zip(net.unused.parameters(), unused_before))

    # Only unused tensors active: the loss has no graph; the step is a no-op, not a crash.
    only_unused = fixed_engine(net, [False, False, True, False])
    before = [p.detach().clone() for p in net.parameters()]
    result = only_unused.train_step(loss_closure(net, x, y), opt)
    assert not result.skipped and result.num_backward == 2
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), before))


class HalfWithAnother:
    """An averager over this process and another whose gradients are ``other`` (``None``: it
    has none for that tensor): every averaged tensor becomes ``(mine + theirs) / 2``."""

    def __init__(self, other: list[torch.Tensor | None] | None = None) -> None:
        self.other = other
        self.sent: list[list[torch.Tensor]] = []

    def average_(self, tensors):
        self.sent.append([t.clone() for t in tensors])
        if self.other is None:  # the other process sent zeros
            for t in tensors:
                t.div_(2)
        else:
            *grads, present = tensors
            for t, o in zip(grads, self.other):
                t.add_(torch.zeros_like(t) if o is None else o).div_(2)
            present.add_(torch.tensor([o is not None for o in self.other], dtype=present.dtype))
            present.div_(2)
        return sum(t.numel() * t.element_size() for t in tensors)


class Gathered:
    """``gather`` as if the other process had drawn ``mask`` for a step of kind ``kind``."""

    def __init__(self, mask: list[bool], kind: str) -> None:
        self.other: list[torch.Tensor] = []
        check_same_draw(torch.tensor(mask), kind, STEP_KINDS, 0, self)  # its checksums, kept

    def gather(self, value):
        if not self.other:
            self.other.append(value)
        return torch.stack([value, self.other[0]])


def _loop(net, x, y, averager=None) -> LoopHooks:
    def loss(batch):
        return read_output(F.cross_entropy(net(batch[0]), batch[1]))

    passes = PassRunner([(x, y)], loss, torch.Tensor.backward)
    return LoopHooks(passes, lambda: net.zero_grad(set_to_none=True), lambda skip: None,
                averager=averager)  # fmt: skip


def _ctx(loop, freezer, step=0) -> StepContext:
    return StepContext(step, loop, freezer, None, WHOLE)


def test_a_pass_reports_each_tensors_and_each_layers_gradient_norm():
    net = make_mlp()
    x, y = make_data(16).tensors
    freezer = LayerFreezer(build_partition(net, layers="module"))  # 0, 2, 3, 5: weight + bias
    mask = torch.tensor([True, False, True, True])
    g = gradients(net, x, y)
    ctx = _ctx(_loop(net, x, y), freezer)
    out = gradient_pass(ctx, freezer.activate(mask), mask)
    params = list(net.parameters())
    used = [0, 1, 4, 5, 6, 7]  # the tensors of modules 0, 3 and 5
    assert [id(p) for p in out.params] == [id(params[i]) for i in used]
    assert all(gp is p.grad for gp, p in zip(out.grads, out.params))
    want = torch.tensor([float(g[i].norm()) for i in used])
    torch.testing.assert_close(out.norms, want, rtol=1e-5, atol=0)
    assert out.slots.tolist() == [0, 0, 2, 2, 3, 3]
    layers = [float(torch.sqrt(g[a].square().sum() + g[b].square().sum())) for a, b in
              ((0, 1), (4, 5), (6, 7))]  # fmt: skip
    torch.testing.assert_close(
        out.layer_norms, torch.tensor([layers[0], 0.0, layers[1], layers[2]]), rtol=1e-5, atol=0
    )
    loss = F.cross_entropy(net(x), y).item()
    assert float(out.output.loss) == pytest.approx(loss, rel=1e-6)
    assert out.numel == (8 * 16 + 16) + (16 * 16 + 16) + (16 * 3 + 3)
    assert out.allreduce_bytes == 0  # one process
    # The finiteness probe the step commits: the pass's loss and its norms' sum.
    assert float(out.norms.sum()) == pytest.approx(float(want.sum()), rel=1e-5)
    freezer.release()


def test_step_functions_return_what_they_computed_and_only_commit_updates():
    net = make_mlp()
    x, y = make_data(16).tensors
    freezer = LayerFreezer(build_partition(net, layers="module"))
    mask = torch.tensor([True, False, True, True])
    steps = []
    loop = _loop(net, x, y)
    loop.optimizer_step = steps.append
    before = [p.detach().clone() for p in net.parameters()]
    perturbation = SAMPerturbation(RHO)
    selection = UniformSelection(4, 0.75, torch.Generator().manual_seed(0))
    ctx = _ctx(loop, freezer)
    sam = sam_step(ctx, mask, selection=selection, perturbation=perturbation,
                   parts=MethodParts(), sync_first_pass=True)  # fmt: skip
    one = plain_step(ctx, mask, parts=MethodParts())
    p0 = dict(net.named_parameters())["0.weight"]
    single = single_step(
        ctx, mask, perturbation=perturbation, directions={id(p0): torch.ones_like(p0)}, keep=True,
    )  # fmt: skip
    # Nothing was committed: no optimizer step, the weights as they were (restored exactly)
    assert steps == [] and all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    assert isinstance(sam, Passed) and len(sam.first) == len(sam.second) == 2
    assert len(one.first) == 2 and one.second == [] and one.kept is None
    assert torch.equal(sam.update_mask, mask) and sam.layer_norms.shape == (4,)
    assert torch.equal(sam.active_mask, mask)
    numel = freezer.numel(mask)
    assert sam.pass_numel == [numel, numel] and one.pass_numel == single.pass_numel == [numel]
    assert sam.allreduce_bytes == one.allreduce_bytes == 0  # one process
    assert single.kept is not None and len(single.kept[0]) == len(single.kept[1]) > 0
    # commit makes the update the returned record describes, and returns the norms the
    # selection learns from
    skip_reason, sent, norms = commit(ctx, sam, None, update_scale=None, pool=perturbation.pool)
    assert skip_reason is None and sent == 0 and steps == [False]
    torch.testing.assert_close(norms, sam.layer_norms.double(), rtol=0, atol=0)
    freezer.release()


@pytest.mark.parametrize("sync", [True, False])
def test_across_processes_a_pass_averages_the_gradients_or_only_the_layer_norms(sync):
    net = make_mlp()
    x, y = make_data(16).tensors
    freezer = LayerFreezer(build_partition(net))
    mask = torch.tensor([True, True, False, False, False, False, True, True])
    g = gradients(net, x, y)
    averager = HalfWithAnother()
    out = gradient_pass(_ctx(_loop(net, x, y, averager), freezer), freezer.activate(mask), mask,
                        sync=sync)  # fmt: skip
    active = [0, 1, 6, 7]
    scale = 0.5 if sync else 1.0  # the other process sent zero gradients
    for grad, i in zip(out.grads, active):
        torch.testing.assert_close(grad, scale * g[i], rtol=1e-6, atol=0)
    want = torch.tensor([scale * float(g[i].norm()) for i in active])
    torch.testing.assert_close(out.norms, want, rtol=1e-5, atol=0)
    layer_norms = torch.tensor([float(g[i].norm()) if i in active else 0.0 for i in range(8)])
    torch.testing.assert_close(out.layer_norms, 0.5 * layer_norms, rtol=1e-5, atol=0)
    (sent,) = averager.sent  # one collective either way
    if sync:  # the four gradients and a presence flag per tensor
        assert [tuple(t.shape) for t in sent] == [(16, 8), (16,), (3, 16), (3,), (4,)]
        assert out.allreduce_bytes == 4 * (128 + 16 + 48 + 3 + 4)
    else:  # the per-layer norms alone
        assert [tuple(t.shape) for t in sent] == [(8,)]
        assert out.allreduce_bytes == 4 * 8
    freezer.release()


def test_average_grads_keeps_none_only_for_a_tensor_no_process_used():
    a, b, c = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    a.grad = torch.tensor([2.0, 4.0])  # used here; the other process has none for it
    # b: unused here, used by the other process; c: used by no process.
    other = HalfWithAnother([None, torch.tensor([6.0, 8.0]), None])
    sent = average_grads([a, b, c], other)
    assert a.grad.tolist() == [1.0, 2.0] and b.grad.tolist() == [3.0, 4.0] and c.grad is None
    assert sent == 4 * (2 + 2 + 2 + 3)  # three gradients (zeros for the missing) and the flags
    assert other.sent[0][-1].tolist() == [1.0, 0.0, 0.0]  # what this process said it used
    assert average_grads([], other) == 0


@pytest.mark.parametrize(
    ("other_mask", "other_kind", "counts"),
    [([True, False, True, True], "sam", None), ([True, True, True, False], "sam", [3, 3]),
     ([True, False, True, True], "plain", [3, 3]), ([True, False, False, False], "sam", [3, 1])],
)  # fmt: skip
def test_check_same_draw_passes_equal_draws_and_names_the_process_that_diverged(
    other_mask, other_kind, counts
):
    mask = torch.tensor([True, False, True, True])
    averager = Gathered(other_mask, other_kind)
    if counts is None:
        check_same_draw(mask, "sam", STEP_KINDS, 7, averager)
        return
    message = r"at step 7 process\(es\) \[1\] drew other layers .* per process: "
    with pytest.raises(RuntimeError, match=message + re.escape(str(counts))):
        check_same_draw(mask, "sam", STEP_KINDS, 7, averager)


# -- the update scaling of ``commit``: each drawn layer's update times min(1 / q, cap) ------


def _one_step(build, seed=0, lr=0.1, steps_before=0):
    """Weights change of one engine step on a 20-tensor MLP (SGD), the engine built by
    ``build(net)``, after ``steps_before`` steps; returns (deltas, result, inclusion used for
    the draw)."""
    torch.manual_seed(seed)
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
    engine = build(net)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    x, y = torch.randn(16, 4), torch.randint(0, 4, (16,))

    def loss():
        return F.cross_entropy(net(x), y)

    for _ in range(steps_before):
        engine.train_step(loss, opt)
    before = [p.detach().clone() for p in net.parameters()]
    selection = engine.selection
    result = engine.train_step(loss, opt)
    q = selection.inclusion()
    return [p.detach() - b for p, b in zip(net.parameters(), before)], result, q


def _spec(name, **options):
    return lambda net: method_spec(name, **options).build_engine(net)


def test_update_scaling_multiplies_each_drawn_layers_update_by_one_over_q():
    kwargs = dict(rho=RHO, layer_ratio=0.3, seed=4)
    plain, r0, _ = _one_step(_spec("slsam_paper", **kwargs))
    # The paper's method with the update factor capped at 1 / layer_ratio.
    scaled, r1, _ = _one_step(
        lambda net: SLSAMAblationSpec(
            preset="paper", max_update_scale=1 / 0.3, **kwargs
        ).build_engine(net)
    )
    assert torch.equal(r0.active_mask, r1.active_mask) and 0 < int(r0.active_mask.sum()) < 20
    # Both updates are read off float32 weights under 1 (Linear(4, 4) starts within 0.5, one
    # SGD step moves it little), and a / 0.3 carries 3.3x a's rounding: 32 ulps of 1.
    atol = offset_atol(torch.ones(()), ulps=32)
    for layer, (a, b) in enumerate(zip(plain, scaled)):  # one layer per tensor
        if r0.active_mask[layer]:
            torch.testing.assert_close(b, a / 0.3, rtol=1e-5, atol=atol)
        else:
            assert not a.any() and not b.any()


def test_update_scaling_uses_the_probability_of_the_draw_capped():
    """After the bandit has moved, one step's update of each drawn layer is SAM's SGD step
    times min(1 / p, cap), p the probabilities the step drew with."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
    spec = SLSAMAblationSpec(rho=RHO, layer_ratio=0.3, bandit_loss="rank", alpha_p=0.5,
                             max_update_scale=2.5, seed=4)  # fmt: skip
    engine = spec.build_engine(net)
    assert engine.update_scale == 2.5
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 4, (16,))

    def loss():
        return F.cross_entropy(net(x), y)

    for _ in range(8):
        engine.train_step(loss, opt)
    p = engine.selection.probs
    assert float(p.max() - p.min()) > 0.2  # the bandit has moved: factors differ by layer
    reference = copy.deepcopy(net)
    before = [t.detach().clone() for t in net.parameters()]
    mask = engine.train_step(loss, opt).active_mask
    # The same SAM step by hand on the drawn tensors: ascent along the first-pass
    # gradient (one global norm), SGD along the second-pass gradient.
    drawn = [t for t, on in zip(reference.parameters(), mask) if on]
    g = torch.autograd.grad(F.cross_entropy(reference(x), y), drawn)
    norm = torch.sqrt(sum(gi.square().sum() for gi in g))
    with torch.no_grad():
        for t, gi in zip(drawn, g):
            t.add_(RHO * gi / norm)
    g2 = iter(torch.autograd.grad(F.cross_entropy(reference(x), y), drawn))
    factors = (1.0 / p).clamp(max=2.5)
    for layer, (t, b) in enumerate(zip(net.parameters(), before)):
        delta = t.detach() - b
        if not mask[layer]:
            assert not delta.any()
            continue
        expected = -0.1 * next(g2) * float(factors[layer])
        torch.testing.assert_close(delta, expected, rtol=1e-4, atol=1e-6)
    used = set(factors[mask].tolist())
    assert len(used) > 1 and used - {2.5}  # per-layer factors, some below the cap


def _engine(selection, parts=None, update_scale=None, rho=RHO):
    def build(net):
        partition = build_partition(net)
        return SAMEngine(partition, selection(partition.num_layers), SAMPerturbation(rho),
                               parts, update_scale=update_scale)  # fmt: skip

    return build


def test_update_scaling_leaves_dense_steps_unscaled():
    # Every layer drawn with probability 1: factor 1.
    def every(n):
        return UniformSelection(n, 1.0, torch.Generator().manual_seed(1))

    plain, _, _ = _one_step(_engine(every))
    scaled, r1, q = _one_step(_engine(every, update_scale=4.0))
    assert bool(r1.active_mask.all()) and bool((q == 1).all())
    for a, b in zip(plain, scaled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    # Single-step SAM's dense first step is not a draw: not scaled; its second step is.
    def bandit(n):
        return LayerBandit(n, 0.25, generator=torch.Generator().manual_seed(1))

    plain, _, _ = _one_step(_engine(bandit, SingleStepParts()))
    scaled, r1, _ = _one_step(_engine(bandit, SingleStepParts(), update_scale=4.0))
    assert not r1.drawn and r1.kind == "plain" and bool(r1.active_mask.all())
    for a, b in zip(plain, scaled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    plain, _, _ = _one_step(_engine(bandit, SingleStepParts()), steps_before=1)
    scaled, r2, _ = _one_step(_engine(bandit, SingleStepParts(), update_scale=4.0), steps_before=1)
    # The bandit did not learn from the dense step: it drew with p = 0.25, factor 4.
    assert r2.drawn and r2.kind == "single"
    assert 0 < int(r2.active_mask.sum()) < 20
    for a, b, on in zip(plain, scaled, r2.active_mask.tolist()):
        torch.testing.assert_close(b, 4.0 * a if on else a, rtol=1e-5, atol=1e-7)


def test_scaled_updates_move_each_layer_as_far_as_dense_training_in_expectation():
    """A linear loss has a constant gradient: dense SGD moves every weight by lr * g per
    step. With scaling, sparse steps move each layer that far on average; without, by q."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(3, 3, bias=False) for _ in range(8)])
    c = [torch.randn_like(p) for p in net.parameters()]

    def linear_loss():
        return (
            sum((p * ci).sum() for p, ci in zip(net.parameters(), c))
            + 0 * net(torch.zeros(1, 3)).sum()
        )

    def travel(scale):
        start = [p.detach().clone() for p in net.parameters()]
        # Random-SL-SAM's uniform draw, the update factor capped at 1 / layer_ratio.
        engine = _engine(
            lambda n: UniformSelection(n, 0.25, torch.Generator().manual_seed(7)),
            update_scale=4.0 if scale else None,
            rho=1e-6,
        )(net)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        for _ in range(400):
            engine.train_step(linear_loss, opt)
        moved = [(s - p.detach()) / (1e-3 * 400 * ci) for p, s, ci in zip(net.parameters(),
                                                                         start, c)]  # fmt: skip
        with torch.no_grad():
            for p, s in zip(net.parameters(), start):
                p.copy_(s)
        return torch.stack([m.mean() for m in moved])

    unscaled, scaled = travel(False), travel(True)
    assert abs(float(unscaled.mean()) - 0.25) < 0.05  # a quarter of the dense distance
    assert abs(float(scaled.mean()) - 1.0) < 0.12  # the dense distance, in expectation


def test_update_scaling_options_are_validated_and_in_the_presets():
    assert PRESETS["default"]["max_update_scale"] == 3.0
    assert PRESETS["paper"]["max_update_scale"] == 1.0  # 1: no scaling
    assert method_spec("slsam_paper").update_scale is None
    assert method_spec("slsam").update_scale == 3.0  # the default preset's cap
    ablation = SLSAMAblationSpec(preset="paper", max_update_scale=1 / 0.5)
    assert ablation.update_scale == 2.0
    assert SLSAMAblationSpec(max_update_scale=5).update_scale == 5.0  # explicit wins
    assert method_spec("random_slsam", preset="default").update_scale == 3.0
    assert method_spec("random_slsam").update_scale is None
    assert make_engine("slsam", make_mlp(), seed=0).update_scale == 3.0
    for bad in (0.5, float("inf"), "3"):
        with pytest.raises(ValueError, match="max_update_scale"):
            SLSAMAblationSpec(max_update_scale=bad)
    with pytest.raises(TypeError, match="preset"):  # the preset decides it
        method_spec("slsam", max_update_scale=5)
