"""The SL-SAM contract on real architectures: a timm ViT and Transformers models."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import timm
import torch
import torch.nn.functional as F
from helpers import Snapshots, reference_sam_adamw, trainer
from torch.utils.data import DataLoader, TensorDataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
)

from lightning_slsam import SAMMixin, SparseLayerSAM


class Wrapped(SAMMixin, L.LightningModule):
    """A LightningModule around ``net`` with a ``loss_fn(net, batch)``."""

    def __init__(self, net, loss_fn, lr=1e-3):
        super().__init__()
        self.net = net
        self.loss_fn = loss_fn
        self.lr = lr

    def training_step(self, batch, batch_idx):
        return self.loss_fn(self.net, batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def _vit():
    torch.manual_seed(0)
    net = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4,
        embed_dim=32, depth=2, num_heads=2, num_classes=3,
    )  # fmt: skip
    x = torch.randn(16, 3, 16, 16)
    y = torch.randint(0, 3, (16,))

    def loss_fn(m, batch):
        return F.cross_entropy(m(batch[0]), batch[1])

    return net, TensorDataset(x, y), loss_fn


def _bert():
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    net = BertForSequenceClassification(cfg)
    ids = torch.randint(1, 50, (16, 12))
    labels = torch.randint(0, 2, (16,))

    def loss_fn(m, batch):
        return m(input_ids=batch[0], labels=batch[1]).loss

    return net, TensorDataset(ids, labels), loss_fn


def _llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=True,
    )  # fmt: skip
    net = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (16, 12))

    def loss_fn(m, batch):
        return m(input_ids=batch[0], labels=batch[0]).loss

    return net, TensorDataset(ids), loss_fn


MODELS = {"timm-vit": _vit, "bert": _bert, "llama": _llama}


@pytest.mark.parametrize("name", list(MODELS))
def test_all_layers_equal_hand_written_sam(name):
    net, data, loss_fn = MODELS[name]()
    batches = list(DataLoader(data, batch_size=8))
    reference = reference_sam_adamw(
        net, batches, rho=0.05, lr=1e-3, weight_decay=0.01, loss_fn=loss_fn
    )
    snaps = Snapshots()
    model = Wrapped(copy.deepcopy(net), loss_fn)
    trainer(callbacks=[SparseLayerSAM(rho=0.05, layer_ratio=1.0), snaps], max_epochs=1).fit(
        model, DataLoader(data, batch_size=8)
    )
    for ours, ref in zip(snaps.after, reference):
        for key, value in ref.items():
            torch.testing.assert_close(ours[f"net.{key}"], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", list(MODELS))
def test_exactly_the_active_tensors_change(name):
    net, data, loss_fn = MODELS[name]()
    model = Wrapped(net, loss_fn)
    snaps = Snapshots()
    cb = SparseLayerSAM(rho=0.05, layer_ratio=0.2, seed=0)
    trainer(callbacks=[cb, snaps], max_epochs=2).fit(model, DataLoader(data, batch_size=4))

    names = cb.layer_names
    assert names == [n for n, p in model.named_parameters() if p.requires_grad]
    previous = snaps.before
    for after, mask in zip(snaps.after, snaps.masks):
        changed = [not torch.equal(after[n], previous[n]) for n in names]
        assert changed == mask.tolist()
        previous = after
    frequencies = cb.engine.frequencies()
    assert 0.05 < float(frequencies.mean()) < 0.5
