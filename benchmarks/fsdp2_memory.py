"""Per-rank peak memory of SAM and SL-SAM under FSDP2 and DDP, on 2 gloo processes.

    python benchmarks/fsdp2_memory.py            # or `make bench-fsdp2`; ~30 min, 2 CPU cores
    python benchmarks/fsdp2_memory.py --shapes 2x32   # one shape; the others' results kept
    python benchmarks/fsdp2_memory.py --routes trainer --shapes 2x32   # the Trainer's rows

Trains the benchmark's small Llama (``models.py``'s ``llama``) with AdamW (the reference),
SAM and SL-SAM (the paper's defaults) through two routes (``--routes``). ``loop``, the
library's engine in a plain loop, under two strategies:

* ``ddp`` -- the whole model on every rank, wrapped in ``DistributedDataParallel``; the SAM
  methods run inside ``no_sync`` with the engine's ``GradientAverager`` (only the active
  layers' gradients travel), as the Lightning driver does; AdamW lets DDP reduce;
* ``fsdp2`` -- ``fully_shard`` on every decoder layer, then the root, over a 1-D mesh of the
  processes; the engine is built after sharding and works on the local shards.

``trainer``, the Hugging Face Trainer under accelerate's FSDP2 (``fsdp="full_shard
auto_wrap"``, ``fsdp_version`` 2, wrapping the decoder layers): ``transformers.Trainer`` for
AdamW, ``lightning_slsam.hf.SAMTrainer`` for the SAM methods, the same optimizer (torch's
AdamW, lr 1e-4, weight decay 0.01, constant, no clipping) and token stream, the Trainer's
own loss (the model's, from ``labels``).

Two shapes, batch per rank x tokens (``--shapes``): ``8x128``, where the activations (the
logits over the 8192-token vocabulary above all) outweigh the weights, gradients and AdamW
state, and ``2x32``, where those parameter-sized tensors outweigh the activations many times,
as in the paper's LLM fine-tuning (Llama-3.2-3B, batch 2 x 1024 tokens). Both use the same
token stream (the first ``batch`` x ``seq`` of the same random batches).

Every configuration runs ``--repeats`` times in fresh processes, each rank measuring as
``memory.py`` does: on a CPU, its RSS high-water mark (VmHWM, reset after setup) minus its
runtime RSS (after the imports and the process group, before the model exists), the
optimizer state of every parameter allocated first (one AdamW step, zero gradients, lr 0);
on CUDA, ``torch.cuda.max_memory_allocated`` too. The Trainer sets up inside ``train()``
(sharding, the optimizer, SAMTrainer's engine rebuilt on the shards at its first step), so
on that route a callback allocates the optimizer state when training begins, resets the
peak after a first, warm-up optimizer step and reads it after the ``--steps`` that follow,
for AdamW as for the SAM methods. One more run per configuration has glibc return freed
blocks to the OS (``RETURNED``), so its RSS follows the live memory. Both ranks use
SL-SAM's seed 0, so they draw the same layers (checked). Writes
``results/fsdp2_memory.{json,md}``, merging the routes and shapes run into the JSON already
there. The pure part (ratios, verdicts, the tables) is ``fsdp2_memory_report.py``.
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

from fsdp2_memory_report import (
    GOAL,
    LOOP,
    RETURNED,
    TRAINER,
    entry_name,
    merge,
    render,
    shape_name,
    summarize,
)
from memory import _reset_peak, _rss_mb  # the same RSS readings as memory.py

__all__ = ["GOAL", "RETURNED", "ROUTES", "estimate", "launch", "main", "plan", "render",
           "save", "summarize", "worker"]  # fmt: skip

HERE = os.path.dirname(os.path.abspath(__file__))
#: Each route's strategies (its front-end, :data:`LOOP` or :data:`TRAINER`, with each).
ROUTES = {LOOP: ("ddp", "fsdp2"), TRAINER: ("fsdp2",)}
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


class _Meter:
    """One rank's readings, as ``memory.py`` takes them: the runtime RSS when built (after
    the imports and the process group, before the model exists), the setup RSS and the
    peak's reset at :meth:`start`, the peak (and on CUDA the allocator's) at :meth:`stop`."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda.is_available()
        self.runtime = _rss_mb()
        self.setup = self.peak = float("nan")
        self.reset, self.seconds = False, 0.0
        self.cuda_mb: float | None = None

    def start(self) -> None:
        import torch

        self.setup = _rss_mb()
        self.reset = _reset_peak()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.began = time.perf_counter()

    def stop(self) -> None:
        import torch

        self.seconds = time.perf_counter() - self.began
        self.peak = _rss_mb("VmHWM") if self.reset else float("nan")
        if self.cuda:
            torch.cuda.synchronize()
            self.cuda_mb = torch.cuda.max_memory_allocated() / MB


def _join(threads: int) -> tuple[int, int, str]:
    """Joins the process group (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` in the
    env); returns the rank, the world size and the device."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank, world_size=world)
    return rank, world, "cuda" if cuda else "cpu"


def _allocate_state(optimizer) -> None:
    """Steady state: optimizer state for every parameter (one step with zero gradients and
    lr 0), so that a layer sampler is not measured before its layers' first draw."""
    import torch

    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def _draw(result) -> tuple[str, float]:
    """A SAM method's step: its active layers (a 0/1 string) and active ratio."""
    mask = "".join("1" if b else "0" for b in result.active_mask.tolist())
    return mask, sum(result.pass_numel) / result.trainable_numel


def _result(meter: _Meter, model, optimizer, draws: list, **config) -> dict:
    """One rank's result: ``config`` (route, strategy, ...), the meter's readings, the
    local parameter and optimizer-state sizes, and the SAM method's draws."""
    import torch
    import torch.distributed as dist

    state = [v for s in optimizer.state.values() for v in s.values()
             if torch.is_tensor(v) and v.dim()]  # fmt: skip
    out = {
        **config, "rank": dist.get_rank(), "world": dist.get_world_size(),
        "runtime_mb": meter.runtime, "setup_mb": meter.setup, "peak_mb": meter.peak,
        "param_mb": _local_mb(model.parameters()), "optimizer_state_mb": _local_mb(state),
        "masks": [mask for mask, _ in draws],
        "active_ratio": statistics.mean(ratio for _, ratio in draws) if draws else 1.0,
        "seconds": meter.seconds, "training_mb": meter.peak - meter.runtime,
    }  # fmt: skip
    if meter.cuda_mb is not None:
        out["cuda_max_allocated_mb"] = meter.cuda_mb
    return out


def worker(route: str, strategy: str, method: str, steps: int, threads: int, batch: int,
           seq: int) -> dict:  # fmt: skip
    """One rank's run of a route (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` in the
    env)."""
    import torch.distributed as dist

    run = loop_worker if route == LOOP else trainer_worker
    out = run(strategy, method, steps, threads, batch, seq)
    dist.destroy_process_group()
    return out


def loop_worker(strategy: str, method: str, steps: int, threads: int, batch: int,
                seq: int) -> dict:  # fmt: skip
    """The library's engine in a plain loop (AdamW: the optimizer alone)."""
    import torch
    from models import make_workload
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaForCausalLM  # noqa: F401  (its import is runtime, not training)

    from lightning_slsam import make_engine

    rank, world, device = _join(threads)
    meter = _Meter()
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
    _allocate_state(opt)
    meter.start()
    draws = []
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
        draws.append(_draw(result))
    meter.stop()
    return _result(meter, model, opt, draws, route=LOOP, strategy=strategy, method=method,
                   steps=steps, batch=batch, seq=seq)  # fmt: skip


class _FSDPOnCPU:
    """Keeps accelerate's FSDP plugin on CPU processes, mixed into a Trainer class (first
    among its bases). accelerate sets FSDP up on accelerators only: on CPU processes
    (``MULTI_CPU``) its ``AcceleratorState`` drops the plugin and runs DDP without a word.
    This puts the plugin back after the Trainer built its Accelerator, so that the Trainer's
    own FSDP2 path runs and is measured here (``accelerator.prepare`` -> ``fully_shard`` by
    decoder layer, its backward, its optimizer step); on GPUs it changes nothing."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state  # type: ignore[attr-defined]
        plugin_args = self.args.fsdp_plugin_args  # type: ignore[attr-defined]
        if plugin_args is not None and state.distributed_type == "MULTI_CPU":
            state.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**plugin_args)
            self.is_fsdp_enabled = True


def _measuring(meter: _Meter, steps: int):
    """The Trainer's callback that measures like the loop: the optimizer state of every
    parameter allocated when training begins, the peak reset after the first (warm-up)
    optimizer step, read after the ``steps`` after it; a SAM method's draws recorded."""
    from transformers import TrainerCallback

    class Measuring(TrainerCallback):
        def __init__(self) -> None:
            self.trainer = None
            self.draws: list = []

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            _allocate_state(optimizer.optimizer)  # the torch optimizer in accelerate's wrapper

        def on_step_end(self, args, state, control, **kwargs):
            engine = getattr(self.trainer, "sam_engine", None)
            if state.global_step == 1:
                meter.start()
                return
            if engine is not None:
                self.draws.append(_draw(engine.last_result))
            if state.global_step == steps + 1:
                meter.stop()

    return Measuring()


def trainer_worker(strategy: str, method: str, steps: int, threads: int, batch: int,
                   seq: int) -> dict:  # fmt: skip
    """The Hugging Face Trainer under accelerate's FSDP2: ``transformers.Trainer`` for
    AdamW, ``SAMTrainer`` for the SAM methods, one warm-up step then ``steps`` measured."""
    import tempfile

    from models import make_workload
    from transformers import Trainer, TrainingArguments

    from lightning_slsam.hf import SAMTrainer

    if strategy != "fsdp2":
        raise ValueError(f"the {TRAINER} route runs under fsdp2 only, not {strategy!r}")
    _, world, device = _join(threads)
    # accelerate sets the thread count from the cores unless OMP_NUM_THREADS is set.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    meter = _Meter()
    work = make_workload("llama", 0, device)
    model = work.model
    # The loop's token stream, a sample per row; the sequential sampler and accelerate's
    # round-robin of batches give rank r the batches r, r+w, ... as in the loop.
    batches = _batches((steps + 1) * world, batch, seq, model.config.vocab_size, "cpu")
    data = [{"input_ids": ids, "labels": ids} for b in batches for ids in b["input_ids"]]
    layer = type(model.model.layers[0]).__name__
    wrap = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": [layer]}
    measuring = _measuring(meter, steps)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch, max_steps=steps + 1,
            optim="adamw_torch", learning_rate=1e-4, weight_decay=0.01,
            lr_scheduler_type="constant", max_grad_norm=0.0, seed=0,
            train_sampling_strategy="sequential", dataloader_num_workers=0,
            fsdp="full_shard auto_wrap", fsdp_config=wrap, use_cpu=device == "cpu",
            save_strategy="no", logging_strategy="no", report_to=[], disable_tqdm=True,
        )  # fmt: skip
        base = Trainer if method == "adamw" else SAMTrainer
        kind = type(f"{base.__name__}OnCPU", (_FSDPOnCPU, base), {})
        sam = {} if method == "adamw" else {"sam": method}
        trainer = kind(model=model, args=args, train_dataset=data, callbacks=[measuring], **sam)
        measuring.trainer = trainer
        trainer.train()
    return _result(meter, trainer.model, trainer.optimizer.optimizer, measuring.draws,
                   route=TRAINER, strategy=strategy, method=method, steps=steps, batch=batch,
                   seq=seq)  # fmt: skip


# -- the launcher ---------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    strategy: str, method: str, steps: int, world: int, threads: int, returned: bool = False,
    shape: tuple[int, int] = SHAPES["8x128"], route: str = LOOP,
) -> list[dict]:  # fmt: skip
    """One configuration in ``world`` fresh processes; their results in rank order.
    ``returned``: with :data:`RETURNED`'s allocator settings."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, **(RETURNED if returned else {}), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(rank)}  # fmt: skip
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--route", route,
                   "--strategy", strategy, "--method", method, "--steps", str(steps), "--threads",
                   str(threads), "--batch", str(shape[0]), "--seq", str(shape[1])]  # fmt: skip
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    results = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=900)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            _ = [other.kill() for other in procs if other.poll() is None]
            raise RuntimeError(f"{route} {strategy}/{method} rank {rank} failed:\n{err[-3000:]}")
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


def plan(routes: str, strategies: str | None = None) -> dict[str, list[str]]:
    """The strategies each route asked for runs (``routes``, ``strategies``: the options'
    comma-separated names; no ``strategies``: each route's own, :data:`ROUTES`)."""
    chosen = {}
    for route in routes.split(","):
        if route not in ROUTES:
            raise ValueError(f"unknown route {route!r}; choose from {', '.join(ROUTES)}")
        asked = strategies.split(",") if strategies else ROUTES[route]
        chosen[route] = [s for s in asked if s in ROUTES[route]]
        if not chosen[route]:
            raise ValueError(f"the {route} route runs under {', '.join(ROUTES[route])} only")
    return chosen


def measure(route: str, name: str, strategies: list[str], methods: list[str],
            args: argparse.Namespace, world: int, argv: list[str] | None) -> dict:  # fmt: skip
    """One route at one shape: every strategy and method, ``args.repeats`` runs each (then
    one with freed memory returned), interleaved so that a slow spell hits them all."""
    start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)[:2]
    runs: dict = {s: {m: [] for m in methods} for s in strategies}
    returned: dict = {s: {} for s in strategies}
    for repeat in range(args.repeats + args.returned_runs):
        back = repeat == args.repeats
        for strategy in strategies:
            for method in methods:
                ranks = launch(strategy, method, args.steps, world, args.threads, back,
                               SHAPES[name], route)  # fmt: skip
                (returned[strategy].__setitem__(method, ranks) if back
                 else runs[strategy][method].append(ranks))  # fmt: skip
                values = " / ".join(f"{r['training_mb']:.0f}" for r in ranks)
                label = "freed returned" if back else f"run {repeat + 1}"
                print(f"  {name} {route} {label}: {strategy}/{method}: {values} MB", flush=True)
    cpu_now = resource.getrusage(resource.RUSAGE_CHILDREN)[:2]
    return {
        "route": route, "batch_per_rank": SHAPES[name][0], "seq": SHAPES[name][1],
        "steps": args.steps, "repeats": args.repeats, "threads": args.threads, "runs": runs,
        "returned": returned,
        "command": "python benchmarks/fsdp2_memory.py" + "".join(f" {a}" for a in argv or []),
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "minutes": (time.perf_counter() - start) / 60, "machine": machine(),
        "cpu_minutes": (sum(cpu_now) - sum(cpu)) / 60,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--returned-runs", type=int, default=1, choices=[0, 1],
                        help="a run per configuration with freed memory returned")  # fmt: skip
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--routes", default=",".join(ROUTES), help="front-ends:"
                        f" {', '.join(ROUTES)}; the JSON's other routes are kept")  # fmt: skip
    each = "; ".join(f"{route}: {', '.join(s)}" for route, s in ROUTES.items())
    parser.add_argument("--strategies", help=f"default: each route's ({each})")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="batch per rank x tokens:"
                        f" {', '.join(SHAPES)}; the JSON's other shapes are kept")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--notes", default=NOTES, help="a file whose text ends the report")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--route", default=LOOP, help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=128, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        shape = (args.batch, args.seq)
        out = worker(args.route, args.strategy, args.method, args.steps, args.threads, *shape)
        print(json.dumps(out))
        return None
    world, shapes, methods = 2, args.shapes.split(","), args.methods.split(",")
    try:
        routes = plan(args.routes, args.strategies)
    except ValueError as error:
        parser.error(str(error))
    result = {
        "description": "small Llama (hidden 384, 6 layers, 14.1M parameters, vocabulary 8192,"
        " tied embeddings), causal LM on random tokens, random init",
        "world": world, "threads": args.threads, "goal": GOAL, "returned_env": RETURNED,
        "machine": machine(), "shapes": {},
    }  # fmt: skip
    for name in shapes:
        for route, strategies in routes.items():
            key = entry_name(route, *SHAPES[name])
            result["shapes"][key] = measure(route, name, strategies, methods, args, world, argv)
    return save(result, args.out, args.notes)


def _order(entry: dict) -> tuple[int, int]:
    shape = shape_name(entry["batch_per_rank"], entry["seq"])
    shapes, routes = list(SHAPES), list(ROUTES)
    return (shapes.index(shape) if shape in shapes else len(shapes),
            routes.index(entry["route"]) if entry["route"] in routes else len(routes))  # fmt: skip


def save(result: dict, out: str, notes: str | None = NOTES) -> dict:
    """Merges ``result`` into ``out``'s ``fsdp2_memory.json`` (the entries it holds replace
    the same route at the same shape; the others stay), orders the entries by shape, then
    route, summarizes each, appends the ``notes`` file's text, and writes the JSON and the
    markdown report. Given the saved results' own fields and no entries, it re-renders
    them (after the notes changed, say)."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, "fsdp2_memory")
    if os.path.exists(stem + ".json"):  # keep the shapes and routes not run now as they were
        with open(stem + ".json") as handle:
            result = merge(json.load(handle), result)
    result["shapes"] = dict(sorted(result["shapes"].items(), key=lambda kv: _order(kv[1])))
    estimates: dict = {}  # (recomputed: same numbers, current fields)
    for entry in result["shapes"].values():
        entry["summary"] = summarize(entry["runs"], entry["returned"], GOAL)
        shape = (entry["batch_per_rank"], entry["seq"])
        if shape not in estimates:
            estimates[shape] = estimate(*shape, result["world"])
        entry["estimate"] = estimates[shape]
    result.pop("notes", None)
    if notes and os.path.exists(notes):
        with open(notes) as handle:
            result["notes"] = handle.read().strip()
    with open(stem + ".json", "w") as handle:
        json.dump(result, handle, indent=2)
    with open(stem + ".md", "w") as handle:
        handle.write(render(result))
    print(render(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
