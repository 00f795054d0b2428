"""FSDP2 (``fully_shard``) on CPU with two gloo processes: the engine in a plain loop.

The runs happen in ``fsdp2_worker.py``; each rank writes what it saw, and the tests compare
the ranks with each other and the sharded weights with a one-process run on the same
global batches.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lightning_slsam.sharding import local, shard_layout, sum_over_shards

WORKER = os.path.join(os.path.dirname(__file__), "fsdp2_worker.py")
EXACT = [
    "sam", "asam", "sam_layer_norm", "slsam", "slsam_robust", "random_slsam", "top_slsam",
    "s2sam", "sl_s2sam", "rst", "looksam", "slsam_looksam",
]  # fmt: skip


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    done = subprocess.run(
        [sys.executable, WORKER, "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.parametrize("case", EXACT)
def test_sharded_training_equals_one_process(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["sharded"] and r1["sharded"]
    # Every step: the gathered shards equal the one-process weights.
    assert max(r0["diff"]) < 1e-5, r0["diff"]
    assert r0["kinds"] == r1["kinds"]
    assert all(torch.equal(a, b) for a, b in zip(r0["masks"], r1["masks"]))


def test_sparse_methods_freeze_layers_under_fsdp2(ranks):
    # The sharded run really trains subsets (the equality above is not all-dense).
    masks = ranks[0]["slsam"]["masks"]
    assert any(not bool(m.all()) for m in masks)
    assert ranks[0]["top_slsam"]["masks"][0].sum() == 3  # round(0.5 * 6)
    assert ranks[0]["looksam"]["kinds"] == ["sam", "reuse", "sam", "reuse", "sam"]
    assert ranks[0]["s2sam"]["kinds"][0] == "plain"


def test_esam_draws_the_same_layers_on_every_rank(ranks):
    # ESAM ranks each process's own samples (as under DDP), so it is not the one-process
    # run; the draws and step kinds must still agree.
    r0, r1 = ranks[0]["esam"], ranks[1]["esam"]
    assert all(torch.equal(a, b) for a, b in zip(r0["masks"], r1["masks"]))
    assert r0["kinds"] == r1["kinds"] == ["sam"] * 5


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("ssamf", ["SSAM-F", "FSDP2", "strategy='ddp'"]),
        ("local_first_pass", ["sync_first_pass=False", "FSDP2"]),
        ("built_before_sharding", ["replaced", "build the engine after sharding"]),
    ],
)
def test_what_fsdp2_cannot_do_is_refused_naming_why(ranks, case, words):
    message = ranks[0]["refused"][case]
    for word in words:
        assert word in message, message


def test_without_a_process_group_nothing_changes():
    tensors = [torch.ones(3), torch.zeros(2)]
    assert shard_layout(tensors) is None
    assert all(a is b for a, b in zip(local(tensors), tensors))
    values = torch.tensor([1.0, 2.0])
    assert sum_over_shards(values, None) is values
