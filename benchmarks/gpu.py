"""SL-SAM's step time and memory at the SL-SAM paper's sizes, on one GPU, within a time budget.

    python benchmarks/gpu.py                 # `make bench-gpu`: every model and method, <= 420 s
    python benchmarks/gpu.py --smoke         # the same harness at toy sizes, on the CPU
    python benchmarks/gpu.py --budget 300 --models deit_small --methods adamw,sam,slsam

Models (random weights from their published configurations, built on the device, nothing
downloaded): DeiT-Small at 224 px, batch 128 (the paper's Table 1); RoBERTa-base for
sequence classification, batch 16, at 128 and 512 tokens (Table 4: CoLA and MNLI); a
Llama-3.2-3B-shaped causal LM with bf16 weights, batch 2, sequence 2048 (Table 6), or on a
GPU with under 60 GiB the 1B shape. DeiT and RoBERTa train in float32 with TF32 matrix
products (``torch.set_float32_matmul_precision("high")``).

Methods: AdamW, SAM, the paper's SL-SAM (``slsam_paper``), ``SparseLayerSAM()`` (``slsam``),
RST, ESAM, LookSAM, S2-SAM, SL-S2-SAM and cost-aware SL-SAM (``slsam_depth``), each with its
own AdamW through :meth:`SAMEngine.train_step` -- the step SAMMixin runs inside
Lightning -- with ``rho=0.01`` and ``layer_ratio=0.2`` as in ``make bench``
(``step_time.make_step``).

Per model and method, each method on a fresh copy of the model:

* the **mean step time** over whole periods of the method's step schedule
  (``step_cost.summarize``, the rule of ``make bench``), timed with CUDA events after
  warm-up steps;
* the **peak memory**: ``torch.cuda.max_memory_allocated`` from a reset once the model, its
  batches and its optimizer exist (weights, gradients, optimizer state, activations, the
  method's copies);
* the **active ratio**: parameters with a gradient per step over all passes (AdamW 1, SAM 2);
* **host synchronisations** per step, counted with ``torch.cuda.set_sync_debug_mode("warn")``
  over a whole schedule period after the timed steps (none to count on a CPU: ``-``);
* the **bookkeeping** per step: host milliseconds in the selection's draw, freezing and
  releasing the layers, learning from the norms and the counters;

and each ratio to SAM's, with the paper's ratio to AdaSAM (SAM with AdamW) beside it.

The work is ordered so that the most important figures come first: the first two models
(DeiT-Small and the Llama) with AdamW, SAM, the paper's SL-SAM and the default, then their
other methods, then the other models. The table (``<device>.md`` and ``.json`` under
``--out``) is rewritten after every measurement, and a measurement whose expected time no
longer fits the budget is not started (its row says so), so a run stopped from outside
loses nothing it measured and a run left alone ends before ``--budget`` seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import gc
import json
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from models import make_workload  # noqa: E402
from step_cost import RULE, kinds_text, schedule_of, summarize  # noqa: E402
from step_time import machine, make_step  # noqa: E402

METHODS = ["adamw", "sam", "slsam_paper", "slsam", "rst", "esam", "looksam", "s2sam",
           "sl_s2sam", "slsam_depth"]  # fmt: skip
#: Measured first on the first two models.
LEAD_METHODS = ["adamw", "sam", "slsam_paper", "slsam"]
GPU_MODELS = ["deit_small", "llama_3b", "roberta_base", "roberta_base_512"]
#: The same families at toy sizes, for ``--smoke`` on a CPU.
SMOKE_MODELS = ["smoke_deit", "smoke_llama", "smoke_roberta", "smoke_roberta_long"]
#: Below this much GPU memory the 3B Llama gives way to the 1B shape.
LLAMA_3B_GIB = 60

#: The paper's measurements: (peak memory in MB, epoch time in s) per method; ``sam`` is
#: AdaSAM, the ratios' base. S2-SAM's rows are its appendix table's, over Table 1's AdaSAM.
PAPER = {
    "deit_small": ("Table 1, CIFAR-10 (S2 rows: the appendix table)", {
        "sam": (8546, 231.39), "adamw": (8584, 118.51), "rst": (8548, 179.70),
        "esam": (8188, 202.21), "slsam_paper": (7832, 198.35), "s2sam": (8466, 119.76),
        "sl_s2sam": (8216, 114.47)}),
    "roberta_base": ("Table 4, CoLA", {
        "sam": (3296, 52.48), "rst": (3316, 40.63), "esam": (3160, 54.23),
        "slsam_paper": (3080, 43.66)}),
    "roberta_base_512": ("Table 4, MNLI", {
        "sam": (8076, 3015.16), "rst": (8078, 2314.12), "esam": (7336, 2871.64),
        "slsam_paper": (6462, 2238.76)}),
    "llama_3b": ("Table 6, Llama-3.2-3B-Instruct", {
        "sam": (51294, 15969), "rst": (51294, 14317), "esam": (48310, 14013),
        "slsam_paper": (47388, 12690)}),
}  # fmt: skip


def paper_ratios(model: str, method: str) -> tuple[float | None, float | None]:
    """The paper's (time, memory) ratio of ``method`` to AdaSAM on ``model``, if reported."""
    rows = PAPER.get(model, ("", {}))[1]
    if method not in rows:
        return None, None
    (mem, secs), (sam_mem, sam_secs) = rows[method], rows["sam"]
    return secs / sam_secs, mem / sam_mem


class SyncCounter:
    """Counts the host synchronisations CUDA reports while it is entered.

    Under ``torch.cuda.set_sync_debug_mode("warn")`` each synchronising operation warns
    "called a synchronizing CUDA operation": as a Python warning when the operation ran in
    Python's thread, printed to the process's stderr otherwise. Both are counted.
    ``enabled=False`` (no CUDA device): nothing is counted and :attr:`count` is ``None``.
    """

    MESSAGE = "called a synchronizing CUDA operation"

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.count: int | None = None

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as captured, warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            os.dup2(captured.fileno(), 2)
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                if torch.cuda.is_available():
                    torch.cuda.set_sync_debug_mode("default")
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                captured.seek(0)
                printed = captured.read().decode(errors="replace").count(self.MESSAGE)
            self.count = printed + sum(self.MESSAGE in str(w.message) for w in seen)


class Bookkeeping:
    """Host time an engine spends in its selection's bookkeeping: each hook below is wrapped
    on the engine's own objects (the step functions receive those objects)."""

    HOOKS = (("selection", "sample"), ("selection", "inclusion"), ("selection", "refine"),
             ("selection", "update"), ("freezer", "activate"), ("freezer", "release"),
             (None, "count"))  # fmt: skip

    def __init__(self, engine: Any) -> None:
        self.seconds = 0.0
        for owner_name, name in self.HOOKS:
            owner = engine if owner_name is None else getattr(engine, owner_name)
            if hasattr(owner, name):
                setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, function: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


class Clock:
    """Per-step times: CUDA events on a GPU (read once, after the steps), else the host's."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[Any] = []

    def around(self, run: Callable[[], None]) -> None:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            self.marks.append((start, end))
        else:
            start = time.perf_counter()
            run()
            self.marks.append(time.perf_counter() - start)

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) / 1000 for s, e in self.marks]
        return list(self.marks)


def measure(
    model: str, method: str, *, device: str, steps: int, warmup: int, deadline: float,
    batches: int = 4,
) -> tuple[str, dict[str, Any]]:  # fmt: skip
    """One method on a fresh copy of ``model``: the model's description, the table's row."""
    cuda = device.startswith("cuda")
    work = make_workload(model, batches, device)
    step = make_step(method, work, work.model, lr=1e-4, rho=0.01, ratio=0.2)
    engine = step.engine
    schedule = schedule_of(engine)
    # Enough timed steps for whole periods from any start (summarize finds the first).
    timed = -(-max(steps, schedule.min_steps) // schedule.period) * schedule.period
    timed += schedule.period - 1
    book = Bookkeeping(engine) if engine is not None else None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    data = work.batches
    for i in range(warmup):
        step(data[i % len(data)])
    if book is not None:
        book.seconds = 0.0
    clock, kinds = Clock(cuda), []
    for i in range(warmup, warmup + timed):
        if time.perf_counter() > deadline:
            break
        clock.around(functools.partial(step, data[i % len(data)]))
        result = getattr(engine, "last_result", None)
        kinds.append(getattr(result, "kind", None))
    times = clock.seconds()
    done = len(times)
    row: dict[str, Any] = {"timed_steps": done, "stopped_by_budget": done < timed}
    try:
        row.update(summarize(times, warmup, schedule, kinds))
    except ValueError:  # the budget left no whole period
        row["error"] = f"stopped by the budget after {done} timed steps (no whole period)"
        return work.description, row
    row["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    row["bookkeeping_ms"] = None if book is None else 1000 * book.seconds / max(done, 1)
    if engine is None:
        row["active_ratio"] = 1.0
    else:
        counted = max(engine.num_steps - engine.num_skipped, 1)
        row["active_ratio"] = engine.active_ratio_sum / counted
    # Host synchronisations over one whole period, outside the timed steps.
    counter = SyncCounter(cuda)
    start = warmup + done
    start += (-start) % schedule.period
    for i in range(start - warmup - done):  # to a period boundary, uncounted
        step(data[i % len(data)])
    with counter.counting():
        for i in range(schedule.period):
            step(data[i % len(data)])
    row["syncs_per_step"] = None if counter.count is None else counter.count / schedule.period
    return work.description, row


def plan(models: list[str], methods: list[str]) -> list[tuple[str, str]]:
    """The measurements in order of importance: the first two models with the lead
    methods, then their other methods, then every other model's methods."""
    lead_models = models[:2]
    lead = [m for m in methods if m in LEAD_METHODS]
    rest = [m for m in methods if m not in LEAD_METHODS]
    order = [(mo, me) for mo in lead_models for me in lead]
    order += [(mo, me) for mo in lead_models for me in rest]
    order += [(mo, me) for mo in models[2:] for me in methods]
    return order


def device_slug(smoke: bool) -> str:
    if smoke or not torch.cuda.is_available():
        return "smoke-cpu" if smoke else "cpu"
    name = torch.cuda.get_device_name(0)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def render(result: dict[str, Any]) -> str:
    """The Markdown table: a section per model, a row per method (its name first)."""
    m = result["machine"]
    lines = [
        f"# Step time and memory on {m['cuda'] or 'the CPU (smoke sizes)'}",
        "",
        f"`{result['command']}`; torch {m['torch']}, {result['date']}; budget"
        f" {result['budget_s']:.0f} s, {result['elapsed_s']:.0f} s used. Step: the {RULE}"
        f" ({result['warmup']} warm-up steps, at least {result['steps']} timed); peak memory:"
        " `torch.cuda.max_memory_allocated` from a reset once the model, batches and optimizer"
        " exist; syncs: host synchronisations per step over a whole period"
        " (`torch.cuda.set_sync_debug_mode`); bookkeeping: host ms per step in the selection's"
        " draw, freezing, learning and counters. *paper*: the SL-SAM paper's ratio to AdaSAM"
        " (epoch time, peak memory by nvidia-smi, on an RTX A6000 or A100).",
        "",
    ]
    for name, entry in result["models"].items():
        lines += [f"## {name}: {entry['description']}", ""]
        source = PAPER.get(name, ("",))[0]
        lines += [f"Paper figures: {source}." if source else "The paper has no figures here.", ""]
        lines += [
            "| method | step (ms) | time / SAM | paper | peak memory (MiB) | memory / SAM | paper"
            " | active ratio | syncs / step | bookkeeping (ms / step) | timed steps |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        sam = entry["methods"].get("sam", {})
        for method in result["methods"]:
            row = entry["methods"].get(method)
            if row is None or "mean_s" not in row:
                why = "not measured: the budget ran out" if row is None else row["error"]
                lines.append(f"| {method} | {why} |" + " |" * 9)
                continue
            t_paper, m_paper = paper_ratios(name, method)
            lines.append(
                f"| {method} | {1000 * row['mean_s']:.1f}"
                f" | {_ratio(row['mean_s'], sam.get('mean_s'))}"
                f" | {_fmt(t_paper)} | {_fmt(row['peak_mib'], '.0f')}"
                f" | {_ratio(row['peak_mib'], sam.get('peak_mib'))} | {_fmt(m_paper)}"
                f" | {row['active_ratio']:.3f} | {_fmt(row['syncs_per_step'], '.1f')}"
                f" | {_fmt(row['bookkeeping_ms'], '.2f')}"
                f" | {kinds_text(row['steps'], row['kinds'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.3f}"


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="toy sizes of the same models on the CPU")  # fmt: skip
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds the whole run may take (default 420)")  # fmt: skip
    parser.add_argument("--models", default=None,
                        help=f"comma-separated (default {','.join(GPU_MODELS)})")  # fmt: skip
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--steps", type=int, default=20, help="timed steps, at least")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None,
                        help="folder for <device>.md/.json (default: benchmarks/results/gpu on"
                        " a GPU, nothing written with --smoke)")  # fmt: skip
    args = parser.parse_args(argv)
    started = time.perf_counter()
    # Time to write the table and exit after the last measurement.
    deadline = started + args.budget - min(15.0, 0.05 * args.budget)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        parser.error("no CUDA device: run on a GPU, or pass --smoke for the CPU sizes")
    device = "cuda" if cuda else "cpu"
    if args.models:
        models = [m.strip() for m in args.models.split(",")]
    elif args.smoke:
        models = SMOKE_MODELS
    else:
        models = list(GPU_MODELS)
        gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        if gib < LLAMA_3B_GIB:
            models[models.index("llama_3b")] = "llama_1b"
    methods = [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {METHODS}")
    if cuda:
        torch.set_float32_matmul_precision("high")
    out = args.out or (None if args.smoke else os.path.join(HERE, "results", "gpu"))
    import lightning_slsam

    given = argv if argv is not None else sys.argv[1:]
    result: dict[str, Any] = {
        "command": " ".join(["python benchmarks/gpu.py", *given]),
        "package": os.path.dirname(lightning_slsam.__file__),
        "machine": machine(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "budget_s": args.budget, "steps": args.steps, "warmup": args.warmup,
        "methods": methods, "models": {}, "elapsed_s": 0.0,
    }  # fmt: skip
    print(f"lightning_slsam from {result['package']}; device: {result['machine']['cuda'] or 'cpu'}")
    spent: dict[str, float] = {}  # the longest measurement of each model so far
    for model, method in plan(models, methods):
        entry = result["models"].setdefault(model, {"description": model, "methods": {}})
        left = deadline - time.perf_counter()
        # This model's longest measurement so far, else the longest of any model's.
        expected = 1.25 * spent.get(model, max(spent.values(), default=0.0))
        if left <= 0 or expected > left:
            print(f"{model} / {method}: not started, {left:.0f} s left of the budget")
            continue
        begun = time.perf_counter()
        try:
            entry["description"], row = measure(
                model, method, device=device, steps=args.steps, warmup=args.warmup,
                deadline=deadline,
            )  # fmt: skip
        except torch.OutOfMemoryError:
            row = {"error": "out of memory"}
        _free()
        spent[model] = max(spent.get(model, 0.0), time.perf_counter() - begun)
        entry["methods"][method] = row
        result["elapsed_s"] = time.perf_counter() - started
        summary = row.get("error") or f"{1000 * row['mean_s']:.1f} ms/step"
        print(f"{model} / {method}: {summary} ({spent[model]:.0f} s)", flush=True)
        if out:
            write(result, out, device_slug(args.smoke))
    result["elapsed_s"] = time.perf_counter() - started
    if out:
        write(result, out, device_slug(args.smoke))
    print(render(result))
    return result


def write(result: dict[str, Any], out: str, slug: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, slug + ".json"), "w") as handle:
        json.dump(result, handle, indent=2)
    with open(os.path.join(out, slug + ".md"), "w") as handle:
        handle.write(render(result))


if __name__ == "__main__":
    main()
