"""The kinds of training step (:mod:`lightning_slsam.core.step_kinds`): SAM's two passes and
the parts a method plugs into them, the plain step, and single-step SAM."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp
from probes import RHO, FixedSelection, Recorder, gradients, loss_closure, setup_engine, shifted

from lightning_slsam import (
    SLS2SAM,
    SAMPerturbation,
    SparseSAMEngine,
    build_partition,
    make_callback,
    make_engine,
)
from lightning_slsam.core.schedules import Schedule
from lightning_slsam.core.step_kinds import PlainStep, SAMStep, SingleStep, StepKind


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
                torch.testing.assert_close(offsets[i], expected, atol=1e-7, rtol=1e-4)
        for i, p in enumerate(net.parameters()):
            if p.grad is not None:
                last[i] = p.grad.clone()  # this step's gradient, at the perturbed point
    if method == "sl_s2sam":
        assert 0 < engine.frequencies()[0] < 1  # layers really were sampled after step 0


def test_sl_s2_sam_first_step_is_dense_and_does_not_teach_the_bandit():
    """The first step of SL-S2-SAM trains every layer without a draw: the bandit must not
    learn from it (its 1/p weights would treat an all-ones mask as a rare draw)."""
    cb = SLS2SAM(rho=RHO, layer_ratio=0.25, alpha_p=0.5, seed=3)
    net, x, y, engine, opt = setup_engine(cb)
    uniform = engine.selection.probs
    first = engine.train_step(Recorder(net, x, y), opt)
    assert first.kind == "plain" and bool(first.active_mask.all())
    torch.testing.assert_close(engine.selection.probs, uniform, rtol=0, atol=0)
    assert engine.selection.num_updates == 0 and not first.drawn
    second = engine.train_step(Recorder(net, x, y), opt)
    assert second.drawn and engine.selection.num_updates == 1
    assert not torch.allclose(engine.selection.probs, uniform)


# -- each kind, driven through the engine on a fixed draw ---------------------------------------


class Always(Schedule):
    """Every step of one kind."""

    def __init__(self, kind: str) -> None:
        self.name = kind

    def kind(self, step: int) -> str:
        return self.name


class Narrowing(FixedSelection):
    """A fixed draw that the second pass narrows to ``keep`` (as Top-SL-SAM's refine does),
    recording the norms it is given."""

    refine_uses_norms = True

    def __init__(self, mask: list[bool], keep: list[bool]) -> None:
        super().__init__(mask)
        self.keep = torch.tensor(keep)
        self.refined: list[tuple[torch.Tensor, torch.Tensor]] = []

    def refine(self, active, norms):
        self.refined.append((active.clone(), norms.clone()))
        return self.keep.clone()


class FirstHalf:
    """Chooses the first half of the batch for the second pass; records what it was given."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, list[int]]] = []

    def select(self, first, forward_backward):
        sizes = list(forward_backward.batch_sizes)
        self.seen.append((float(first.loss), sizes))
        return [torch.arange(sizes[0] // 2)]


class FirstEntry:
    """Ascent masks that keep the first row (first entry of a vector) of every tensor."""

    def masks_for(self, params):
        return [torch.zeros_like(p).index_fill_(0, torch.tensor([0]), 1.0) for p in params]


def _engine_with(net, selection, **kwargs) -> SparseSAMEngine:
    return SparseSAMEngine(build_partition(net), selection, SAMPerturbation(RHO), **kwargs)


def _ascent(g, mask):
    """SAM's ascent on the tensors in ``mask``: rho * g / ||g|| over them, zero elsewhere."""
    norm = torch.sqrt(sum(gi.square().sum() for gi, on in zip(g, mask) if on))
    return [RHO * gi / norm if on else torch.zeros_like(gi) for gi, on in zip(g, mask)]


def test_plain_step_runs_one_pass_on_the_drawn_layers_and_steps_along_its_gradient():
    net = make_mlp()
    x, y = make_data(16).tensors
    mask = [True, False, False, True, False, False, True, True]
    engine = _engine_with(net, FixedSelection(mask), schedule=Always("plain"))
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
    stored = []

    def store(pp, pg, params, grads):  # what LookSAM keeps
        stored.append((list(pp), [t.clone() for t in pg], list(params), [t.clone() for t in grads]))

    engine = _engine_with(
        net, FixedSelection(mask), kinds={"sam": SAMStep(after_second_pass=store)}
    )
    g = gradients(net, x, y)
    g_at = gradients(shifted(net, _ascent(g, mask)), x, y)
    before = [p.detach().clone() for p in net.parameters()]
    result = engine.train_step(loss_closure(net, x, y), torch.optim.SGD(net.parameters(), lr=0.1))
    assert result.kind == "sam" and result.num_backward == 2
    ((pp, pg, params, grads),) = stored
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
    engine = _engine_with(net, FixedSelection([True] * 8), kinds={"sam": SAMStep(samples=choice)})
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
    assert sizes == [16] and seen_loss == pytest.approx(loss, rel=1e-6)
    for p, b, gi in zip(net.parameters(), before, g_half):
        torch.testing.assert_close(p.detach(), b - 0.1 * gi, rtol=1e-4, atol=1e-7)


def test_sam_step_perturbs_only_the_coordinates_its_ascent_masks_keep():
    net = make_mlp()
    x, y = make_data(16).tensors
    mask = [True, True, True, True, False, False, True, True]
    engine = _engine_with(
        net, FixedSelection(mask), kinds={"sam": SAMStep(ascent_masks=FirstEntry())}
    )
    g = gradients(net, x, y)
    before = [p.detach().clone() for p in net.parameters()]
    rec = Recorder(net, x, y)
    engine.train_step(rec, torch.optim.SGD(net.parameters(), lr=0.0))
    # The masks apply after the normalisation: rho * g * m / ||g||, the norm over all of g.
    ascent = _ascent(g, mask)
    for during, b, e, p in zip(rec.passes[1]["weights"], before, ascent, net.parameters()):
        keep = torch.zeros_like(p).index_fill_(0, torch.tensor([0]), 1.0)
        torch.testing.assert_close(during - b, e * keep, rtol=1e-4, atol=1e-8)
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
        torch.testing.assert_close(during - b, e, rtol=1e-4, atol=1e-8)
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
    assert whole[1].kinds["single"].needs_every_layer()  # no previous gradient yet
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
    assert not resumed[1].kinds["single"].needs_every_layer()
    assert steps(*resumed, 2) == ["single", "single"]
    for a, b in zip(whole[0].parameters(), resumed[0].parameters()):
        assert torch.equal(a, b)


def test_what_each_kind_tells_the_engine():
    assert (PlainStep.one_pass, SingleStep.one_pass, SAMStep.one_pass) == (True, True, False)
    assert not SAMStep().needs_per_sample and SAMStep(samples=FirstHalf()).needs_per_sample
    single = SingleStep()
    assert single.needs_every_layer() and not single.ready
    assert not PlainStep().needs_every_layer() and not SAMStep().needs_every_layer()
    with pytest.raises(NotImplementedError):
        StepKind().run(None, None)  # type: ignore[arg-type]
