"""Compiled regions: found in a model, each one layer of a layer-sampling method's
partition, and trained through a Trainer with no recompile after warm-up."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from helpers import Counting, LitModel, Stack, loader, make_data, trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_slsam import SAM, SparseLayerSAM, make_engine
from lightning_slsam.core.partition import build_partition
from lightning_slsam.core.regions import (
    compile_blocks_instead,
    compiled_regions,
    compiled_whole,
    repeated_blocks,
    torch_guards_requires_grad,
)
from lightning_slsam.lightning.setup_checks import check_compiled_sampling


def test_compiled_regions_are_found_outermost_and_in_model_order():
    net = Stack()
    assert compiled_regions(net) == [] and not compiled_whole(net)
    net.blocks[2].compile()
    net.blocks[0].compile()
    net.blocks[0].fc1.compile()  # inside a region: part of it
    assert compiled_regions(net) == ["blocks.0", "blocks.2"]
    net.head = torch.compile(net.head)  # a compiled module placed in the model
    assert compiled_regions(net) == ["blocks.0", "blocks.2", "head"]
    assert not compiled_whole(net) and compiled_whole(torch.compile(Stack()))
    part = build_partition(net, regions=compiled_regions(net))
    inner = ["blocks.1.fc1.weight", "blocks.1.fc1.bias", "blocks.1.fc2.weight", "blocks.1.fc2.bias"]
    assert part.names == ["blocks.0", *inner, "blocks.2", "head"]
    assert part.param_names[0] == [
        f"blocks.0.fc{i}.{k}" for i in (1, 2) for k in ("weight", "bias")
    ]
    assert part.param_names[-1] == ["head._orig_mod.weight", "head._orig_mod.bias"]


def test_repeated_blocks_are_the_largest_stack_of_one_class():
    net = Stack()
    net.pair = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # fewer parameters
    net.mixed = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))  # not one class
    assert repeated_blocks(net) == ["blocks.0", "blocks.1", "blocks.2"]
    assert repeated_blocks(nn.Linear(2, 2)) == []


@pytest.mark.parametrize("form", ["wrapper", "in_place", "child"])
def test_a_region_compiled_whole_hands_its_blocks_to_regional_compilation(form):
    eager, net = Stack(), Stack()
    net.head = torch.compile(net.head, backend="aot_eager")  # no blocks in it: stays compiled
    model: nn.Module = net
    if form == "wrapper":
        model = torch.compile(net, backend="aot_eager")
    elif form == "in_place":
        net.compile(backend="aot_eager")
    else:
        model = nn.Sequential(net)
        model[0] = torch.compile(net, backend="aot_eager")
    prefix = {"wrapper": "_orig_mod.", "in_place": "", "child": "0._orig_mod."}[form]
    region = {"wrapper": "", "in_place": "", "child": "0"}[form]
    blocks = [f"{prefix}blocks.{i}" for i in range(3)]
    assert compile_blocks_instead(model) == {region: blocks}
    assert not compiled_whole(model) and compiled_regions(model) == [*blocks, f"{prefix}head"]
    assert compile_blocks_instead(model) == {}  # done once
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), eager(x))
    net = Stack()
    for block in net.blocks:
        block.compile()
    assert make_engine("slsam_paper", net, seed=0).partition.names == [
        "blocks.0", "blocks.1", "blocks.2", "head.weight", "head.bias"]  # fmt: skip
    assert make_engine("sam", net).partition.num_layers == 14  # dense: one layer per tensor


def test_torch_versions_without_the_requires_grad_guard_fix_are_named():
    assert not torch_guards_requires_grad("2.11.0") and torch_guards_requires_grad("2.12.0")


def test_compiled_whole_or_an_old_torch_is_refused_with_the_fix(monkeypatch):
    model = LitModel(Stack())
    model.net = torch.compile(model.net)  # the whole network: one region, nothing to sample
    engine = SparseLayerSAM().spec.build_engine(model, seed=0)
    with pytest.raises(MisconfigurationException, match=r"Compile its repeated blocks instead"):
        check_compiled_sampling("SparseLayerSAM", model, engine)
    regional = LitModel(Stack())
    for block in regional.net.blocks:
        block.compile()
    engine = SparseLayerSAM().spec.build_engine(regional, seed=0)
    check_compiled_sampling("SparseLayerSAM", regional, engine)  # regional: accepted
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    with pytest.raises(MisconfigurationException, match=r"needs torch >= 2\.12 \(this is 2\.11"):
        check_compiled_sampling("SparseLayerSAM", regional, engine)


class NoRecompileAfter(L.Callback):
    """From step ``warmup`` on, any recompile raises (``fail_on_recompile``)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.warmup:
            torch.compiler.set_stance("fail_on_recompile")

    def on_train_end(self, trainer, pl_module):
        torch.compiler.set_stance("default")


def _fit(net: nn.Module, callbacks: list, steps: int) -> dict[str, torch.Tensor]:
    L.seed_everything(0)
    model = LitModel(net)
    trainer(callbacks=callbacks, max_steps=steps, limit_val_batches=0).fit(
        model, loader(make_data(160, dim=8), 16)
    )
    return {n.replace("_orig_mod.", ""): p.detach().clone() for n, p in model.named_parameters()}


@torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
def test_regional_compile_trains_sl_sam_without_recompiles_and_equals_eager():
    torch._dynamo.reset()
    eager_net, compiled_net = Stack(), Stack()
    compiled_net.load_state_dict(eager_net.state_dict())
    backend = Counting()
    for block in compiled_net.blocks:
        block.compile(backend=backend)
    method = dict(layer_ratio=0.4, rho=0.05, preset="paper", seed=3)
    compiled_cb = SparseLayerSAM(**method)
    try:
        compiled = _fit(compiled_net, [compiled_cb, NoRecompileAfter(warmup=8)], steps=20)
    finally:
        torch.compiler.set_stance("default")
    # The blocks were the layers drawn, frozen and trained whole, and their compiled graphs
    # ran every step: 3 blocks x 2 passes x 20 steps, from at most 4 graphs (trained or
    # frozen, times whether the block's input needs a gradient).
    assert compiled_cb.layer_names[:3] == ["net.blocks.0", "net.blocks.1", "net.blocks.2"]
    assert 2 <= backend.graphs <= 4
    assert backend.calls == 3 * 2 * 20
    counts = compiled_cb.engine.counts[:3].tolist()
    assert all(0 < c < 20 for c in counts)  # each block both trained and frozen
    # The same method in eager mode, its layers grouped the same way: the same weights.
    grouping = [r"^(net\.blocks\.\d+)\."]
    eager_cb = SparseLayerSAM(**method, layers=grouping)
    eager = _fit(copy.deepcopy(eager_net), [eager_cb], steps=20)
    assert eager_cb.engine.counts.tolist() == compiled_cb.engine.counts.tolist()
    for name, value in eager.items():
        torch.testing.assert_close(compiled[name], value, rtol=1e-5, atol=1e-5, msg=name)
    assert any(not torch.equal(eager[f"net.{n}"], p) for n, p in eager_net.named_parameters())


def test_dense_sam_with_compiled_blocks_keeps_one_layer_per_tensor():
    net = Stack()
    for block in net.blocks:
        block.compile(backend="aot_eager")
    sam = SAM(rho=0.05)
    _fit(net, [sam], steps=2)
    assert len(sam.layer_names) == 14
