"""Per-step freezing (:mod:`lightning_slsam.core.freezing`): exactly the active layers are
trainable during a step, and every tensor again after it."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import LitModel, loader, make_data, make_mlp, trainer
from torch import nn

from lightning_slsam import SparseLayerSAM, build_partition
from lightning_slsam.core.freezing import LayerFreezer, by_position


def test_frozen_tensors_keep_no_grad_no_state_and_no_decay():
    model = LitModel(make_mlp(), lr=1e-2, weight_decay=0.5)
    seen = {}

    class Probe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            mask = cb.engine.last_result  # not yet set for this step
            seen["grads"] = {n: p.grad is not None for n, p in pl_module.named_parameters()}
            seen["requires"] = {n: p.requires_grad for n, p in pl_module.named_parameters()}
            del mask

    cb = SparseLayerSAM(rho=0.05, layer_ratio=0.3, seed=1)
    trainer(callbacks=[cb, Probe()], max_steps=1).fit(model, loader(make_data(32), 16))
    mask = cb.active_mask.tolist()
    names = cb.layer_names
    assert [seen["grads"][n] for n in names] == mask
    assert [seen["requires"][n] for n in names] == mask  # frozen during the step
    # Outside the step every tensor is trainable again.
    assert all(p.requires_grad for p in model.parameters())
    opt = model.trainer.optimizers[0]
    params = dict(model.named_parameters())
    for name, active in zip(names, mask):
        state = opt.state.get(params[name], {})
        assert (len(state) > 0) == active


# -- the freezer, directly ----------------------------------------------------------------------


def _freezer(net=None, **options) -> tuple[nn.Module, LayerFreezer]:
    net = net if net is not None else make_mlp()
    return net, LayerFreezer(build_partition(net, **options))


def test_activate_trains_exactly_the_mask_and_the_always_active_and_release_restores_all():
    net = make_mlp()
    net[3].bias.requires_grad_(False)  # the user's own frozen tensor: never ours
    net, freezer = _freezer(net, always_active=[r"^5\."], always_frozen=[r"^0\.bias$"])
    names = [n for n, _ in net.named_parameters()]
    assert freezer.partition.names == ["0.weight", "2.weight", "2.bias", "3.weight"]
    active = freezer.activate(torch.tensor([False, True, False, True]))
    params = dict(net.named_parameters())
    # Always-active tensors first, then the drawn layers in model order.
    assert [id(p) for p in active] == [id(params[n]) for n in
                                       ("5.weight", "5.bias", "2.weight", "3.weight")]  # fmt: skip
    trainable = {n: p.requires_grad for n, p in net.named_parameters()}
    assert trainable == dict(zip(names, [False, False, True, False, True, False, True, True]))
    assert freezer.numel(torch.tensor([False, True, False, True])) == 16 + 256 + 48 + 3
    assert freezer.numel(torch.tensor([False] * 4)) == 48 + 3  # the always-active ones
    freezer.release()  # outside a step: every tensor of the partition trains, ours again
    trainable = {n: p.requires_grad for n, p in net.named_parameters()}
    assert trainable == {n: n != "3.bias" for n in names}


def test_layer_norms_group_tensors_by_layer_and_always_active_tensors_stand_alone():
    net, freezer = _freezer(layers="module", always_active=[r"^5\."])  # layers 0, 2, 3
    params = dict(net.named_parameters())
    assert freezer.num_groups == 3 + 2
    chosen = [params[n] for n in ("3.weight", "5.bias", "0.bias", "0.weight")]
    slots = freezer.slots(chosen)
    assert slots.tolist() == [2, 4, 0, 0]
    norms = torch.tensor([12.0, 7.0, 3.0, 4.0])
    # Layer 0: sqrt(3**2 + 4**2); layer 1 had no gradient; the always-active 5.bias is not
    # a layer of the selection.
    assert freezer.layer_norms(norms, slots).tolist() == [5.0, 0.0, 12.0]
    net[0].weight.grad = torch.ones_like(net[0].weight)
    with_grad, grads, grad_slots = freezer.with_grad(chosen)
    assert [id(p) for p in with_grad] == [id(params["0.weight"])] and grad_slots.tolist() == [0]
    assert grads[0] is net[0].weight.grad


def test_weight_flags_and_the_order_state_is_saved_in():
    net, freezer = _freezer(always_active=[r"^5\.bias$"])
    params = list(net.parameters())
    # ASAM scales weights (LayerNorm's included), not biases.
    assert freezer.weight_flags(params) == [True, False, True, False, True, False, True, False]
    tensors = freezer.tensors()  # always-active first, then the layers' tensors
    assert [id(t) for t in tensors] == [id(params[7])] + [id(p) for p in params[:7]]
    index = freezer.tensor_index()
    assert [index[id(p)] for p in params] == [1, 2, 3, 4, 5, 6, 7, 0]
    saved = {0: torch.full((3,), 2.0), 3: torch.ones(16)}
    restored = by_position(saved, tensors)
    assert set(restored) == {id(params[7]), id(params[2])}
    assert restored[id(params[7])].tolist() == [2.0, 2.0, 2.0]


def test_a_model_whose_parameters_were_replaced_is_refused():
    net, freezer = _freezer()
    freezer.check_owned(net)  # the partition's own tensors: nothing to say
    net[0].weight = nn.Parameter(net[0].weight.detach().clone())
    with pytest.raises(RuntimeError, match="replaced after the SAM engine was built"):
        freezer.check_owned(net)
