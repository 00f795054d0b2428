"""Step time of the short-fine-tune configurations over a whole run, interleaved in one process.

    python benchmarks/short_runs_time.py                      # vision 92 and 276, text 454
    python benchmarks/short_runs_time.py --tasks vision92 --configs sam,slsam_paper,slsam_scale

Tasks on the same task config (vision 92 and 276 steps) are measured in one run as long as
the longest: the shorter is its first steps.

The comparisons of ``docs/results.md`` (``examples/scripts/compare_short_runs.sh``) train
each configuration in a process of its own, one after the other, over hours; on a shared
machine their epoch times drift with the load. This benchmark gives the time figures the
goal is judged on: every configuration trains its own copy of the task's model on the
task's own batches for the whole run (so a bandit that concentrates on large tensors costs
what it costs over the run), one step of each configuration per round in a rotating order,
so a slow spell of the machine slows all of them alike.

The configurations are the comparison's, read from its script (one table for both), plus
the baselines (AdamW without a callback, SAM, the paper's SL-SAM, Random-SL-SAM) and the
other methods with their defaults (what ``SparseLayerSAM()`` runs, ESAM, RST, LookSAM,
S2-SAM, SL-S2-SAM, cost-aware SL-SAM, SSAM-F, Momentum-SAM). Reported per
configuration: the mean step time over the run (over whole periods of its step schedule,
``step_cost.summarize``, the rule of ``make bench`` too), its ratios to SAM's and AdamW's,
and the active ratio; with ``--memory STEPS``, each configuration's peak training memory
(``memory.py --task``, a process of its own) and its ratio to AdamW's.
Writes ``benchmarks/results/short_runs_time.{md,json}`` as each run ends; a task measured by
an earlier invocation keeps its table there unless this one measures it again.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from step_cost import RULE, kinds_text, schedule_of, summarize
from step_time import interleaved, machine

from examples.methods import registered
from lightning_slsam import make_engine

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the tasks' class paths (examples.tasks) resolve from the repository
RESULTS = os.path.join(HERE, "results")
SCRIPT = os.path.join(ROOT, "examples", "scripts", "compare_short_runs.sh")
#: name: (task config, epochs)
TASKS = {
    "vision92": ("examples/configs/tasks/efficientnet_digits.yaml", 4),
    "vision276": ("examples/configs/tasks/efficientnet_digits.yaml", 12),
    "text454": ("examples/configs/tasks/minilm_rotten_tomatoes.yaml", 2),
    "lm454": ("examples/configs/tasks/glassllm_rotten_tomatoes.yaml", 2),
    # the label-noise benefit task (docs/results/benefit): an MLP from scratch, 60 epochs
    "mlp_noisy": ("examples/configs/tasks/mlp_digits_noisy.yaml", 60),
    "effnet_noisy": ("examples/configs/tasks/efficientnet_digits_noisy.yaml", 12),
    "minilm_noisy": ("examples/configs/tasks/minilm_rotten_tomatoes_noisy.yaml", 8),
    "vit_noisy": ("examples/configs/tasks/vit_digits_noisy.yaml", 100),
}
#: label: (method, options), as the comparison script's baselines.
BASELINES = {"adamw": ("adamw", {}), "sam": ("sam", {}), "slsam_paper": ("slsam_paper", {}),
             "random_slsam": ("random_slsam", {})}  # fmt: skip
#: the other methods with their defaults, as docs/results/choosing compares them
_OTHERS = (
    "slsam esam rst looksam s2sam sl_s2sam slsam_depth ssamf momentum_sam arwp mesa saf slsam_saf"
)
METHODS = {name: (name, {}) for name in _OTHERS.split()}
TIME_GOAL = 0.70


def script_variants(path: str = SCRIPT) -> dict[str, tuple[str, dict[str, Any]]]:
    """The comparison script's variant table: label -> (method, options)."""
    with open(path) as handle:
        text = handle.read()
    variants = {}
    for label, spec in re.findall(r'^\s*\[(\w+)\]="([^"]+)"', text, re.M):
        method, *options = spec.split()
        variants[label] = (
            method,
            {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in options)},
        )
    return variants


def _build(entry: dict[str, Any]) -> Any:
    module_name, _, name = entry["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module_name), name)
    return cls(**(entry.get("init_args") or {}))


def load_task(config: str, epochs: int) -> tuple[torch.nn.Module, list, Callable, float]:
    """The task's module, its training batches for ``epochs`` epochs, the loss its
    ``training_step`` computes (per-sample cross-entropy, with the logits and the samples'
    indices for MESA and SAF) and its learning rate."""
    with open(os.path.join(ROOT, config)) as handle:
        spec = yaml.safe_load(handle)
    torch.manual_seed(spec.get("seed_everything", 0))
    module, data = _build(spec["model"]), _build(spec["data"])
    data.setup("fit")
    batches = [batch for _ in range(epochs) for batch in data.train_dataloader()]
    if isinstance(batches[0], dict) and "labels" in batches[0] and batches[0]["labels"].dim() == 2:
        # the language-model task: each sequence's mean next-token loss

        def loss(model, batch, index=None):
            from examples.tasks.causal_lm import token_losses

            part = batch if index is None else {k: v[index] for k, v in batch.items()}
            losses, counted = token_losses(model(part), part["labels"])
            return losses.sum(1) / counted.sum(1).clamp(min=1)

    elif isinstance(batches[0], dict):  # the text task's tokenized batches

        def loss(model, batch, index=None):
            part = batch if index is None else {k: v[index] for k, v in batch.items()}
            inputs = {k: v for k, v in part.items() if k not in ("labels", "index")}
            logits = model.model(**inputs).logits.float()
            losses = F.cross_entropy(logits, part["labels"], reduction="none")
            return {"loss": losses, "logits": logits, "index": part["index"]}

    else:

        def loss(model, batch, index=None):
            images, labels, order = batch if index is None else [t[index] for t in batch]
            logits = model(images)
            losses = F.cross_entropy(logits, labels, reduction="none")
            return {"loss": losses, "logits": logits, "index": order}

    return module, batches, loss, float(module.hparams.learning_rate)


def make_step(method: str, options: dict[str, Any], module, loss, lr) -> Callable:
    """One training step of ``method`` with ``options`` on ``module`` (its own AdamW)."""
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr)
    module.train()
    if method == "adamw":

        def adamw(batch):
            opt.zero_grad(set_to_none=True)
            out = loss(module, batch)
            (out["loss"] if isinstance(out, dict) else out).mean().backward()
            opt.step()

        adamw.engine, adamw.optimizer = None, opt  # type: ignore[attr-defined]
        return adamw
    with registered():  # slsam_ablation, examples/methods.py's
        engine = make_engine(method, module, seed=0, **options)

    def step(batch):
        parts = batch.values() if isinstance(batch, dict) else batch
        size = next(len(t) for t in parts if isinstance(t, torch.Tensor))  # SSAM-F's samples
        engine.train_step(lambda index=None: loss(module, batch, index), opt, batch_size=size)

    step.engine, step.optimizer = engine, opt  # type: ignore[attr-defined]
    return step


def _recorded(step: Callable) -> Callable:
    """``step`` that also keeps, after each call, its engine's running active-ratio sum and
    counted steps (so a run's first N steps can be summarised on their own)."""
    engine = step.engine  # type: ignore[attr-defined]

    def recorded(batch):
        step(batch)
        if engine is not None:
            recorded.sums.append(  # type: ignore[attr-defined]
                (engine.active_ratio_sum, engine.num_steps - engine.num_skipped)
            )

    recorded.engine = engine  # type: ignore[attr-defined]
    recorded.sums = []  # type: ignore[attr-defined]
    return recorded


def measure(tasks: list[str], labels: list[str], limit: int | None = None) -> list[dict[str, Any]]:
    """Every configuration of ``labels`` on ``tasks``, which share one task config and differ
    only in their epochs: one interleaved run as long as the longest, each task summarised
    over its first steps (the same batches and the same steps a run of its own would take:
    the batches are drawn in order from one seed, and the steps have no schedule of their
    own). ``limit`` stops after that many steps (to try the script)."""
    config = TASKS[tasks[0]][0]
    table = {**BASELINES, **METHODS, **script_variants()}
    module, batches, loss, lr = load_task(config, max(TASKS[t][1] for t in tasks))
    steps = {
        label: _recorded(make_step(*table[label], copy.deepcopy(module), loss, lr))
        for label in labels
    }
    batches = batches[:limit] if limit else batches
    for step in steps.values():  # the run's length (ARWP's noise schedule, MESA's start)
        if step.engine is not None:  # type: ignore[attr-defined]
            step.engine.planned_steps = len(batches)  # type: ignore[attr-defined]
    print(f"== {', '.join(tasks)}: {len(batches)} steps x {len(labels)} configurations", flush=True)
    kinds: dict[str, list[str | None]] = {}
    times = interleaved(steps, batches, warmup=0, kinds=kinds)
    results = []
    for task in tasks:
        n = len(batches) * TASKS[task][1] // max(TASKS[t][1] for t in tasks)
        figures = {
            label: summarize(
                times[label][:n],
                0,
                schedule_of(steps[label].engine),
                kinds[label][:n] if label in kinds else None,
            )
            for label in labels
        }
        sam = figures["sam"]["mean_s"] if "sam" in figures else None
        adamw = figures["adamw"]["mean_s"] if "adamw" in figures else None
        rows = {}
        for label in labels:
            figure = figures[label]
            sums = steps[label].sums  # type: ignore[attr-defined]
            total, done = sums[n - 1] if sums else (1.0, 1)
            rows[label] = {
                "method": table[label][0],
                "options": table[label][1],
                "mean_step_s": figure["mean_s"],
                "median_step_s": figure["median_s"],
                "timed_steps": figure["steps"],
                "kinds": figure["kinds"],
                "enough": figure["enough"],
                "ratio_to_sam": figure["mean_s"] / sam if sam else None,
                "ratio_to_adamw": figure["mean_s"] / adamw if adamw else None,
                "active_ratio": total / max(done, 1),
            }
        results.append({"task": task, "config": config, "steps": n, "configs": rows})
    return results


def render(results: list[dict[str, Any]]) -> str:
    lines = [
        "# Step time of the short-fine-tune configurations over a whole run",
        "",
        "Produced by `python benchmarks/short_runs_time.py`: each configuration trains its own"
        " copy of the task's model on the task's batches for the whole run, interleaved step"
        " by step in one process. Step: the"
        f" {RULE}, over the run (a dense warm-up counts); its ratio to SAM's (goal: at most"
        f" {TIME_GOAL}x), and the active ratio.",
    ]
    for result in results:
        lines += [
            "",
            f"### {result['task']}: `{os.path.basename(result['config'])}`,"
            f" {result['steps']} steps",
            "",
            *([result["stamp"], ""] if result.get("stamp") else []),
            *_header(result["configs"]),
        ]
        configs = result["configs"]
        base = configs.get("adamw", {}).get("training_mb")
        for label, row in configs.items():
            if len(row.get("kinds", {})) > 1:  # mixed kinds: the steps the mean counts
                label = f"{label} ({kinds_text(row['timed_steps'], row['kinds'])})"
            cells = [label, f"{row['mean_step_s']:.3f}", _ratio(row["ratio_to_sam"])]
            if "ratio_to_adamw" in row:
                cells.append(_ratio(row["ratio_to_adamw"]))
            cells.append(f"{row['active_ratio']:.3f}")
            if "training_mb" in row:
                memory = row["training_mb"]
                cells += [f"{memory:.0f}", _ratio(memory / base if base else None)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _header(configs: dict[str, dict[str, Any]]) -> list[str]:
    row = next(iter(configs.values()))
    names = ["configuration", "mean step (s)", "time / SAM"]
    names += ["time / AdamW"] if "ratio_to_adamw" in row else []
    names += ["active ratio"]
    names += ["peak memory (MB)", "memory / AdamW"] if "training_mb" in row else []
    return ["| " + " | ".join(names) + " |", "|---|" + "---:|" * (len(names) - 1)]


def add_memory(results: list[dict[str, Any]], steps: int) -> None:
    """Each configuration's training memory (``memory.py --task``, a process of its own,
    ``steps`` steps) into its rows: the tasks of one config share it."""
    for label in results[0]["configs"]:
        command = [sys.executable, os.path.join(HERE, "memory.py"), "--task",
                   results[0]["task"], "--method", label, "--steps", str(steps)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"memory run {label} failed:\n{done.stderr[-2000:]}")
        memory = json.loads(done.stdout.strip().splitlines()[-1])["training_mb"]
        print(f"  memory {label}: {memory:.0f} MB", flush=True)
        for result in results:
            result["configs"][label]["training_mb"] = memory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"from {list(TASKS)}")
    parser.add_argument(
        "--configs", default="all", help="labels (baselines and the script's variants), or all"
    )
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--limit", type=int, help="stop each run after this many steps")
    parser.add_argument(
        "--memory", type=int, metavar="STEPS",
        help="also each configuration's peak training memory over STEPS steps (memory.py)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    tasks = args.tasks.split(",")
    known = {**BASELINES, **METHODS, **script_variants()}
    labels = list(known) if args.configs == "all" else args.configs.split(",")
    bad = [t for t in tasks if t not in TASKS] + [c for c in labels if c not in known]
    if bad:
        parser.error(
            f"unknown task(s) or configuration(s) {bad}; known: {list(TASKS)}, {list(known)}"
        )
    if "sam" not in labels:
        labels.insert(0, "sam")
    os.makedirs(args.out, exist_ok=True)
    for config in dict.fromkeys(TASKS[t][0] for t in tasks):  # tasks on one config: one run
        group = [t for t in tasks if TASKS[t][0] == config]
        load = os.getloadavg()[0]  # other work on the machine when the measurement began
        results = measure(group, labels, args.limit)
        stamp = (
            f"Machine: {machine()['processor']}, {torch.get_num_threads()} threads, torch"
            f" {torch.__version__}, {dt.date.today().isoformat()}, load average {load:.1f} at"
            " the start."
        )
        for result in results:
            result["stamp"] = stamp
        if args.memory:
            add_memory(results, args.memory)
        print(save(results, args.out))  # each run's tables as soon as it ends


def save(results: list[dict[str, Any]], out: str) -> str:
    """Write ``results`` into ``out``'s tables, keeping the tasks an earlier invocation (or
    an earlier run of this one) measured and these did not; returns the Markdown."""
    previous = os.path.join(out, "short_runs_time.json")
    measured = {r["task"] for r in results}
    if os.path.exists(previous):
        with open(previous) as handle:
            kept = [r for r in json.load(handle)["results"] if r["task"] not in measured]
        results = sorted(kept + results, key=lambda r: list(TASKS).index(r["task"]))
    text = render(results)
    with open(os.path.join(out, "short_runs_time.md"), "w") as handle:
        handle.write(text)
    with open(previous, "w") as handle:
        json.dump({"machine": machine(), "results": results}, handle, indent=2)
    return text


if __name__ == "__main__":
    sys.exit(main())
