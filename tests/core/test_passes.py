"""The one pass loop (:mod:`lightning_slsam.core.passes`): each pass over a step's
micro-batches -- the accumulation scale, sample subsets, per-sample losses, the loss scale,
a backward only where the loss reaches a trainable tensor -- the plain loop's passes through
``SAMEngine.train_step``, and the batch helpers every front-end shares."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp
from probes import Recorder, net_at
from torch import nn

from lightning_slsam import make_engine
from lightning_slsam.core.passes import (
    PER_SAMPLE_NEEDED,
    LossOutput,
    PassOutput,
    PassRunner,
    first_tensor,
    read_output,
    skip_with_scaler,
    split_per_sample,
    subset_batch,
)


class Model:
    """``loss(batch)`` of a one-weight model, ``w * batch`` per sample, recording each call
    (the batch it got, whether gradients were on, the pass number) and each backward."""

    def __init__(self, per_sample: bool = True) -> None:
        self.w = nn.Parameter(torch.tensor(2.0))
        self.per_sample = per_sample
        self.calls: list[tuple[list[float], bool, int]] = []
        self.backwards: list[float] = []
        self.passes: PassRunner | None = None

    def loss(self, batch):
        number = self.passes.number if self.passes is not None else -1
        self.calls.append((batch.tolist(), torch.is_grad_enabled(), number))
        losses = self.w * batch
        return read_output(losses if self.per_sample else losses.mean())

    def backward(self, loss):
        self.backwards.append(float(loss.detach()))
        loss.backward()

    def make(self, micro_batches, **options) -> PassRunner:
        self.passes = PassRunner(micro_batches, self.loss, self.backward, **options)
        return self.passes


MICRO = [torch.tensor([1.0, 3.0]), torch.tensor([5.0]), torch.tensor([2.0, 4.0, 6.0])]


def _subset(batch, index):
    return batch[index]


# -- one pass ----------------------------------------------------------------------------------


def test_a_pass_sums_the_scaled_micro_batch_losses_and_accumulates_their_gradients():
    model = Model()
    passes = model.make(MICRO, scale=1 / 3)
    out = passes()
    assert isinstance(out, PassOutput)
    # Each micro-batch's loss is the mean of its per-sample losses, times 1/3.
    means = [2.0 * 2.0, 2.0 * 5.0, 2.0 * 4.0]
    assert float(out.loss) == pytest.approx(sum(means) / 3)
    assert model.backwards == pytest.approx([m / 3 for m in means])  # one backward each
    assert float(model.w.grad) == pytest.approx((2.0 + 5.0 + 4.0) / 3)  # accumulated
    # The per-sample losses are the micro-batches' own, unscaled and detached.
    assert [t.tolist() for t in out.per_sample] == [[2.0, 6.0], [10.0], [4.0, 8.0, 12.0]]
    assert not out.loss.requires_grad and not any(t.requires_grad for t in out.per_sample)
    assert [c[1] for c in model.calls] == [True] * 3  # with gradients


def test_a_scalar_loss_has_no_per_sample_losses_and_is_refused_where_they_are_needed():
    model = Model(per_sample=False)
    out = model.make(MICRO[:2])()
    assert out.per_sample == [None, None] and float(out.loss) == pytest.approx(4.0 + 10.0)

    class Refused(Exception):
        pass

    model = Model(per_sample=False)
    passes = model.make(MICRO[:2], needs_per_sample=True, error=Refused)
    with pytest.raises(Refused, match="needs per-sample losses"):
        passes()
    # Raised at the first micro-batch, before its backward pass: nothing has changed.
    assert len(model.calls) == 1 and model.backwards == [] and model.w.grad is None
    assert passes.number == 0
    assert "data_ratio=1.0" in PER_SAMPLE_NEEDED


def test_subsets_restrict_each_micro_batch_and_an_empty_one_is_skipped():
    model = Model()
    passes = model.make(MICRO, scale=0.5, subset=_subset)
    subsets = [torch.tensor([1]), torch.tensor([], dtype=torch.long), torch.tensor([2, 0])]
    out = passes(subsets=subsets)
    # The loss ran on [3] and [6, 2] only; the empty index skipped micro-batch 1 entirely.
    assert [c[0] for c in model.calls] == [[3.0], [6.0, 2.0]]
    assert out.per_sample[1] is None
    assert [t.tolist() for t in (out.per_sample[0], out.per_sample[2])] == [[6.0], [12.0, 4.0]]
    assert float(out.loss) == pytest.approx(0.5 * 6.0 + 0.5 * 8.0)
    assert float(model.w.grad) == pytest.approx(0.5 * 3.0 + 0.5 * 4.0)
    assert len(model.backwards) == 2


def test_a_pass_whose_micro_batches_are_all_skipped_returns_a_zero_loss():
    model = Model()
    passes = model.make(MICRO[:2], subset=_subset)
    empty = torch.tensor([], dtype=torch.long)
    out = passes(subsets=[empty, empty])
    assert out.per_sample == [None, None]
    assert torch.equal(out.loss, torch.zeros(())) and out.loss.shape == ()
    assert model.calls == [] and model.backwards == [] and model.w.grad is None


def test_a_pass_without_backward_runs_the_forwards_only_without_gradients():
    model = Model()
    passes = model.make(MICRO[:2], scale=0.5)
    out = passes(backward=False)
    assert [c[1] for c in model.calls] == [False, False]  # no graph was built
    assert model.backwards == [] and model.w.grad is None
    assert float(out.loss) == pytest.approx(0.5 * (4.0 + 10.0))
    assert [t.tolist() for t in out.per_sample] == [[2.0, 6.0], [10.0]]
    # Inside torch.no_grad() a pass computes no gradient either.
    with torch.no_grad():
        passes()
    assert [c[1] for c in model.calls[2:]] == [False, False] and model.backwards == []


def test_backward_runs_only_when_the_loss_reaches_a_trainable_tensor():
    model = Model()
    model.w.requires_grad_(False)  # a frozen model: the loss has no graph
    out = model.make(MICRO[:2])()
    assert model.backwards == [] and model.w.grad is None
    assert float(out.loss) == pytest.approx(4.0 + 10.0)  # the loss is still reported
    # Of two micro-batches, only the one whose loss reaches a trainable tensor back-propagates.
    trainable = nn.Parameter(torch.tensor(1.0))
    backwards = []

    def loss(batch):
        return LossOutput(trainable * batch if float(batch) == 1.0 else batch * 3.0)

    def backward(value):
        backwards.append(float(value.detach()))
        value.backward()

    out = PassRunner([torch.tensor(1.0), torch.tensor(2.0)], loss, backward)()
    assert backwards == [1.0] and float(trainable.grad) == 1.0
    assert float(out.loss) == 1.0 + 6.0


def test_the_loss_scale_multiplies_every_loss_before_its_backward():
    model = Model()
    passes = model.make(MICRO[:2], scale=0.5, subset=_subset)
    out = passes(subsets=[torch.tensor([0]), torch.tensor([0])], loss_scale=0.0)
    assert model.backwards == [0.0, 0.0] and float(model.w.grad) == 0.0
    assert float(out.loss) == 0.0
    model.w.grad = None
    passes(loss_scale=4.0)
    assert model.backwards == [0.0, 0.0, 0.5 * 4.0 * 4.0, 0.5 * 4.0 * 10.0]
    assert float(model.w.grad) == pytest.approx(0.5 * 4.0 * (2.0 + 5.0))
    # The per-sample losses are not scaled.
    model.w.grad = None
    assert [t.tolist() for t in passes(loss_scale=3.0).per_sample] == [[2.0, 6.0], [10.0]]


def test_the_pass_number_and_the_batch_sizes():
    model = Model()
    passes = model.make(MICRO[:2], size=len, subset=_subset)
    assert passes.number == 0 and passes.batch_sizes == [2, 1]
    passes()  # the first pass with gradients over the whole batch
    passes(backward=False)  # an extra forward
    passes(subsets=[torch.tensor([0]), torch.tensor([0])])  # a subset
    passes()  # another full pass (at perturbed weights)
    assert [c[2] for c in model.calls] == [1, 1, 2, 2, 2, 2, 2, 2]
    assert passes.number == 0  # between passes
    # Without its own: each micro-batch's first tensor's first dimension, cut along it
    default = Model().make(MICRO)
    assert default.batch_sizes == [2, 1, 3]
    assert default.subset(MICRO[2], torch.tensor([0, 2])).tolist() == [2.0, 6.0]


def test_split_per_sample_averages_a_vector_and_passes_anything_else_through():
    losses = torch.tensor([1.0, 3.0], requires_grad=True)
    loss, per_sample = split_per_sample(losses)
    assert float(loss.detach()) == 2.0 and loss.requires_grad
    assert per_sample.tolist() == [1.0, 3.0] and not per_sample.requires_grad
    scalar = torch.tensor(2.0)
    assert split_per_sample(scalar) == (scalar, None)
    matrix = torch.ones(2, 2)  # any other tensor is the loss itself
    assert split_per_sample(matrix)[0] is matrix and split_per_sample(matrix)[1] is None


# -- the plain loop's passes (SAMEngine.train_step) --------------------------------------


def test_the_plain_loop_runs_each_pass_through_compute_loss_with_the_chosen_samples():
    net = make_mlp()
    x, y = make_data(16).tensors
    engine = make_engine("esam", net, seed=0)  # data_ratio 0.5: the second pass on 8 samples
    rec = Recorder(net, x, y, per_sample=True)
    result = engine.train_step(rec, torch.optim.SGD(net.parameters(), lr=0.1), batch_size=16)
    first, extra, second = rec.passes
    # The first pass, an extra forward without gradients (the perturbed losses), the second
    # pass on the chosen sample indices, as compute_loss(index).
    assert [p["grad_enabled"] for p in rec.passes] == [True, False, True]
    assert first["index"] is None and extra["index"] is None
    index = second["index"]
    assert len(index) == 8 and index.tolist() == sorted(set(index.tolist()))
    # ESAM's choice: the samples whose loss rose most under the perturbation.
    with torch.no_grad():
        before = F.cross_entropy(net_at(first["weights"], net)(x), y, reduction="none")
        after = F.cross_entropy(net_at(extra["weights"], net)(x), y, reduction="none")
    assert set(index.tolist()) == set((after - before).topk(8).indices.tolist())
    assert result.num_backward == 2 and float(result.loss) == pytest.approx(float(before.mean()))


def test_the_plain_loop_refuses_a_scalar_loss_where_per_sample_losses_are_needed():
    net = make_mlp()
    x, y = make_data(16).tensors
    engine = make_engine("esam", net, seed=0)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match="needs per-sample losses"):
        engine.train_step(lambda: F.cross_entropy(net(x), y), torch.optim.SGD(net.parameters()))
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    assert all(p.grad is None and p.requires_grad for p in net.parameters())
    assert engine.num_steps == 0


def test_the_plain_loop_asks_for_the_batch_size_where_a_method_addresses_samples():
    net = make_mlp()
    x, y = make_data(16).tensors
    engine = make_engine("ssamf", net, seed=0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match=r"needs the batch size: pass it \(train_step"):
        engine.train_step(Recorder(net, x, y, per_sample=True), opt)
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    assert all(p.requires_grad for p in net.parameters())  # released
    rec = Recorder(net, x, y, per_sample=True)
    result = engine.train_step(rec, opt, batch_size=16)
    # SSAM-F's Fisher: one backward per sample (compute_loss(index) of one index), then SAM.
    singles = [p["index"].tolist() for p in rec.passes if p["index"] is not None]
    assert singles == [[i] for i in range(result.extra_backward)] and singles
    assert not result.skipped and result.num_backward == 2 + result.extra_backward


# -- the helpers every front-end shares -------------------------------------------------------


def test_first_tensor_finds_the_first_tensor_inside_containers():
    a, b = torch.ones(2), torch.zeros(3)
    assert first_tensor(a) is a
    assert first_tensor({"n": 7, "inputs": [None, (a, b)], "labels": b}) is a
    assert first_tensor(("text", {"x": b}, a)) is b
    assert first_tensor(OrderedDict(z=3, y=[b])) is b
    assert first_tensor({"n": 1, "s": ["a", ("b",)]}) is None
    assert first_tensor(7) is None and first_tensor("abc") is None


Pair = namedtuple("Pair", ["x", "y"])


def test_subset_batch_indexes_every_tensor_of_the_batch_size_and_keeps_the_rest():
    x = torch.arange(12).view(4, 3)
    y = torch.tensor([10, 11, 12, 13])
    other = torch.arange(5)  # another first dimension: kept whole
    index = torch.tensor([3, 1])
    batch = {"x": x, "pair": Pair(y, [y, "id"]), "t": (other, torch.tensor(1.0)), "n": 4}
    sub = subset_batch(batch, index, 4)
    assert sub["x"].tolist() == [[9, 10, 11], [3, 4, 5]]
    assert isinstance(sub["pair"], Pair) and sub["pair"].x.tolist() == [13, 11]
    assert sub["pair"].y[0].tolist() == [13, 11] and sub["pair"].y[1] == "id"
    assert isinstance(sub["t"], tuple) and sub["t"][0] is other and float(sub["t"][1]) == 1.0
    assert sub["n"] == 4
    assert subset_batch(y, index, 3) is y  # not the batch size: untouched
    # A mapping type that cannot be built from a dict comes back as a dict.
    counts = defaultdict(int, {"y": y})
    assert type(subset_batch(counts, index, 4)) is dict
    assert type(subset_batch(OrderedDict(y=y), index, 4)) is OrderedDict


def test_skip_with_scaler_makes_the_gradient_scaler_skip_and_back_off():
    w = nn.Parameter(torch.ones(3))
    v = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w, v], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.tensor(1.0))  # the scaler in use, as after a scaled backward
    skip_with_scaler(opt)
    assert bool(torch.isinf(w.grad).all()) and v.grad is None
    scaler.step(opt)
    scaler.update()
    assert torch.equal(w, torch.ones(3)) and torch.equal(v, torch.ones(2))  # not stepped
    assert scaler.get_scale() == 4.0  # backed off
