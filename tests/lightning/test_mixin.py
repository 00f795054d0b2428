"""``SAMMixin`` (:mod:`lightning_slsam.lightning.mixin`): without a SAM callback the module
trains as plain automatic optimization; the batch size and sample subsets it gives the
methods that address single samples."""

from __future__ import annotations

import copy
from collections import namedtuple

import pytest
import torch
from helpers import LitModel, Snapshots, loader, make_data, make_mlp, trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from probes import batches

Pair = namedtuple("Pair", "x y")


def test_without_callback_module_trains_as_plain_automatic_optimization():
    data = make_data(48)
    net = make_mlp()
    model = LitModel(copy.deepcopy(net), lr=1e-2)
    snaps = Snapshots()
    trainer(callbacks=[snaps], max_epochs=1).fit(model, loader(data, 16))
    assert model.automatic_optimization is True

    ref = copy.deepcopy(net)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for x, y in batches(data, 16):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    for name, value in ref.named_parameters():
        torch.testing.assert_close(snaps.after[-1][f"net.{name}"], value, rtol=0, atol=1e-6)


def test_the_batch_size_and_a_subset_of_the_batch_layouts_a_module_may_use():
    model = LitModel(make_mlp())
    x, y = torch.arange(12.0).view(6, 2), torch.arange(6)
    index = torch.tensor([4, 1])
    assert model.sam_batch_size((x, y)) == 6 and model.sam_batch_size({"ids": [x], "n": 3}) == 6
    # Tensors with the batch's first dimension are indexed; everything else is kept.
    sub = model.sam_subset_batch({"x": x, "y": y, "mask": torch.ones(2), "name": "b"}, index, 6)
    assert sub["x"].tolist() == [[8.0, 9.0], [2.0, 3.0]] and sub["y"].tolist() == [4, 1]
    assert sub["mask"].tolist() == [1.0, 1.0] and sub["name"] == "b"
    pair = model.sam_subset_batch(Pair(x, [y, 7]), index, 6)
    assert type(pair) is Pair and pair.x.tolist() == [[8.0, 9.0], [2.0, 3.0]]
    assert pair.y[0].tolist() == [4, 1] and pair.y[1] == 7
    with pytest.raises(MisconfigurationException, match="Cannot tell the batch size of a str"):
        model.sam_batch_size("a batch of text")
