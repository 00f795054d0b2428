"""SAF under DDP in a plain loop, on 2 gloo processes: each epoch a DistributedSampler deals
the samples out anew, so a sample's past logits were recorded on the other process as often
as not. Each rank saves its weights and store after every epoch, and those of one process
trained on the same global batches (the ranks' batches together, in rank order).

    python tests/saf_ddp_worker.py --out DIR      # -> DIR/rank0.pt, DIR/rank1.pt
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from fsdp2_worker import spawn_two
from helpers import make_data, make_mlp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from lightning_slsam import make_engine
from lightning_slsam.parallel.ddp import release_process_group

EPOCHS, PER_RANK = 4, 4
OPTIONS = {"weight": 0.5, "tau": 2.0, "delay": 1, "start_epoch": 1}


def _loss(model, x, y, index):
    def compute():
        logits = model(x)
        return {"loss": F.cross_entropy(logits, y), "logits": logits, "index": index}

    return compute


def _records(rank: int, world: int) -> dict:
    data = make_data(32)
    net, ref = make_mlp(seed=0), make_mlp(seed=0)
    ddp = DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    engine = make_engine("saf", net, seed=0, **OPTIONS)
    ref_engine = make_engine("saf", ref, seed=0, **OPTIONS)
    samplers = [DistributedSampler(data, world, r, shuffle=True, seed=7) for r in range(world)]
    record: dict = {"epochs": []}
    for epoch in range(EPOCHS):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        orders = [list(s) for s in samplers]  # every rank's indices, known to every rank
        for start in range(0, len(orders[0]), PER_RANK):
            mine = torch.tensor(orders[rank][start : start + PER_RANK])
            x, y = data.tensors[0][mine], data.tensors[1][mine]
            engine.train_step(_loss(ddp, x, y, mine), opt, ddp=ddp)
            both = torch.tensor([i for o in orders for i in o[start : start + PER_RANK]])
            bx, by = data.tensors[0][both], data.tensors[1][both]
            ref_engine.train_step(_loss(ref, bx, by, both), ref_opt)
        record["epochs"].append({
            "weights": [p.detach().clone() for p in net.parameters()],
            "ref_weights": [p.detach().clone() for p in ref.parameters()],
            "store": engine.parts.store.clone(), "visits": engine.parts.visits.clone(),
            "ref_store": ref_engine.parts.store.clone(),
            "ref_visits": ref_engine.parts.visits.clone(),
            "samples": sorted(int(i) for i in orders[rank]),
        })  # fmt: skip
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    spawn_two(_records, parser.parse_args().out)


if __name__ == "__main__":
    main()
    release_process_group()  # a gloo group alive at exit can abort a finished run
