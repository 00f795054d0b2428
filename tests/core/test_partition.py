"""Layer partition and per-step freezing (:mod:`lightning_slsam.core.partition`): groupings,
exclusions, the user's frozen tensors, tied weights, the fresh head that stays always active,
and the freezer: exactly the active layers are trainable during a step, and every tensor
again after it."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import LitModel, Snapshots, loader, make_data, make_mlp, trainer
from torch import nn

from examples.methods import SLSAMAblation
from lightning_slsam import SparseLayerSAM
from lightning_slsam.core.partition import LayerFreezer, build_partition, by_position, find_new_head
from lightning_slsam.methods.registry import method_spec


def _block_model() -> nn.Module:
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(4, 2)
            self.head.weight = nn.Parameter(torch.randn(2, 4))

    return Net()


def test_default_is_one_layer_per_trainable_tensor():
    net = _block_model()
    part = build_partition(net)
    assert part.names == [n for n, _ in net.named_parameters()]
    assert part.num_layers == 11
    assert part.numel == [p.numel() for p in net.parameters()]


def test_module_grouping():
    part = build_partition(_block_model(), layers="module")
    assert part.names == [
        "embed", "blocks.0.attn", "blocks.0.norm", "blocks.1.attn", "blocks.1.norm", "head",
    ]  # fmt: skip
    assert part.param_names[1] == ["blocks.0.attn.weight", "blocks.0.attn.bias"]


def test_regex_grouping_by_match_and_capture():
    part = build_partition(_block_model(), layers=[r"blocks\.\d+"])
    assert part.names == ["embed.weight", "blocks.0", "blocks.1", "head.weight", "head.bias"]
    assert len(part.params[1]) == 4
    part = build_partition(_block_model(), layers=[r"blocks\.\d+\.(\w+)"])
    assert part.names[1:3] == ["attn", "norm"]  # capture group: same kind across blocks
    assert len(part.params[1]) == 4


def test_callable_grouping():
    part = build_partition(
        _block_model(), layers=lambda name, p: "bias" if name.endswith("bias") else None
    )
    assert "bias" in part.names
    assert len(part.params[part.names.index("bias")]) == 5


def test_users_frozen_and_tied_parameters():
    net = _block_model()
    net.embed.weight.requires_grad_(False)
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    assert build_partition(net).names[0] == "blocks.0.attn.weight"
    assert build_partition(tied).num_layers == 1


def test_always_active_and_always_frozen_in_training():
    model = LitModel(make_mlp(), weight_decay=0.0)
    model.net[2].weight.requires_grad_(False)  # the user's own frozen LayerNorm weight
    snaps = Snapshots()
    cb = SparseLayerSAM(
        layer_ratio=0.3, always_active=[r"^net\.5\."], always_frozen=[r"^net\.0\.bias$"], seed=2
    )
    trainer(callbacks=[cb, snaps], max_epochs=2).fit(model, loader(make_data(64), 16))
    assert "net.5.weight" not in cb.layer_names and "net.0.bias" not in cb.layer_names
    assert "net.2.weight" not in cb.layer_names
    previous = snaps.before
    for after in snaps.after:
        assert not torch.equal(after["net.5.weight"], previous["net.5.weight"])
        assert not torch.equal(after["net.5.bias"], previous["net.5.bias"])
        assert torch.equal(after["net.0.bias"], previous["net.0.bias"])
        assert torch.equal(after["net.2.weight"], previous["net.2.weight"])
        previous = after
    assert model.net[2].weight.requires_grad is False  # still frozen after fit
    assert model.net[0].bias.requires_grad is True  # ours again after fit


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"layers": ["("]}, "invalid regular expression"),
        ({"always_active": "head"}, "Wrap it in a list"),
        ({"always_active": ["nothing_matches"]}, "match no trainable parameter"),
        ({"always_active": ["head"], "always_frozen": ["head.bias"]}, "both `always_active`"),
        ({"always_frozen": ["."]}, "no layer is left to sample"),
    ],
)
def test_partition_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_partition(_block_model(), **kwargs)


@pytest.mark.parametrize("layers", ["block", 3, ["("]])
def test_a_layers_option_that_is_no_grouping_is_refused_by_the_spec(layers):
    # What a layer is, is checked once, by the method's specification (before any model).
    with pytest.raises(ValueError, match=r"`layers` must be 'tensor', 'module', a list of"):
        method_spec("sam", layers=layers)


def test_no_trainable_parameters():
    net = make_mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_partition(net)


def test_default_layer_counts_match_the_papers_models():
    """The paper's models, at their real depth but tiny width: 200, 201 and 254 layers."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        RobertaConfig,
        RobertaForSequenceClassification,
        ViTConfig,
        ViTForImageClassification,
    )

    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2)
    deit_small = ViTForImageClassification(ViTConfig(num_hidden_layers=12, **small))
    roberta_base = RobertaForSequenceClassification(
        RobertaConfig(num_hidden_layers=12, vocab_size=100, **small)
    )
    llama_3b = LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=28,
            num_key_value_heads=1,
            vocab_size=100,
            tie_word_embeddings=True,
            **small,
        )
    )
    assert build_partition(deit_small).num_layers == 200
    assert build_partition(roberta_base).num_layers == 201
    assert build_partition(llama_3b).num_layers == 254  # the tied lm_head counted once


def test_head_always_active_finds_a_fresh_timm_and_transformers_head():
    import timm
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
    )

    vit = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=7
    )
    assert find_new_head(vit) == ["head.weight", "head.bias"]
    bert = BertForSequenceClassification(
        BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=32, vocab_size=50, num_labels=3)
    )  # fmt: skip
    assert find_new_head(bert) == ["classifier.weight", "classifier.bias"]
    llama = LlamaForCausalLM(
        LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=2, intermediate_size=32, vocab_size=50)
    )  # fmt: skip
    assert find_new_head(llama) == []  # a language model's lm_head is pretrained

    cb = SparseLayerSAM(seed=0)  # the default preset trains the fresh head every step
    engine = cb.spec.build_engine(bert)
    assert engine.partition.always_active_names == ["classifier.weight", "classifier.bias"]
    assert "classifier.weight" not in [n for g in engine.partition.param_names for n in g]


def test_head_always_active_uses_the_module_hook_and_warns_when_nothing_is_found():
    class WithHook(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.out = nn.Linear(3, 3), nn.Linear(3, 2)

        def sam_head_parameters(self):
            return ["out.weight", "out.bias"]

    cb = SLSAMAblation(head_always_active=True)
    engine = cb.spec.build_engine(WithHook())
    assert engine.partition.always_active_names == ["out.weight", "out.bias"]
    assert SparseLayerSAM().spec.build_engine(WithHook()).partition.always_active_names == [
        "out.weight", "out.bias"]  # fmt: skip
    with pytest.warns(UserWarning, match="found no freshly initialised head"):
        SLSAMAblation(head_always_active=True).spec.build_engine(make_mlp())
    with pytest.raises(ValueError, match="head_always_active"):
        SLSAMAblation(head_always_active="yes")


# -- per-step freezing --------------------------------------------------------------------------


def test_frozen_tensors_keep_no_grad_no_state_and_no_decay():
    model = LitModel(make_mlp(), lr=1e-2, weight_decay=0.5)
    seen = {}

    class Probe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen["grads"] = {n: p.grad is not None for n, p in pl_module.named_parameters()}
            seen["requires"] = {n: p.requires_grad for n, p in pl_module.named_parameters()}

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
