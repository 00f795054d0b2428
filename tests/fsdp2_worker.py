"""Runs SAM methods' engines in a plain loop under FSDP2 on 2 gloo CPU processes.

Run by tests/parallel/test_fsdp2.py as a separate program. Every method trains an MLP whose linear
layers are sharded with ``fully_shard``; each process sees its half of a 16-sample global
batch. Beside it every process trains an unsharded copy on the whole batch (the one-process
run). Rank r writes ``<out>/rank<r>.pt``: per method, the masks it drew, the step kinds
and the largest difference between the gathered sharded weights and the one-process
weights after every step.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from helpers import linear_sgd

from lightning_slsam import make_engine

STEPS = 5
#: name -> (method, options)
CASES = {
    "sam": ("sam", {}),
    "asam": ("sam", {"adaptive": True}),
    "sam_layer_norm": ("sam", {"perturbation_norm": "layer"}),
    "slsam_paper": ("slsam_paper", {"layer_ratio": 0.5}),
    # SparseLayerSAM()'s default, every remedy at once: the compute budget's costs from the
    # sharded parameters, the rank bandit, the head every step, the update scaling
    "slsam": ("slsam", {"layer_ratio": 0.5}),
    "random_slsam": ("random_slsam", {"layer_ratio": 0.5}),
    "top_slsam": ("top_slsam", {"layer_ratio": 0.5}),
    "s2sam": ("s2sam", {}),
    "momentum_sam": ("momentum_sam", {}),
    "arwp": ("arwp", {}),  # its noise grows over the planned steps
    "mesa": ("mesa", {"start": 0.2, "decay": 0.5}),  # the term from step 1 on
    "saf": ("saf", {"delay": 1, "start_epoch": 0}),  # a sample's past: the step before's
    "sl_s2sam": ("sl_s2sam", {"layer_ratio": 0.5}),
    "rst": ("rst", {}),
    "looksam": ("looksam", {"interval": 2}),
    "slsam_rst": ("slsam_rst", {"layer_ratio": 0.5}),
    "slsam_looksam": ("slsam_looksam", {"layer_ratio": 0.5}),
    "slsam_depth": ("slsam_depth", {"layer_ratio": 0.5}),
    "ssamf": ("ssamf", {"mask_interval": 2}),  # Fisher over all 16 samples, as on one process
    "esam": ("esam", {}),  # each process ranks its own samples: not the one-process run
}
#: name -> the case run again, with the head sharded by the root, and an evaluation (a
#: forward under ``torch.no_grad``, which leaves FSDP2's root unsharded) before every step.
EVALUATED = {"sam_evaluated": "sam", "slsam_paper_evaluated": "slsam_paper",
             "sl_s2sam_evaluated": "sl_s2sam"}  # fmt: skip
#: name -> (method, options) that must be refused with sharded parameters.
REFUSED = {
    "local_first_pass": ("sam", {"sync_first_pass": False}),
}


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    )  # fmt: skip


def _sharded(root_owns_head: bool = False) -> torch.nn.Sequential:
    """Each linear layer sharded on its own, or all but the head, whose tensors are then
    the root's (FSDP2 leaves the root unsharded after a forward without backward)."""
    net = _mlp()
    for layer in net[:-1] if root_owns_head else net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(net)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, samples=None):
    """Per-sample losses (ESAM picks samples), the logits (MESA, SAF) and the samples'
    positions (``samples``; SAF's indices: by default ``0 .. len(x) - 1``)."""
    samples = torch.arange(len(x)) if samples is None else samples

    def compute(index=slice(None)):
        logits = model(x[index])
        losses = F.cross_entropy(logits, y[index], reduction="none")
        return {"loss": losses, "logits": logits, "index": samples[index]}

    return compute


def _evaluate(model: torch.nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        model(x)


def _case(rank: int, world: int, method: str, options: dict, evaluate: bool = False) -> dict:
    net, ref = _sharded(root_owns_head=evaluate), _mlp()
    torch.manual_seed(1)
    x, y = torch.randn(STEPS, 16, 6), torch.randint(0, 3, (STEPS, 16))
    half = 16 // world
    mine = slice(rank * half, (rank + 1) * half)
    opt, ref_opt = linear_sgd(net.parameters()), linear_sgd(ref.parameters())
    engine = make_engine(method, net, seed=0, **options)
    ref_engine = make_engine(method, ref, seed=0, **options)
    engine.planned_steps = ref_engine.planned_steps = STEPS  # ARWP's noise grows over them
    record: dict = {"masks": [], "kinds": [], "diff": []}
    for step in range(STEPS):
        xb, yb = x[step], y[step]
        if evaluate:
            _evaluate(net, xb[mine])
        samples = torch.arange(16)  # SAF's indices: each step revisits the step before's
        result = engine.train_step(_loss(net, xb[mine], yb[mine], samples[mine]), opt,
                                   batch_size=half)  # fmt: skip
        ref_engine.train_step(_loss(ref, xb, yb, samples), ref_opt, batch_size=16)
        diff = max(
            float((p.full_tensor() - q).abs().max())
            for p, q in zip(net.parameters(), ref.parameters())
        )
        record["masks"].append(result.active_mask.clone())
        record["kinds"].append(result.kind)
        record["diff"].append(diff)
    record["sharded"] = all(type(p).__name__ == "DTensor" for p in net.parameters())
    return record


def _refusal(method: str, options: dict) -> str:
    try:
        make_engine(method, _sharded(), seed=0, **options)
    except ValueError as err:
        return str(err)
    return "not refused"


def _built_before_sharding() -> str:
    net = _mlp()
    engine = make_engine("slsam", net, seed=0)
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    opt = torch.optim.AdamW(net.parameters())
    try:
        engine.train_step(_loss(net, torch.randn(4, 6), torch.zeros(4, dtype=torch.long)), opt)
    except RuntimeError as err:
        return str(err)
    return "not refused"


def _records(rank: int, world: int, cases: list[str]) -> dict:
    records: dict = {name: _case(rank, world, *CASES[name]) for name in cases}
    for name, case in EVALUATED.items():
        if case in cases:
            records[name] = _case(rank, world, *CASES[case], evaluate=True)
    records["refused"] = {name: _refusal(*REFUSED[name]) for name in REFUSED}
    records["refused"]["built_before_sharding"] = _built_before_sharding()
    return records


def _rank(rank: int, world: int, port: int, out: str, records, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(records(rank, world, *args), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn_two(records, out: str, *args) -> None:
    """In 2 gloo processes on a free port, each rank saves ``records(rank, 2, *args)`` to
    ``<out>/rank<r>.pt``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, out, records, args), nprocs=2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    spawn_two(_records, args.out, args.cases.split(","))


if __name__ == "__main__":
    main()
