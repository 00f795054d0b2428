"""Runs SAM methods' engines in a plain loop under DDP on 2 gloo CPU processes.

Run by tests/parallel/test_ddp.py as a separate program. Every method trains an MLP wrapped in
``DistributedDataParallel`` through ``engine.train_step(..., ddp=model)``; each process sees
its half of a 16-sample global batch. Beside it every process trains an unwrapped copy on
the whole batch (the one-process run). Rank r writes ``<out>/rank<r>.pt``: per method, the
masks it drew, the step kinds and the largest difference between its weights and the
one-process weights after every step; and the errors of what must be refused.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from fsdp2_worker import CASES as FSDP2_CASES
from fsdp2_worker import STEPS, _loss, _mlp, spawn_two
from helpers import linear_sgd

from lightning_slsam import make_engine
from lightning_slsam.parallel.ddp import release_process_group

#: name -> (method, options): the FSDP2 test's methods, and the local first pass, which
#: FSDP2 refuses and DDP runs (each process perturbs with its own gradient).
CASES = {
    **FSDP2_CASES,
    "local_first_pass": ("slsam_paper", {"layer_ratio": 0.5, "sync_first_pass": False}),
}


def _data(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, slice]:
    torch.manual_seed(1)
    x, y = torch.randn(STEPS, 16, 6), torch.randint(0, 3, (STEPS, 16))
    half = 16 // world
    return x, y, slice(rank * half, (rank + 1) * half)


def _case(rank: int, world: int, method: str, options: dict) -> dict:
    net, ref = _mlp(), _mlp()
    ddp = DistributedDataParallel(net)
    x, y, mine = _data(rank, world)
    opt, ref_opt = linear_sgd(net.parameters()), linear_sgd(ref.parameters())
    engine = make_engine(method, net, seed=0, **options)
    ref_engine = make_engine(method, ref, seed=0, **options)
    engine.planned_steps = ref_engine.planned_steps = STEPS  # ARWP's noise grows over them
    record: dict = {"masks": [], "kinds": [], "diff": [], "bytes": []}
    for step in range(STEPS):
        xb, yb = x[step], y[step]
        samples = torch.arange(16)  # SAF's indices: each step revisits the step before's
        result = engine.train_step(_loss(ddp, xb[mine], yb[mine], samples[mine]), opt,
                                   mine.stop - mine.start,
                                   ddp=ddp)  # fmt: skip
        ref_engine.train_step(_loss(ref, xb, yb, samples), ref_opt, batch_size=16)
        with torch.no_grad():
            diff = max(
                float((p - q).abs().max()) for p, q in zip(net.parameters(), ref.parameters())
            )
        record["masks"].append(result.active_mask.clone())
        record["kinds"].append(result.kind)
        record["diff"].append(diff)
        record["bytes"].append(result.allreduce_bytes)
    return record


def _refusal(rank: int, world: int, what: str) -> str:
    """The error of one misuse, and whether the weights stayed as they were."""
    net = _mlp()
    ddp = DistributedDataParallel(net)
    seed = rank if what == "seeds_differ" else 0
    engine = make_engine("slsam", _mlp() if what == "other_module" else net, seed=seed)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    before = [p.detach().clone() for p in net.parameters()]
    x, y, mine = _data(rank, world)
    wrapper = net if what == "not_ddp" else ddp
    try:
        engine.train_step(_loss(ddp, x[0][mine], y[0][mine]), opt, ddp=wrapper)
        error = "not refused"
    except (TypeError, ValueError, RuntimeError) as err:
        error = f"{type(err).__name__}: {err}"
    kept = all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    return f"{error} | weights kept: {kept}"


def _records(rank: int, world: int) -> dict:
    records: dict = {name: _case(rank, world, *CASES[name]) for name in CASES}
    misuses = ("not_ddp", "other_module", "seeds_differ")
    records["refused"] = {what: _refusal(rank, world, what) for what in misuses}
    return records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    spawn_two(_records, parser.parse_args().out)


if __name__ == "__main__":
    main()
    release_process_group()  # a gloo group alive at exit can abort a finished run
