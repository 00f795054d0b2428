"""Per-rank peak memory of SAM and SL-SAM under FSDP2 and DDP, on 2 gloo processes.

    python benchmarks/fsdp2_memory.py            # or `make bench-fsdp2`; ~15 min, 2 CPU cores

Trains the benchmark's small Llama (``models.py``'s ``llama``) with AdamW (the reference),
SAM and SL-SAM (the paper's defaults) through the library's engine in a plain loop:

* ``ddp`` -- the whole model on every rank, wrapped in ``DistributedDataParallel``; the SAM
  methods run inside ``no_sync`` with the engine's ``GradientAverager`` (only the active
  layers' gradients travel), as the Lightning driver does; AdamW lets DDP reduce;
* ``fsdp2`` -- ``fully_shard`` on every decoder layer, then the root, over a 1-D mesh of the
  processes; the engine is built after sharding and works on the local shards.

Every configuration runs ``--repeats`` times in fresh processes, each rank measuring as
``memory.py`` does: on a CPU, its RSS high-water mark (VmHWM, reset after setup) minus its
runtime RSS (after the imports and the process group, before the model exists), the
optimizer state of every parameter allocated first (one AdamW step, zero gradients, lr 0);
on CUDA, ``torch.cuda.max_memory_allocated`` too. One more run per configuration has glibc
return freed blocks to the OS (``RETURNED``), so its RSS follows the live memory. Both ranks
use SL-SAM's seed 0, so they draw the same layers (checked). Writes
``results/fsdp2_memory.{json,md}``.
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

from memory import _reset_peak, _rss_mb  # the same RSS readings as memory.py

HERE = os.path.dirname(os.path.abspath(__file__))
STRATEGIES = ("ddp", "fsdp2")
METHODS = ("adamw", "sam", "slsam")
GOAL = 0.85  # SL-SAM's per-rank peak / SAM's, under each strategy
MB = 2**20
#: glibc told to unmap every block over 128 KiB when freed: the RSS then follows live memory.
RETURNED = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
#: Hand-written analysis appended to the report (kept beside the results).
NOTES = os.path.join(HERE, "results", "fsdp2_memory.notes.md")


# -- one rank ---------------------------------------------------------------------------
def _local_mb(tensors) -> float:
    local = [getattr(t, "to_local", lambda t=t: t)() for t in tensors]  # FSDP2: the shard
    return sum(t.numel() * t.element_size() for t in local) / MB


def worker(strategy: str, method: str, steps: int, threads: int) -> dict:
    """One rank's run (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` in the env)."""
    import torch
    import torch.distributed as dist
    from models import make_workload
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaForCausalLM  # noqa: F401  (its import is runtime, not training)

    from lightning_slsam import make_engine
    from lightning_slsam.distributed import GradientAverager
    from lightning_slsam.passes import PlainLoopPasses, StepContext

    torch.set_num_threads(threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = "cuda" if cuda else "cpu"
    runtime = _rss_mb()
    work = make_workload("llama", steps * world, device)  # rank r trains batches r, r+w, ...
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
    averager = GradientAverager() if strategy == "ddp" else None
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
        batch = work.batches[s * world + rank]

        def compute_loss(index=None, batch=batch):
            part = batch if index is None else {k: v[index] for k, v in batch.items()}
            return work.loss(forward, part)

        if engine is None:
            opt.zero_grad(set_to_none=True)
            compute_loss().mean().backward()
            opt.step()
            continue
        if strategy == "fsdp2":
            result = engine.train_step(compute_loss, opt, batch_size=work.batch_size(batch))
        else:
            with forward.no_sync():  # the engine averages the active layers' gradients
                result = engine.step(
                    PlainLoopPasses(compute_loss, work.batch_size(batch)),
                    lambda: opt.zero_grad(set_to_none=True),
                    lambda skip: None if skip else opt.step(),
                    StepContext(averager=averager),
                )
        masks.append("".join("1" if b else "0" for b in result.active_mask.tolist()))
        active.append(sum(result.pass_numel) / result.trainable_numel)
    out = {
        "strategy": strategy, "method": method, "rank": rank, "world": world, "steps": steps,
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
    strategy: str, method: str, steps: int, world: int, threads: int, returned: bool = False
) -> list[dict]:
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
                   str(threads)]  # fmt: skip
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


# -- the pure part: medians, ratios, the goal, the table ------------------------------
def summarize(runs: dict, returned: dict | None = None, goal: float = GOAL) -> dict:
    """``runs[strategy][method]``: a list of repeats, each the ranks' result dicts;
    ``returned[strategy][method]``: the ranks' results of the run with :data:`RETURNED`.

    Returns per configuration the median over repeats of the per-rank peak training MB
    and of its max over ranks, the ratios to SAM (same strategy) and FSDP2 / DDP (same
    method), the peak with freed memory returned (max over ranks) and its ratio to SAM, and
    the goal's verdict per strategy (SL-SAM / SAM <= ``goal``, on the default RSS peak)."""
    returned = returned or {}
    rows: dict = {}
    for strategy, methods in runs.items():
        for method, repeats in methods.items():
            peaks = [max(r["training_mb"] for r in ranks) for ranks in repeats]
            world = len(repeats[0])
            rank_values = [[ranks[i]["training_mb"] for ranks in repeats] for i in range(world)]
            setup = [max(r["setup_mb"] - r["runtime_mb"] for r in ranks) for ranks in repeats]
            rows.setdefault(strategy, {})[method] = {
                "peak_mb": statistics.median(peaks),
                "repeats_mb": peaks,
                "per_rank_mb": [statistics.median(v) for v in rank_values],
                "setup_mb": statistics.median(setup),
                "param_mb": repeats[0][0].get("param_mb"),
                "optimizer_state_mb": repeats[0][0].get("optimizer_state_mb"),
                "active_ratio": repeats[0][0].get("active_ratio"),
                "masks_agree": all(len({str(r.get("masks")) for r in rs}) == 1 for rs in repeats),
            }
            ranks = returned.get(strategy, {}).get(method)
            if ranks:
                row = rows[strategy][method]
                row["returned_mb"] = max(r["training_mb"] for r in ranks)
                row["returned_per_rank_mb"] = [r["training_mb"] for r in ranks]
                row["returned_setup_mb"] = max(r["setup_mb"] - r["runtime_mb"] for r in ranks)
    for methods in rows.values():
        sam = methods.get("sam", {})
        for method, row in methods.items():
            for key, ratio in (("peak_mb", "ratio_to_sam"), ("returned_mb", "returned_to_sam")):
                base = sam.get(key)
                row[ratio] = row[key] / base if base and key in row else None
            ddp = rows.get("ddp", {}).get(method, {}).get("peak_mb")
            fsdp2 = rows.get("fsdp2", {}).get(method, {}).get("peak_mb")
            row["fsdp2_over_ddp"] = fsdp2 / ddp if fsdp2 and ddp else None
    verdict = {}
    for strategy, methods in rows.items():
        ratio = methods.get("slsam", {}).get("ratio_to_sam")
        if ratio is not None:
            verdict[strategy] = {"ratio": ratio, "goal": goal, "met": ratio <= goal}
    return {"rows": rows, "goal": verdict}


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(result: dict) -> str:
    """The markdown report of :func:`main`'s result."""
    summary, m = result["summary"], result["machine"]
    world, batch = result["world"], result["batch_per_rank"]
    malloc = " ".join(f"{k}={v}" for k, v in result.get("malloc_env", {}).items())
    lines = [
        "# SAM and SL-SAM under FSDP2 and DDP: per-rank peak memory",
        "",
        f"{result['description']}; {world} gloo processes, each training its own batch of"
        f" {batch} (global {batch * world}), {result['steps']} steps, {result['threads']} thread"
        f" per process; median of {result['repeats']} runs in fresh processes. Per rank, as"
        " `memory.py`: the peak RSS while training (VmHWM, reset after setup) minus the"
        " runtime RSS (after the imports and the process group, before the model exists), the"
        " optimizer state of every parameter allocated first. DDP: the whole model on every"
        " rank, the SAM methods' gradients averaged by the engine inside `no_sync`; FSDP2:"
        " `fully_shard` on every decoder layer and the root over a 1-D mesh. SL-SAM: the"
        " paper's defaults (layer ratio 0.2), seed 0 on every rank.",
        "",
        f"Command: `{result['command']}`{f' with {malloc}' if malloc else ''}"
        f" ({result['minutes']:.1f} minutes, {result.get('cpu_minutes', 0):.1f} CPU minutes)."
        f" Date: {result['date']}. Machine: {m['cpu']},"
        f" {m['cores']} cores, {m['platform']}, Python {m['python']}, torch {m['torch']},"
        f" GPU: {m['cuda'] or 'none'}.",
        "",
        "| strategy | method | peak training MB (max of ranks) | runs | per rank | / SAM"
        " | FSDP2 / DDP | freed returned: peak MB | per rank | / SAM | before training"
        " | active ratio |",
        "|---|---|" + "---:|" * 10,
    ]
    for strategy, methods in summary["rows"].items():
        for method, row in methods.items():
            runs = ", ".join(f"{v:.0f}" for v in row["repeats_mb"])
            back = " / ".join(f"{v:.0f}" for v in row.get("returned_per_rank_mb", []))
            lines.append(
                f"| {strategy} | {method} | {row['peak_mb']:.0f} | {runs}"
                f" | {' / '.join(f'{v:.0f}' for v in row['per_rank_mb'])}"
                f" | {_f(row['ratio_to_sam'])} | {_f(row['fsdp2_over_ddp'])}"
                f" | {_f(row.get('returned_mb'), 0)} | {back or '-'}"
                f" | {_f(row.get('returned_to_sam'))} | {_f(row.get('returned_setup_mb'), 0)}"
                f" | {_f(row['active_ratio'])} |"
            )
    lines += [
        "",
        "MB are MiB. *Runs*: each run's max over ranks. *Freed returned*: one more run per"
        " configuration, measured the same way, with glibc told to give every freed block over"
        f" 128 KiB back to the OS ({' '.join(f'{k}={v}' for k, v in RETURNED.items())}): the"
        " RSS then follows the live memory (the CPU counterpart of"
        " `torch.cuda.max_memory_allocated`) instead of keeping the heap that the default"
        " allocator grows and keeps; *before training*: that run's setup RSS above the runtime"
        " (weights, optimizer state, written buffers). *Active ratio*: parameter fraction with"
        " a gradient, summed over a step's passes.",
        "",
        f"## Goal: SL-SAM's per-rank peak <= {result['goal']:.2f}x SAM's, same strategy",
        "",
        "| strategy | SL-SAM / SAM | SL-SAM / SAM, freed returned | goal | |",
        "|---|---:|---:|---:|---|",
    ]
    for strategy, v in summary["goal"].items():
        mark = "met" if v["met"] else "**missed**"
        back = summary["rows"][strategy]["slsam"].get("returned_to_sam")
        lines.append(f"| {strategy} | {v['ratio']:.3f} | {_f(back)} | {v['goal']:.2f} | {mark} |")
    agree = all(r["masks_agree"] for ms in summary["rows"].values() for r in ms.values())
    lines += ["", f"Both ranks drew the same layers every step: {'yes' if agree else '**no**'}."]
    if result.get("notes"):
        lines += ["", result["notes"]]
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--notes", default=NOTES, help="a file whose text ends the report")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.strategy, args.method, args.steps, args.threads)))
        return None
    world, start = 2, time.perf_counter()
    strategies, methods = args.strategies.split(","), args.methods.split(",")
    runs: dict = {s: {m: [] for m in methods} for s in strategies}
    returned: dict = {s: {} for s in strategies}
    for repeat in range(args.repeats + args.returned_runs):  # a slow spell hits every config
        back = repeat == args.repeats
        for strategy in strategies:
            for method in methods:
                ranks = launch(strategy, method, args.steps, world, args.threads, back)
                if back:
                    returned[strategy][method] = ranks
                else:
                    runs[strategy][method].append(ranks)
                values = " / ".join(f"{r['training_mb']:.0f}" for r in ranks)
                label = "freed returned" if back else f"run {repeat + 1}"
                print(f"  {label}: {strategy}/{method}: {values} MB", flush=True)
    result = {
        "description": "small Llama (hidden 384, 6 layers, 14.1M parameters, vocabulary 8192,"
        " tied embeddings), causal LM on random tokens of length 128, random init",
        "world": world, "batch_per_rank": 8, "steps": args.steps, "repeats": args.repeats,
        "threads": args.threads, "goal": GOAL, "runs": runs,
        "returned": returned, "returned_env": RETURNED, "summary": summarize(runs, returned),
        "command": "python benchmarks/fsdp2_memory.py" + "".join(f" {a}" for a in argv or []),
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "minutes": (time.perf_counter() - start) / 60, "machine": machine(),
        "cpu_minutes": sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2]) / 60,
    }  # fmt: skip
    if args.notes and os.path.exists(args.notes):
        with open(args.notes) as handle:
            result["notes"] = handle.read().strip()
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "fsdp2_memory")
    with open(stem + ".json", "w") as handle:
        json.dump(result, handle, indent=2)
    with open(stem + ".md", "w") as handle:
        handle.write(render(result))
    print(render(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
