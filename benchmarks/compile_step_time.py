"""Eager against ``torch.compile`` step time of AdamW, SAM, SL-SAM and ``SparseLayerSAM()``.

For each model and method two copies of the same initial model train on the same batches:
one eager, one with its repeated blocks compiled in place (regional compilation,
:func:`lightning_slsam.core.regions.compile_blocks`). A layer-sampling method's engine is
built after compiling, so each compiled block is one layer of its partition (drawn, frozen
and trained whole) and the compiled run's sparsity can differ from the eager run's.

Every compiled method first runs its warm-up steps (the compile happens there), then the
timed steps of every eager and compiled method are interleaved in one process, in a rotating
order (``step_time.interleaved``), so a noisy machine slows all of them alike. The backend
is wrapped to count the graphs it compiles: during warm-up, and during the timed steps
(where a graph is a recompile, reported, not hidden).

    python benchmarks/compile_step_time.py                  # (or `make bench-compile`)
    # all three CPU models x 4 methods: estimated at 20-25 minutes on 2 quiet CPU cores
    # (inductor's compile: several minutes per model). Models with a transformers config
    # train with `use_cache=False`, eager and compiled alike: with a key-value cache each
    # decoder layer compiles a graph of its own (the cache update guards on its index).
    python benchmarks/compile_step_time.py --models minilm --methods sam,slsam_paper \\
        --backend aot_eager --steps 3 --warmup 3            # a quick check
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import gc
import json
import logging
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch._inductor.utils import fresh_cache

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import step_time  # noqa: E402
from models import make_workload  # noqa: E402

from lightning_slsam.core.regions import compile_blocks  # noqa: E402

MODELS = "minilm,vit,llama"
METHODS = "adamw,sam,slsam_paper,slsam"
#: The layer-sampling methods checked: the paper's SL-SAM and SparseLayerSAM().
LABELS = {"slsam_paper": "SL-SAM", "slsam": "SparseLayerSAM()"}
#: The goals checked per model, for each layer-sampling method measured.
MIN_SPEEDUP = 1.2  # compiled SL-SAM at least this much faster than eager SL-SAM
MAX_RATIO_GAIN = 0.05  # compiled SL-SAM/SAM at most eager SL-SAM/SAM + this
RECOMPILE_LIMIT = 256
#: torch's own compile timers (torch._dynamo.utils.compilation_time_metrics): a frame's
#: whole compile (dynamo, AOTAutograd, the backend's forward) and a lazily compiled backward.
COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


class CountingBackend:
    """A ``torch.compile`` backend: ``name``'s (``inductor``, ``aot_eager``, ...), counting
    the graphs it is handed (each a new graph or a recompile)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs += 1
        return lookup_backend(self.name)(gm, example_inputs)


class LimitHits(logging.Handler):
    """Dynamo's "hit config.recompile_limit" warnings (a code object then runs uncompiled)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.where = ""
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "hit config." in message:
            self.hits.append(f"{self.where}: {message.splitlines()[0]}")


def _timed(step: Callable, batch: dict) -> float:
    step_time._sync()
    start = time.perf_counter()
    step(batch)
    step_time._sync()
    return time.perf_counter() - start


def _compile_seconds() -> float:
    """Seconds torch has spent compiling since the last ``torch._dynamo.reset()``."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(sum(compilation_time_metrics.get(key, ())) for key in COMPILE_TIMERS)


def _engine_info(step: Callable) -> dict:
    engine = step.engine
    if engine is None:
        return {"active_ratio": None, "num_layers": None, "layer_names": None}
    return {
        "active_ratio": engine.mean_active_ratio,
        "num_layers": engine.partition.num_layers,
        "layer_names": list(engine.partition.names),
    }


def measure(
    model_name: str,
    names: list[str],
    steps: int,
    warmup: int,
    backend: str,
    limits: LimitHits,
    lr: float = 1e-4,
    rho: float = 0.01,
    ratio: float = 0.2,
    device: str = "cpu",
) -> dict:
    """Eager and regionally compiled step times of ``names`` on ``model_name``."""
    work = make_workload(model_name, warmup + steps, device)
    config = getattr(work.model, "config", None)
    if getattr(config, "use_cache", False):
        # Training needs no key-value cache, and with one every decoder layer compiles a
        # graph of its own (the cache update guards on the layer's index): both modes off.
        config.use_cache = False
    warm, timed = work.batches[:warmup], work.batches[warmup:]
    eager, compiled, counters, blocks = {}, {}, {}, []
    for name in names:
        eager[name] = step_time.make_step(name, work, copy.deepcopy(work.model), lr, rho, ratio)
        model = copy.deepcopy(work.model)
        counters[name] = CountingBackend(backend)
        blocks = compile_blocks(model, backend=counters[name])  # before the engine's partition
        compiled[name] = step_time.make_step(name, work, model, lr, rho, ratio)
    rows: dict[str, dict] = {}
    for name in names:
        print(f"  warm-up {name}: {warmup} eager, {warmup} compiled steps", flush=True)
        limits.where = f"{model_name}/{name} warm-up"
        eager_warm = [_timed(eager[name], b) for b in warm]
        # Each method compiles cold: a fresh inductor cache (on disk and in memory), so it
        # reuses no kernel that an earlier method built. Kept until the run's cache goes.
        compiling = _compile_seconds()
        with fresh_cache(dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"), delete=False):
            compiled_warm = [_timed(compiled[name], b) for b in warm]
        compile_s = _compile_seconds() - compiling
        graphs = counters[name].graphs
        print(
            f"    compiled: {', '.join(f'{t:.1f}s' for t in compiled_warm)}; {graphs} graphs,"
            f" {compile_s:.1f}s compiling",
            flush=True,
        )
        rows[name] = {
            "eager": {"warmup_s": eager_warm},
            "compiled": {
                "warmup_s": compiled_warm,
                "graphs_warmup": graphs,
                "compile_s": compile_s,
            },
        }
    limits.where = f"{model_name} timed steps"
    compiling = _compile_seconds()
    modes = {"eager": eager, "compiled": compiled}
    runs = {f"{n}/{kind}": steps_of[n] for n in names for kind, steps_of in modes.items()}
    times = step_time.interleaved(runs, timed, warmup=0)
    compile_timed_s = _compile_seconds() - compiling
    for name in names:
        for kind, steps_of in modes.items():
            samples = times[f"{name}/{kind}"]
            rows[name][kind].update(
                median_s=statistics.median(samples), min_s=min(samples), max_s=max(samples),
                samples=samples, **_engine_info(steps_of[name]),
            )  # fmt: skip
        c = rows[name]["compiled"]
        c["graphs_timed"] = counters[name].graphs - c["graphs_warmup"]
        c["first_step_s"] = c["warmup_s"][0] if c["warmup_s"] else None
        # The warm-up's wall time beyond as many steady compiled steps (noisy; compile_s is
        # torch's own timers).
        c["warmup_excess_s"] = sum(c["warmup_s"]) - len(c["warmup_s"]) * c["median_s"]
        rows[name]["speedup"] = rows[name]["eager"]["median_s"] / c["median_s"]
    for name in names:
        rows[name]["ratio_to_sam"] = {
            kind: rows[name][kind]["median_s"] / rows["sam"][kind]["median_s"]
            if "sam" in rows
            else None
            for kind in ("eager", "compiled")
        }
    return {
        "model": model_name,
        "description": work.description,
        "compiled_blocks": blocks,
        "compile_timed_s": compile_timed_s,  # every method's, while timed: 0 without recompiles
        "steps": steps,
        "warmup": warmup,
        "methods": rows,
    }


def checks(result: dict) -> list[dict]:
    """The goals per model and layer-sampling method, with their measured values."""
    rows = []
    for model, data in result["models"].items():
        for name, label in LABELS.items():
            row = data["methods"].get(name)
            if row is None:
                continue
            speedup = row["speedup"]
            rows.append({
                "check": f"{model}: compiled {label} >= {MIN_SPEEDUP}x faster than eager {label}",
                "value": f"{speedup:.2f}x", "met": speedup >= MIN_SPEEDUP,
            })  # fmt: skip
            ratio = row["ratio_to_sam"]
            if ratio["eager"] is None:
                continue
            rows.append({
                "check": f"{model}: compiled {label}/SAM <= eager {label}/SAM + {MAX_RATIO_GAIN}",
                "value": f"{ratio['compiled']:.3f} vs {ratio['eager']:.3f} + {MAX_RATIO_GAIN}",
                "met": ratio["compiled"] <= ratio["eager"] + MAX_RATIO_GAIN,
            })  # fmt: skip
    return rows


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# Step time: eager against torch.compile (regional: each repeated block compiled)",
        "",
        f"Machine: {m['processor']}, {m['platform']}, {m['cpu_threads']} torch threads,"
        f" GPU: {m['cuda'] or 'none'}; Python {m['python']}, torch {m['torch']}."
        f" Backend `{result['backend']}`. {result['date']}.",
        f"Command: `{result['command']}` ({result['wall_s'] / 60:.1f} minutes).",
        "",
        f"Step: median of {result['steps']} timed steps, every eager and compiled method"
        " interleaved in one process in a rotating order, after"
        f" {result['warmup']} warm-up steps of each (eager and compiled, the same batches)."
        " **Compile time**: the seconds torch's own timers count compiling during the"
        " method's compiled warm-up (dynamo's whole frame compile, AOTAutograd and the"
        " backend's forward, plus the lazily compiled backward:"
        f" `{'` + `'.join(result['compile_timers'])}`), each compiled method compiling cold (a"
        " fresh inductor cache, on disk and in memory, for its warm-up: no kernel of an"
        " earlier method is reused). **Warm-up excess**: the compiled warm-up's wall time"
        f" minus {result['warmup']} x the compiled median step (compile time plus noise;"
        " the first step alone is `first_step_s` in the JSON). **Graphs**: graphs the"
        " backend compiled during warm-up / during the timed steps (a graph in the timed"
        " steps is a"
        f" recompile; dynamo's recompile limit was set to {result['recompile_limit']}). Active"
        " ratio: the engine's `mean_active_ratio` over all its steps (warm-up included);"
        " compiled, each block is one layer of the partition, so it can differ from eager."
        " Transformers models train with `config.use_cache = False` in both modes (a"
        " key-value cache makes each decoder layer a graph of its own).",
        "",
        "## Checks",
        "",
        "| check | measured | |",
        "|---|---:|---|",
    ]
    for row in result["checks"]:
        lines.append(
            f"| {row['check']} | {row['value']} | {'met' if row['met'] else '**missed**'} |"
        )
    hits = result["recompile_limit_hits"]
    lines += ["", f"Recompile limit hit: {len(hits)} time(s)." + "".join(f"\n- {h}" for h in hits)]
    for data in result["models"].values():
        lines += [
            "",
            f"## {data['description']}",
            "",
            f"Compiled blocks: {len(data['compiled_blocks'])}"
            f" (`{data['compiled_blocks'][0] if data['compiled_blocks'] else '-'}`, ...)."
            f" Compiling during the timed steps: {data['compile_timed_s']:.1f} s.",
            "",
            "| method | eager (ms) | compiled (ms) | speedup (eager/compiled) | / SAM eager"
            " | / SAM compiled | compile time (s) | warm-up excess (s) | graphs (warm-up, timed)"
            " | active ratio eager | active ratio compiled | layers eager / compiled |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, row in data["methods"].items():
            e, c = row["eager"], row["compiled"]
            layers = f"{e['num_layers'] or '-'} / {c['num_layers'] or '-'}"
            lines.append(
                f"| {name} | {_ms(e['median_s'])} | {_ms(c['median_s'])} | {row['speedup']:.2f}x"
                f" | {_num(row['ratio_to_sam']['eager'])} | {_num(row['ratio_to_sam']['compiled'])}"
                f" | {c['compile_s']:.1f} | {c['warmup_excess_s']:.1f}"
                f" | {c['graphs_warmup']}, {c['graphs_timed']}"
                f" | {_num(e['active_ratio'])} | {_num(c['active_ratio'])} | {layers} |"
            )
        for name, label in LABELS.items():
            row = data["methods"].get(name)
            if row is not None and row["ratio_to_sam"]["eager"] is not None:
                r = row["ratio_to_sam"]
                lines.append(
                    f"\n{label} / SAM: eager {r['eager']:.2f}, compiled {r['compiled']:.2f}."
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODELS, help=f"comma-separated (default {MODELS})")
    parser.add_argument("--methods", default=METHODS, help=f"comma-separated (default {METHODS})")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per method and mode")
    parser.add_argument("--warmup", type=int, default=6, help="warm-up steps (compile) per run")
    parser.add_argument("--backend", default="inductor", help="inductor, aot_eager, eager, ...")
    parser.add_argument("--layer-ratio", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--out", default=os.path.join(HERE, "results", "compile_step_time"),
        help="results stem: <out>.json and <out>.md",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    names = step_time.method_names(args.methods)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python benchmarks/compile_step_time.py", shlex.join(given)]).strip()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    limits = LimitHits()
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(limits)
    start = time.perf_counter()
    result: dict = {"models": {}}
    # Recompile limits high enough that no code object falls back to eager silently (a hit
    # is reported), and a fresh inductor cache: compile times do not depend on earlier runs.
    patch = torch._dynamo.config.patch(
        recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=4 * RECOMPILE_LIMIT
    )
    try:
        with patch, fresh_cache():
            for model in models:
                print(f"{model} ({args.backend}):", flush=True)
                torch._dynamo.reset()
                result["models"][model] = measure(
                    model, names, args.steps, args.warmup, args.backend, limits,
                    ratio=args.layer_ratio, device=device,
                )  # fmt: skip
                gc.collect()
    finally:
        torch._dynamo.reset()
        logger.removeHandler(limits)
    result.update(
        command=command,
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        machine=step_time.machine(),
        backend=args.backend,
        steps=args.steps,
        warmup=args.warmup,
        layer_ratio=args.layer_ratio,
        recompile_limit=RECOMPILE_LIMIT,
        recompile_limit_hits=limits.hits,
        wall_s=time.perf_counter() - start,
        compile_timers=list(COMPILE_TIMERS),
    )
    result["checks"] = checks(result)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as handle:
        json.dump(result, handle, indent=2)
    text = render(result)
    with open(args.out + ".md", "w") as handle:
        handle.write(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
