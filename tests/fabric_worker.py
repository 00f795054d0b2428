"""Trains SAM methods through :class:`~lightning_slsam.FabricSAM` in a Lightning Fabric loop
and records what each rank saw.

Run by tests/parallel/test_fabric_parallel.py as a separate program: with ``--devices 2``
Fabric's launcher starts the second process by running this script again. The cases named
by ``--cases`` run one after the other in the same processes, each on a fresh model,
optimizer and FabricSAM (one Fabric object per strategy and precision). Every rank writes
``<out>/<case>_rank<r>.pt`` with its per-step layer masks, step kinds and bytes all-reduced,
and its final full (gathered) weights. The tests run the one-process runs in their own
process through :func:`train` (``devices=1``).

The global batch is the same whatever the number of processes: rank r of 2 takes samples
r, r + 2, ... of each 16-sample batch (of each 8-sample micro-batch with accumulation).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

import lightning as L
import torch
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from helpers import Counting, Stack, linear_sgd, make_data, make_mlp, per_sample_outputs

from lightning_slsam import FabricSAM
from lightning_slsam.core.step import StepResult
from lightning_slsam.parallel.ddp import release_process_group

GLOBAL_BATCH = 16
#: Options a method runs with here beyond its name's: SL-SAM on LookSAM's interval in the
#: paper's configuration, what the name ran before 0.3 (the default preset's update scaling
#: multiplies the rounding that LookSAM's reused component amplifies past the tolerances).
OPTIONS: dict[str, dict] = {"slsam_looksam": {"preset": "paper"},
                            "saf": {"delay": 1, "start_epoch": 0}}  # fmt: skip
STEPS = 3
#: Every method of the registry, under DDP ("slsam" is SparseLayerSAM(), "slsam_paper" the
#: paper's method).
METHODS = [
    "sam", "slsam_paper", "random_slsam", "top_slsam", "s2sam", "sl_s2sam", "rst", "esam",
    "ssamf", "looksam", "slsam_rst", "slsam_looksam", "slsam_depth", "slsam",
    "momentum_sam", "arwp", "mesa", "saf",
]  # fmt: skip
#: Under FSDP2 (ModelParallelStrategy, fully_shard in parallelize_fn).
FSDP2_METHODS = ["sam", "slsam_paper", "slsam", "esam"]
#: On a model whose blocks are compiled (each block one layer).
COMPILED_METHODS = ["slsam_paper", "slsam", "top_slsam"]
#: The stop and resume: 6 steps, stopped after 3.
RESUME_STEPS, RESUME_AT = 6, 3


@dataclass
class Case:
    method: str
    strategy: str = "ddp"  # "ddp" or "fsdp2" (devices=1: one device, whatever the name)
    precision: str = "32-true"
    accumulate: int = 1
    clip: float | None = None
    steps: int = STEPS
    start: int = 0  # the first step (a resumed run loads <out>/resume.ckpt first)
    save_at: int | None = None  # fabric.save(<out>/resume.ckpt) after this many steps
    fail_rank: int = -1  # this rank's loss_fn raises in the second pass of step 2
    evaluate: bool = False  # a forward under torch.no_grad before every step
    compile: str = ""  # "blocks" or "whole": a Stack's blocks, or the Stack, compiled
    options: dict = field(default_factory=dict)


def _cases() -> dict[str, Case]:
    cases = {f"{m}": Case(m) for m in [*METHODS, "adamw"]}
    cases.update({f"{m}_bf16": Case(m, precision="bf16-mixed") for m in METHODS})
    for method in ("sam", "slsam_paper", "slsam"):
        cases[f"{method}_acc2"] = Case(method, accumulate=2)
        cases[f"{method}_clip"] = Case(method, clip=0.05)
    cases.update({f"fsdp2_{m}": Case(m, strategy="fsdp2") for m in FSDP2_METHODS})
    cases["fsdp2_slsam_paper_clip"] = Case("slsam_paper", strategy="fsdp2", clip=0.05)
    cases["fsdp2_slsam_paper_acc2"] = Case("slsam_paper", strategy="fsdp2", accumulate=2)
    cases["fsdp2_slsam_paper_bf16"] = Case("slsam_paper", strategy="fsdp2", precision="bf16-mixed")
    # FSDP2 leaves the root's parameters unsharded after a forward without backward.
    cases["fsdp2_slsam_paper_evaluated"] = Case("slsam_paper", strategy="fsdp2", evaluate=True)
    # Compiled (6 steps, the last 3 under fail_on_recompile): under DDP the blocks before
    # fabric.setup, or the model whole (FabricSAM hands it to the blocks); under FSDP2 the
    # blocks after sharding.
    for method in COMPILED_METHODS:
        cases[f"compiled_{method}"] = Case(method, steps=6, compile="blocks")
    cases["compiled_whole_slsam_paper"] = Case("slsam_paper", steps=6, compile="whole")
    cases["fsdp2_compiled_slsam_paper"] = Case("slsam_paper", strategy="fsdp2", steps=6,
                                               compile="blocks")  # fmt: skip
    cases["resume_whole"] = Case("slsam_paper", steps=RESUME_STEPS)
    cases["resume_first"] = Case("slsam_paper", steps=RESUME_STEPS, save_at=RESUME_AT)
    cases["resume_second"] = Case("slsam_paper", steps=RESUME_STEPS, start=RESUME_AT)
    for rank in (0, 1):
        cases[f"fault{rank}"] = Case("slsam_paper", steps=6, fail_rank=rank)
    return cases


CASES = _cases()


def _shard(module: torch.nn.Module, mesh) -> torch.nn.Module:
    """ModelParallelStrategy's parallelize_fn: every linear layer, then the root, sharded
    with FSDP2 over the data-parallel mesh."""
    from torch.distributed.fsdp import fully_shard

    data_parallel = mesh["data_parallel"]
    blocks = list(getattr(module, "blocks", []))  # a Stack: each block, else each linear
    for layer in blocks or module:
        if blocks or isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=data_parallel)
    return fully_shard(module, mesh=data_parallel)


def make_fabric(strategy: str, devices: int, precision: str) -> L.Fabric:
    if devices == 1:
        chosen = "auto"
    elif strategy == "ddp":
        chosen = DDPStrategy(process_group_backend="gloo")
    else:
        chosen = ModelParallelStrategy(parallelize_fn=_shard, data_parallel_size=2,
                                       tensor_parallel_size=1)  # fmt: skip
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=chosen, precision=precision)
    fabric.launch()
    return fabric


def _batches(fabric: L.Fabric, step: int, accumulate: int) -> list[tuple]:
    """The step's micro-batches on this rank: its share of the global batch ``step``."""
    x, y, index = make_data(GLOBAL_BATCH * RESUME_STEPS, indexed=GLOBAL_BATCH)[:]
    window = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
    x, y, index = x[window], y[window], index[window]
    size = GLOBAL_BATCH // accumulate
    rank, world = fabric.global_rank, fabric.world_size
    return [tuple(t[i : i + size][rank::world] for t in (x, y, index))
            for i in range(0, GLOBAL_BATCH, size)]  # fmt: skip


def _full(module: torch.nn.Module) -> dict[str, torch.Tensor]:  # a collective when sharded
    return {n.replace("_orig_mod.", ""): (p.full_tensor() if hasattr(p, "full_tensor") else p)
            .detach().clone() for n, p in module.named_parameters()}  # fmt: skip


class _PlainSteps:
    """Optimizer steps without SAM, as FabricSAM.step's stand-in (the traffic counter's control)."""

    def __init__(self, fabric: L.Fabric, model, optimizer) -> None:
        self.fabric, self.model, self.optimizer = fabric, model, optimizer

    def step(self, loss_fn, batch) -> StepResult:
        loss = loss_fn(batch)["loss"].mean()
        self.fabric.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad()
        mask = torch.ones(len(list(self.model.parameters())), dtype=torch.bool)
        return StepResult(loss.detach(), mask, 0, "adamw")


def _count_ddp_traffic(model, record: dict) -> None:
    """Counts the bytes DDP's own reducer all-reduces (FabricSAM switches it off)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    ddp = model._forward_module
    if not isinstance(ddp, DistributedDataParallel):
        return

    def hook(state, bucket):
        record["ddp_bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, hook)


def train(fabric: L.Fabric, case: Case, out: str | None = None) -> dict:
    """One run of ``case`` on ``fabric``; returns this rank's record."""
    L.seed_everything(99 if case.start else 7)  # a resumed run must take its state from the file
    net = Stack(seed=5) if case.compile else make_mlp(seed=5)
    backend = Counting()
    if case.compile:
        torch._dynamo.reset()
    if case.compile == "blocks" and case.strategy != "fsdp2":
        for block in net.blocks:
            block.compile(backend=backend)
    if case.strategy == "fsdp2":  # FSDP2 replaces the parameters: the optimizer comes after
        model = fabric.setup_module(net)
        for block in net.blocks if case.compile else []:  # compiled after sharding
            block.compile(backend=backend)
        optimizer = fabric.setup_optimizers(linear_sgd(model.parameters()))
    else:
        compiled = torch.compile(net, backend=backend) if case.compile == "whole" else net
        model, optimizer = fabric.setup(compiled, linear_sgd(net.parameters()))
    options = {"seed": 3 if case.method in ("esam", "ssamf") else None}
    options.update(OPTIONS.get(case.method, {}), **case.options)
    if case.method == "adamw":  # plain Fabric steps: DDP's reducer averages, as usual
        sam = _PlainSteps(fabric, model, optimizer)
    else:
        sam = FabricSAM(fabric, model, optimizer, case.method, gradient_clip_val=case.clip,
                        **options)  # fmt: skip
        sam.engine.planned_steps = STEPS  # ARWP's noise grows over the run
    record: dict = {"masks": [], "kinds": [], "bytes": [], "losses": [], "ddp_bytes": 0}
    _count_ddp_traffic(model, record)
    state = {"model": model, "optimizer": optimizer, "sam": sam}
    if case.start:
        fabric.load(os.path.join(out, "resume.ckpt"), state)
    calls = [0]

    def loss_fn(batch):
        calls[0] += 1
        if fabric.global_rank == case.fail_rank and step == 2 and calls[0] == 2:
            raise RuntimeError(f"a fault on rank {fabric.global_rank}")
        return per_sample_outputs(model, batch)  # ESAM's losses, MESA's logits, SAF's indices

    for step in range(case.start, case.steps):
        if case.compile and step == case.steps // 2:
            torch.compiler.set_stance("fail_on_recompile")  # warm-up over: no more graphs
        calls[0] = 0
        batches = _batches(fabric, step, case.accumulate)
        if case.compile:  # as a DataLoader gives them: a strided view would trace apart
            batches = [(b[0].contiguous(), *b[1:]) for b in batches]
        if case.evaluate:
            with torch.no_grad():
                model(batches[0][0])
        result = sam.step(loss_fn, *batches)
        record["masks"].append(result.active_mask.clone())
        record["kinds"].append(result.kind)
        record["bytes"].append(result.allreduce_bytes)
        record["losses"].append(float(result.loss))
        if case.save_at is not None and step + 1 == case.save_at:
            fabric.save(os.path.join(out, "resume.ckpt"), state)
            break
    torch.compiler.set_stance("default")
    record["graphs"], record["compiled_calls"] = backend.graphs, backend.calls
    record["weights"] = _full(model.module)
    record["sharded"] = any(hasattr(p, "full_tensor") for p in model.module.parameters())
    record["numel"] = [w.numel() for w in record["weights"].values()]
    if isinstance(sam, _PlainSteps):
        return record
    record["counts"] = sam.engine.counts.clone()
    probs = getattr(sam.engine.selection, "probs", None)
    record["probs"] = None if probs is None else probs.clone()
    return record


def refused_joint_setup(fabric: L.Fabric) -> str:
    """Under FSDP2, an optimizer made before sharding and set up with the model holds the
    replaced tensors: FabricSAM must refuse it, naming the order."""
    net = make_mlp(seed=5)
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters()))
    try:
        FabricSAM(fabric, model, optimizer, "slsam")
    except ValueError as err:
        return str(err)
    return "not refused"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # never fall back to eager
    fabrics: dict[tuple[str, str], L.Fabric] = {}
    for name in args.cases.split(","):
        if name == "fsdp2_joint_setup":
            fabric = fabrics.get(("fsdp2", "32-true")) or make_fabric("fsdp2", 2, "32-true")
            record: dict = {"refused": refused_joint_setup(fabric)}
        else:
            case = CASES[name]
            key = (case.strategy, case.precision)
            if key not in fabrics:
                fabrics[key] = make_fabric(case.strategy, 2, case.precision)
            fabric = fabrics[key]
            record = train(fabric, case, args.out)
        torch.save(record, os.path.join(args.out, f"{name}_rank{fabric.global_rank}.pt"))


if __name__ == "__main__":
    main()
    release_process_group()  # a gloo group alive at exit can abort a finished run
