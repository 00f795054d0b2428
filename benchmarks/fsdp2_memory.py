"""Per-rank peak memory of SAM and SL-SAM under FSDP2 and DDP, on 2 gloo processes.

    python benchmarks/fsdp2_memory.py            # or `make bench-fsdp2`; ~20 min, 2 CPU cores
    python benchmarks/fsdp2_memory.py --shapes 2x32   # one shape; the others' results kept

Trains the benchmark's small Llama (``models.py``'s ``llama``) with AdamW (the reference),
SAM and SL-SAM (the paper's defaults) through the library's engine in a plain loop:

* ``ddp`` -- the whole model on every rank, wrapped in ``DistributedDataParallel``; the SAM
  methods run inside ``no_sync`` with the engine's ``GradientAverager`` (only the active
  layers' gradients travel), as the Lightning driver does; AdamW lets DDP reduce;
* ``fsdp2`` -- ``fully_shard`` on every decoder layer, then the root, over a 1-D mesh of the
  processes; the engine is built after sharding and works on the local shards.

Two shapes, batch per rank x tokens (``--shapes``): ``8x128``, where the activations (the
logits over the 8192-token vocabulary above all) outweigh the weights, gradients and AdamW
state, and ``2x32``, where those parameter-sized tensors outweigh the activations many times,
as in the paper's LLM fine-tuning (Llama-3.2-3B, batch 2 x 1024 tokens). Both use the same
token stream (the first ``batch`` x ``seq`` of the same random batches).

Every configuration runs ``--repeats`` times in fresh processes, each rank measuring as
``memory.py`` does: on a CPU, its RSS high-water mark (VmHWM, reset after setup) minus its
runtime RSS (after the imports and the process group, before the model exists), the
optimizer state of every parameter allocated first (one AdamW step, zero gradients, lr 0);
on CUDA, ``torch.cuda.max_memory_allocated`` too. One more run per configuration has glibc
return freed blocks to the OS (``RETURNED``), so its RSS follows the live memory. Both ranks
use SL-SAM's seed 0, so they draw the same layers (checked). Writes
``results/fsdp2_memory.{json,md}``, merging the shapes run into the JSON already there. The
pure part (ratios, verdicts, the table) is ``fsdp2_memory_report.py``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time

from fsdp2_memory_report import GOAL, RETURNED, merge, render, shape_name, summarize
from memory import _reset_peak, _rss_mb  # the same RSS readings as memory.py

__all__ = ["GOAL", "RETURNED", "estimate", "launch", "main", "render", "summarize", "worker"]

HERE = os.path.dirname(os.path.abspath(__file__))
STRATEGIES = ("ddp", "fsdp2")
METHODS = ("adamw", "sam", "slsam_paper")  # slsam_paper: the paper's SL-SAM
#: batch per rank, tokens per sequence: activation-dominated, then parameter-dominated.
SHAPES = {shape_name(b, t): (b, t) for b, t in ((8, 128), (2, 32))}
MB = 2**20
#: Hand-written analysis appended to the report (kept beside the results).
NOTES = os.path.join(HERE, "results", "fsdp2_memory.notes.md")


# -- one rank ---------------------------------------------------------------------------
def _local_mb(tensors) -> float:
    local = [getattr(t, "to_local", lambda t=t: t)() for t in tensors]  # FSDP2: the shard
    return sum(t.numel() * t.element_size() for t in local) / MB


def _batches(count: int, batch: int, seq: int, vocab: int, device: str) -> list[dict]:
    """``models.py``'s llama batches (the same generator), cut to ``batch`` x ``seq``."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, vocab, (8, 128), generator=gen)[:batch, :seq]
             .contiguous().to(device)} for _ in range(count)]  # fmt: skip


def estimate(batch: int, seq: int, world: int) -> dict:
    """What dominates AdamW's per-rank memory at a shape, in one process (no training):
    the weights, gradients and AdamW state (4 x the fp32 parameters; FSDP2 shards them over
    ``world``), and the activations one forward and the loss keep for the backward."""
    import torch
    from models import make_workload

    work = make_workload("llama", 0, "cpu")
    model, vocab = work.model, work.model.config.vocab_size
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:  # the weights (and their views) are not activations
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        work.loss(model, _batches(1, batch, seq, vocab, "cpu")[0]).mean()
    param_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / MB
    return {"param_mb": param_mb, "tokens_per_rank": batch * seq,
            "weights_grads_adamw_mb": {"ddp": 4 * param_mb, "fsdp2": 4 * param_mb / world},
            "saved_activations_mb": sum(saved.values()) / MB,
            "logits_mb": batch * seq * vocab * 4 / MB}  # fmt: skip


def worker(strategy: str, method: str, steps: int, threads: int, batch: int, seq: int) -> dict:
    """One rank's run (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` in the env)."""
    import torch
    import torch.distributed as dist
    from models import make_workload
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaForCausalLM  # noqa: F401  (its import is runtime, not training)

    from lightning_slsam import make_engine

    torch.set_num_threads(threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = "cuda" if cuda else "cpu"
    runtime = _rss_mb()
    work = make_workload("llama", 0, device)  # rank r trains batches r, r+w, ...
    work.batches = _batches(steps * world, batch, seq, work.model.config.vocab_size, device)
    model = forward = work.model
    if strategy == "fsdp2":
        mesh = init_device_mesh(device, (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        forward = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    # The engine after fully_shard; on the module itself under DDP (as the Lightning driver).
    engine = None if method == "adamw" else make_engine(method, model, seed=0)
    # Steady state: optimizer state for every parameter (zero gradients, lr 0).
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.param_groups[0]["lr"] = 0.0  # (one group)
    opt.step()
    opt.zero_grad(set_to_none=True)
    opt.param_groups[0]["lr"] = 1e-4
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    setup = _rss_mb()
    reset = _reset_peak()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    masks, active = [], []
    start = time.perf_counter()
    for s in range(steps):
        data = work.batches[s * world + rank]

        def compute_loss(index=None, data=data):
            part = data if index is None else {k: v[index] for k, v in data.items()}
            return work.loss(forward, part)

        if engine is None:
            opt.zero_grad(set_to_none=True)
            compute_loss().mean().backward()
            opt.step()
            continue
        # Under DDP the step runs inside ``no_sync`` and the engine averages the active
        # layers' gradients itself.
        ddp = forward if strategy == "ddp" else None
        result = engine.train_step(compute_loss, opt, batch_size=work.batch_size(data), ddp=ddp)
        masks.append("".join("1" if b else "0" for b in result.active_mask.tolist()))
        active.append(sum(result.pass_numel) / result.trainable_numel)
    out = {
        "strategy": strategy, "method": method, "rank": rank, "world": world, "steps": steps,
        "batch": batch, "seq": seq,
        "runtime_mb": runtime, "setup_mb": setup,
        "peak_mb": _rss_mb("VmHWM") if reset else float("nan"),
        "param_mb": _local_mb(model.parameters()), "optimizer_state_mb": _local_mb(state),
        "masks": masks, "active_ratio": statistics.mean(active) if active else 1.0,
        "seconds": time.perf_counter() - start,
    }  # fmt: skip
    out["training_mb"] = out["peak_mb"] - runtime
    if cuda:
        torch.cuda.synchronize()
        out["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / MB
    dist.destroy_process_group()
    return out


# -- the launcher ---------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    strategy: str, method: str, steps: int, world: int, threads: int, returned: bool = False,
    shape: tuple[int, int] = SHAPES["8x128"],
) -> list[dict]:  # fmt: skip
    """One configuration in ``world`` fresh processes; their results in rank order.
    ``returned``: with :data:`RETURNED`'s allocator settings."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, **(RETURNED if returned else {}), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(rank)}  # fmt: skip
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--strategy",
                   strategy, "--method", method, "--steps", str(steps), "--threads",
                   str(threads), "--batch", str(shape[0]), "--seq", str(shape[1])]  # fmt: skip
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    results = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=900)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            _ = [other.kill() for other in procs if other.poll() is None]
            raise RuntimeError(f"{strategy}/{method} rank {rank} failed:\n{err[-3000:]}")
        results.append(json.loads(lines[-1]))
    return results


def machine() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(ln.split(":", 1)[1].strip() for ln in handle if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": sys.version.split()[0], "torch": torch.__version__, "cuda": gpu}  # fmt: skip


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--returned-runs", type=int, default=1, choices=[0, 1],
                        help="a run per configuration with freed memory returned")  # fmt: skip
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--shapes", default=",".join(SHAPES), help="batch per rank x tokens:"
                        f" {', '.join(SHAPES)}; the JSON's other shapes are kept")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--notes", default=NOTES, help="a file whose text ends the report")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=128, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        shape = (args.batch, args.seq)
        print(json.dumps(worker(args.strategy, args.method, args.steps, args.threads, *shape)))
        return None
    world, shapes = 2, args.shapes.split(",")
    strategies, methods = args.strategies.split(","), args.methods.split(",")
    result = {
        "description": "small Llama (hidden 384, 6 layers, 14.1M parameters, vocabulary 8192,"
        " tied embeddings), causal LM on random tokens, random init",
        "world": world, "threads": args.threads, "goal": GOAL, "returned_env": RETURNED,
        "machine": machine(), "shapes": {},
    }  # fmt: skip
    for name in shapes:
        start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)[:2]
        runs: dict = {s: {m: [] for m in methods} for s in strategies}
        returned: dict = {s: {} for s in strategies}
        for repeat in range(args.repeats + args.returned_runs):  # a slow spell hits all configs
            back = repeat == args.repeats
            for strategy in strategies:
                for method in methods:
                    ranks = launch(strategy, method, args.steps, world, args.threads, back,
                                   SHAPES[name])  # fmt: skip
                    (returned[strategy].__setitem__(method, ranks) if back
                     else runs[strategy][method].append(ranks))  # fmt: skip
                    values = " / ".join(f"{r['training_mb']:.0f}" for r in ranks)
                    label = "freed returned" if back else f"run {repeat + 1}"
                    print(f"  {name} {label}: {strategy}/{method}: {values} MB", flush=True)
        cpu_now = resource.getrusage(resource.RUSAGE_CHILDREN)[:2]
        result["shapes"][name] = {
            "batch_per_rank": SHAPES[name][0], "seq": SHAPES[name][1], "steps": args.steps,
            "repeats": args.repeats, "threads": args.threads, "runs": runs, "returned": returned,
            "command": "python benchmarks/fsdp2_memory.py" + "".join(f" {a}" for a in argv or []),
            "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "minutes": (time.perf_counter() - start) / 60, "machine": result["machine"],
            "cpu_minutes": (sum(cpu_now) - sum(cpu)) / 60,
        }  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "fsdp2_memory")
    if os.path.exists(stem + ".json"):  # keep the shapes not run now as they were
        with open(stem + ".json") as handle:
            result = merge(json.load(handle), result)
    for entry in result["shapes"].values():  # (recomputed: same numbers, current fields)
        entry["summary"] = summarize(entry["runs"], entry["returned"], GOAL)
        entry["estimate"] = estimate(entry["batch_per_rank"], entry["seq"], world)
    result.pop("notes", None)
    if args.notes and os.path.exists(args.notes):
        with open(args.notes) as handle:
            result["notes"] = handle.read().strip()
    with open(stem + ".json", "w") as handle:
        json.dump(result, handle, indent=2)
    with open(stem + ".md", "w") as handle:
        handle.write(render(result))
    print(render(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
