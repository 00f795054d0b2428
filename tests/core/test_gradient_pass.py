"""One gradient pass (:mod:`lightning_slsam.core.gradient_pass`): what it computes on the
active tensors, its norms, its averaging across processes and the same-draw check."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp
from probes import fixed_engine, gradients, loss_closure
from torch import nn

from lightning_slsam import build_partition
from lightning_slsam.core.contract import StepCall, StepContext, StepResult
from lightning_slsam.core.freezing import LayerFreezer
from lightning_slsam.core.gradient_pass import average_grads, check_same_draw, gradient_pass


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


# -- one pass on a freezer, directly ------------------------------------------------------------


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
        check_same_draw(torch.tensor(mask), kind, 0, self)  # its checksums, kept below

    def gather(self, value):
        if not self.other:
            self.other.append(value)
        return torch.stack([value, self.other[0]])


def _call(net, x, y, mask, averager=None) -> StepCall:
    def forward_backward():
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        return loss.detach()

    result = StepResult(None, torch.tensor(mask), sum(p.numel() for p in net.parameters()), "sam")
    return StepCall(
        result, forward_backward, lambda: net.zero_grad(set_to_none=True), lambda skip: None,
        StepContext(averager=averager),
    )  # fmt: skip


def test_a_pass_reports_each_tensors_and_each_layers_gradient_norm():
    net = make_mlp()
    x, y = make_data(16).tensors
    freezer = LayerFreezer(build_partition(net, layers="module"))  # 0, 2, 3, 5: weight + bias
    mask = torch.tensor([True, False, True, True])
    g = gradients(net, x, y)
    call = _call(net, x, y, mask.tolist())
    out = gradient_pass(freezer, call, freezer.activate(mask), mask)
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
    assert float(call.result.loss) == pytest.approx(loss, rel=1e-6)
    assert call.result.pass_numel == [(8 * 16 + 16) + (16 * 16 + 16) + (16 * 3 + 3)]
    first, probe = out.scalars()
    assert first is out.output.loss and float(probe) == pytest.approx(float(want.sum()), rel=1e-5)
    # A second pass adds its size but keeps the step's loss: the first pass's.
    with torch.no_grad():
        net[0].weight.add_(1.0)
    again = gradient_pass(freezer, call, freezer.activate(mask), mask)
    assert float(again.output.loss) != pytest.approx(loss, rel=1e-3)
    assert call.result.loss is out.output.loss and len(call.result.pass_numel) == 2
    freezer.release()


@pytest.mark.parametrize("sync", [True, False])
def test_across_processes_a_pass_averages_the_gradients_or_only_the_layer_norms(sync):
    net = make_mlp()
    x, y = make_data(16).tensors
    freezer = LayerFreezer(build_partition(net))
    mask = torch.tensor([True, True, False, False, False, False, True, True])
    g = gradients(net, x, y)
    averager = HalfWithAnother()
    call = _call(net, x, y, mask.tolist(), averager)
    out = gradient_pass(freezer, call, freezer.activate(mask), mask, sync=sync)
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
        assert call.result.allreduce_bytes == 4 * (128 + 16 + 48 + 3 + 4)
    else:  # the per-layer norms alone
        assert [tuple(t.shape) for t in sent] == [(8,)]
        assert call.result.allreduce_bytes == 4 * 8
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
        check_same_draw(mask, "sam", 7, averager)
        return
    message = r"at step 7 process\(es\) \[1\] drew other layers .* per process: "
    with pytest.raises(RuntimeError, match=message + re.escape(str(counts))):
        check_same_draw(mask, "sam", 7, averager)
