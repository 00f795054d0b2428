"""The full benchmark, in one command: every model, every method, memory and overheads.

    python benchmarks/run_all.py          # (or `make bench`) about 30 minutes on 2 CPU cores

For each model (CPU: MiniLM-L6, a DeiT-Small-architecture ViT, a small Llama; GPU: the real
DeiT-Small and RoBERTa-base shapes) it measures, for AdamW, a hand-written SAM loop, SAM,
SL-SAM, Random-SL-SAM, S2-SAM, SL-S2-SAM, RST, ESAM, SSAM-F, LookSAM and cost-aware SL-SAM:

* the mean step time, all methods interleaved in one process (``step_time.py``), over
  whole periods of each method's step schedule (``step_cost.py``: RST's coin and LookSAM's
  interval mix SAM steps with cheaper ones, so a median would be one kind's time);
* the peak memory, one process per method (``memory.py``);
* the active ratio per step (the SL-SAM paper's column);

plus SL-SAM's own selection cost per step and the AdamW path's cost against plain
Lightning (``overhead.py``). It checks the targets and writes
``benchmarks/results/benchmark.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import overhead  # noqa: E402
import step_time  # noqa: E402
from step_cost import RULE, kinds_text  # noqa: E402

#: ``slsam_paper`` is the paper's SL-SAM (the "SL-SAM" targets), ``slsam`` is
#: ``SparseLayerSAM()``; ``slsam_depth`` runs on the paper's preset (``step_time.OPTIONS``).
METHODS = [
    "adamw", "sam_reference", "sam", "slsam_paper", "random_slsam", "s2sam", "sl_s2sam", "rst",
    "esam", "ssamf", "looksam", "slsam_depth", "slsam",
]  # fmt: skip
CPU_MODELS = ["minilm", "vit", "llama"]
GPU_MODELS = ["deit_small", "roberta_base"]
#: SL-SAM's step-time target (ratio to SAM) per model.
TIME_TARGETS = {
    "minilm": 0.65,
    "vit": 0.72,
    "llama": 0.72,
    "deit_small": 0.72,
    "roberta_base": 0.72,
}


def _memory(model: str, method: str, steps: int, threads: int) -> dict:
    command = [sys.executable, os.path.join(HERE, "memory.py"), "--model", model]
    command += ["--method", method, "--steps", str(steps), "--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"memory run {model}/{method} failed:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1])


def targets(result: dict) -> list[dict]:
    """Each target with its measured value and whether it holds."""
    rows = []

    def add(name: str, value: float, limit: float) -> None:
        rows.append({"target": name, "value": value, "limit": limit, "met": value <= limit})

    for model, data in result["models"].items():
        t = {m: r["mean_s"] for m, r in data["time"]["methods"].items()}
        mem = {m: r["training_mb"] for m, r in data["memory"].items()}
        add(f"{model}: SL-SAM time / SAM", t["slsam_paper"] / t["sam"], TIME_TARGETS[model])
        if "slsam" in t:  # SparseLayerSAM() (the row above: the paper's)
            add(f"{model}: SparseLayerSAM() time / SAM", t["slsam"] / t["sam"], 0.70)
        add(f"{model}: SL-SAM peak memory / SAM", mem["slsam_paper"] / mem["sam"], 0.85)
        add(f"{model}: SL-S2-SAM time / S2-SAM", t["sl_s2sam"] / t["s2sam"], 0.75)
        add(f"{model}: SAM time / hand-written SAM", t["sam"] / t["sam_reference"], 1.02)
        bandit = data["bandit"]["ms_per_step"]["total"] / 1000
        add(f"{model}: SL-SAM selection cost / SL-SAM step", bandit / t["slsam_paper"], 0.01)
        if "bandit_rank" in data:
            rank = data["bandit_rank"]["ms_per_step"]["total"] / 1000
            add(f"{model}: rank-loss selection cost / SL-SAM step", rank / t["slsam_paper"], 0.01)
        if model == "minilm":
            add("minilm: cost-aware SL-SAM time / SAM", t["slsam_depth"] / t["sam"], 0.55)
    if "lightning_adamw" in result:
        ratio = result["lightning_adamw"]["ratio_mixin_to_plain"]
        add("AdamW through SAMMixin / plain Lightning", ratio, 1.02)
    return rows


def render(result: dict) -> str:
    lines = [
        "# Benchmark: every method of the plugin, side by side",
        "",
        f"{result['stamp']} Command: `python benchmarks/run_all.py`, {result['wall_s'] / 60:.1f}"
        f" minutes. Step time: the {RULE}; all methods interleaved in one process; timed"
        " steps: those the mean counts, by kind where a method mixes kinds. Memory: one"
        " process per method, optimizer state of every parameter allocated first (steady"
        ' state); on a CPU "memory" is the peak RSS above the runtime (Python, torch) --'
        " what the model and its training need, as `torch.cuda.max_memory_allocated` on a"
        " GPU; the absolute peak RSS is in the JSON. Active ratio: parameter fraction with a"
        " gradient, summed over a step's passes (AdamW 1.0, SAM 2.0).",
        "",
        "## Targets",
        "",
        "| target | measured | limit | |",
        "|---|---:|---:|---|",
    ]
    for row in result["targets"]:
        mark = "met" if row["met"] else "**missed**"
        lines.append(f"| {row['target']} | {row['value']:.3f} | {row['limit']} | {mark} |")
    for data in result["models"].values():
        t = data["time"]
        lines += [
            "",
            f"## {t['description']}",
            "",
            f"{t['num_layers']} layers; {t['rounds']} timed rounds after {t['warmup']} warm-up"
            " rounds."
            f" SL-SAM's selection and bookkeeping: {data['bandit']['ms_per_step']['total']:.2f}"
            " ms per step"
            + (
                f" ({data['bandit_rank']['ms_per_step']['total']:.2f} with the rank loss)."
                if "bandit_rank" in data
                else "."
            ),
            "",
            "| method | step (s) | timed steps | time / SAM | memory (MB) | memory / SAM"
            " | active ratio |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        sam_mem = data["memory"]["sam"]["training_mb"]
        for name, row in t["methods"].items():
            mem = data["memory"][name]["training_mb"]
            ratio = row["active_ratio"]
            steps = kinds_text(row["steps"], row["kinds"])
            lines.append(
                f"| {name} | {row['mean_s']:.3f} | {steps} | {row['ratio_to_sam']:.3f}"
                f" | {mem:.0f} | {mem / sam_mem:.3f} | {'-' if ratio is None else f'{ratio:.3f}'} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    fig, axes = plt.subplots(2, 1, figsize=(12, 7), constrained_layout=True, sharex=True)
    width = 0.8 / len(models)
    for k, model in enumerate(models):
        data = result["models"][model]
        names = list(data["time"]["methods"])
        time_ratio = [data["time"]["methods"][n]["ratio_to_sam"] for n in names]
        sam_mem = data["memory"]["sam"]["training_mb"]
        mem_ratio = [data["memory"][n]["training_mb"] / sam_mem for n in names]
        xs = [i + (k - (len(models) - 1) / 2) * width for i in range(len(names))]
        axes[0].bar(xs, time_ratio, width, label=model)
        axes[1].bar(xs, mem_ratio, width, label=model)
    for ax, label in zip(axes, ("step time / SAM", "peak memory / SAM")):
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_xticks(range(len(names)), names, rotation=30, ha="right")
    axes[0].set_title("Cost of each method relative to SAM (lower is cheaper)")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated (default: by device)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--memory-steps", type=int, default=6)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    models = args.models.split(",") if args.models else (GPU_MODELS if cuda else CPU_MODELS)
    device = "cuda" if cuda else "cpu"

    result: dict = {"models": {}, "machine": step_time.machine()}
    for model in models:
        print(f"== {model}: step times", flush=True)
        timing = step_time.measure(model, METHODS, args.rounds, args.warmup, device=device)
        result["models"][model] = {
            "time": timing,
            "bandit": overhead.bandit(model),
            "bandit_rank": overhead.bandit(model, loss="rank"),
        }
    print("== memory, one process per method", flush=True)
    jobs = [(m, n) for m in models for n in METHODS]
    threads = 1 if not cuda else 0
    parallel = 1 if cuda else 2
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        futures = {job: pool.submit(_memory, *job, args.memory_steps, threads) for job in jobs}
        for (model, method), future in futures.items():
            result["models"][model].setdefault("memory", {})[method] = future.result()
            print(f"  {model}/{method}: {future.result()['training_mb']:.0f} MB", flush=True)
    if not cuda:
        print("== AdamW path against plain Lightning", flush=True)
        result["lightning_adamw"] = overhead.lightning_adamw("minilm")
    result["targets"] = targets(result)
    result["wall_s"] = time.perf_counter() - start
    result["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    m = result["machine"]
    result["stamp"] = (
        f"Machine: {m['platform']}, {m['processor']}, {m['cpu_threads']} threads, torch"
        f" {m['torch']}, GPU: {m['cuda'] or 'none'}. Date: {result['date']}."
    )
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "benchmark" if not cuda else "benchmark_gpu")
    with open(stem + ".json", "w") as handle:
        json.dump(result, handle, indent=2)
    with open(stem + ".md", "w") as handle:
        handle.write(render(result))
    plot(result, stem + ".png")
    print(render(result))
    return result


if __name__ == "__main__":
    main()
