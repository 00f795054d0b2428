"""Which method when: accuracy against step time per task, with the Pareto frontier.

    python examples/scripts/choosing.py      # docs/results/choosing/pareto.{md,json,png}

Per task (vision 92 and 276 steps, text 454 steps) and method: the best validation accuracy
over the seeds of the committed runs (mean ± sd, n) and the mean step time as a ratio to
SAM's, measured interleaved over the whole run in one process
(``benchmarks/short_runs_time.py``, schedules timed over whole periods; each measurement's
ratio is to the SAM of its own run). The frontier holds the methods that no other method
beats on both (at most the time, at least the accuracy, one of them strictly). A method
*matches SAM* when its mean is at least SAM's mean minus SAM's seed sd (the SAM of the row's own
comparison: the GPU rows against the GPU's SAM).

Where each row comes from is in :data:`ACCURACY` and :data:`TIME` (the CPU comparisons of
``docs/results/short_*`` and ``docs/results/choosing/*``; ``SparseLayerSAM()``'s accuracy
from the GPU comparison ``docs/results/gpu/*``, its only multi-seed rows).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "docs", "results")
BENCH = os.path.join(ROOT, "benchmarks", "results")
OUT = os.path.join(RESULTS, "choosing")
TASKS = {"vision92": "vision, 92 steps", "vision276": "vision, 276 steps",
         "text454": "text, 454 steps"}  # fmt: skip
_SHORT = {"vision92": "short_vision_92", "vision276": "short_vision_276",
          "text454": "short_text_454"}  # fmt: skip
_GPU = {"vision92": "gpu/vision_92", "vision276": "gpu/vision_276", "text454": "gpu/text_454"}
_CHOOSING = {"vision92": "choosing/vision_92", "vision276": "choosing/vision_276",
             "text454": "choosing/text_454"}  # fmt: skip
NEW = ("esam", "rst", "looksam", "s2sam", "sl_s2sam", "slsam_depth")
NAMES = ("ESAM", "RST", "LookSAM", "S2-SAM", "SL-S2-SAM", "cost-aware SL-SAM")
#: method -> (its name in the plots, {task: (results folder, run label)})
ACCURACY: dict[str, tuple[str, dict[str, tuple[str, str]]]] = {
    "adamw": ("AdamW", {t: (f, "adamw") for t, f in _SHORT.items()}),
    "sam": ("SAM", {t: (f, "sam") for t, f in _SHORT.items()}),
    "slsam_paper": ("SL-SAM (paper)", {t: (f, "slsam") for t, f in _SHORT.items()}),
    "slsam": ("SparseLayerSAM()", {t: (f, "slsam_compute_cap3") for t, f in _GPU.items()}),
    **{
        name: (label, {t: (f, name) for t, f in _CHOOSING.items()})
        for name, label in zip(NEW, NAMES)
    },
}
#: method -> (measurement, its label there): benchmarks/results/<measurement>/short_runs_time.json
TIME: dict[str, tuple[str, str]] = {
    "adamw": ("", "adamw"),
    "sam": ("", "sam"),
    "slsam_paper": ("", "slsam"),  # the paper's SL-SAM when that table was measured
    "slsam": ("default_time", "slsam_compute_cap3"),
    **{name: ("choosing_time", name) for name in NEW},
}
PRESET_TIME = 0.5  # a named preset: SAM's accuracy at no more than this time on two tasks


#: The task configs of the committed comparisons, by kind.
TASK_CONFIGS = {
    "vision": "examples/configs/tasks/efficientnet_digits.yaml",
    "text": "examples/configs/tasks/minilm_rotten_tomatoes.yaml",
    "lm": "examples/configs/tasks/glassllm_rotten_tomatoes.yaml",
}


def build(entry: dict[str, Any]) -> Any:
    """The object a config entry names: ``{"class_path": ..., "init_args": {...}}``."""
    module_name, _, name = entry["class_path"].rpartition(".")
    return getattr(importlib.import_module(module_name), name)(**(entry.get("init_args") or {}))


def runs(folder: str, label: str) -> list[dict[str, Any]]:
    """The ``run.json`` records of ``RESULTS/folder/runs/label/seed*``."""
    base = os.path.join(RESULTS, folder, "runs", label)
    records = []
    for seed in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        path = os.path.join(base, seed, "run.json")
        if os.path.isfile(path):
            with open(path) as handle:
                records.append(json.load(handle))
    return records


def accuracy(folder: str, label: str) -> list[float]:
    """Each seed's best validation accuracy."""
    return [float(r["best"]) for r in runs(folder, label)]


def spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample sd (nan for one value)."""
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    return statistics.fmean(values), sd


def matches_sam(mean: float, sam: list[float]) -> bool:
    """The rule of these tables: a mean at least SAM's mean minus SAM's seed sd."""
    sam_mean, sam_sd = spread(sam)
    return mean >= sam_mean - sam_sd


def save(out: str, stem: str, data: Any, text: str) -> None:
    """A results table: ``out/stem.json`` (``data``) and ``out/stem.md`` (``text``)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as handle:
        json.dump(data, handle, indent=1)
    with open(os.path.join(out, f"{stem}.md"), "w") as handle:
        handle.write(text)


def times() -> dict[str, dict[str, float]]:
    """task -> method -> time / SAM."""
    out: dict[str, dict[str, float]] = {}
    for method, (measurement, label) in TIME.items():
        path = os.path.join(BENCH, measurement, "short_runs_time.json")
        if not os.path.isfile(path):
            continue
        with open(path) as handle:
            for result in json.load(handle)["results"]:
                row = result["configs"].get(label)
                if row is not None and result["task"] in TASKS:
                    out.setdefault(result["task"], {})[method] = float(row["ratio_to_sam"])
    return out


def frontier(points: dict[str, tuple[float, float]]) -> list[str]:
    """The methods no other beats on both time (lower) and accuracy (higher)."""
    keep = []
    for name, (t, a) in points.items():
        beaten = any(
            t2 <= t and a2 >= a and (t2 < t or a2 > a)
            for other, (t2, a2) in points.items()
            if other != name
        )
        if not beaten:
            keep.append(name)
    return sorted(keep, key=lambda n: points[n][0])


def table() -> dict[str, Any]:
    ratio = times()
    tasks = {}
    for task in TASKS:
        rows = {}
        for method, (name, where) in ACCURACY.items():
            best = accuracy(*where[task])
            if not best:
                continue
            rows[method] = {
                "name": name,
                "source": "/".join(where[task]),
                "n": len(best),
                "mean": spread(best)[0],
                "sd": spread(best)[1],
                "time": ratio.get(task, {}).get(method),
            }
        for method, row in rows.items():
            # against the SAM of the row's own comparison (the GPU rows: the GPU's SAM)
            folder = ACCURACY[method][1][task][0]
            sam = accuracy(folder, "sam") or accuracy(_SHORT[task], "sam")
            row["sam"], row["sam_sd"] = spread(sam)
            row["matches_sam"] = matches_sam(row["mean"], sam)
        timed = {m: (r["time"], r["mean"]) for m, r in rows.items() if r["time"] is not None}
        on = frontier(timed)
        for method, row in rows.items():
            row["frontier"] = method in on
        tasks[task] = {"rows": rows, "frontier": on}
    return {"tasks": tasks, "preset": preset_verdict(tasks)}


def preset_verdict(tasks: dict[str, Any]) -> dict[str, Any]:
    """Issue 41's bar for a named preset: SAM's accuracy within its seed spread at no more
    than 0.5x SAM's step time on at least two tasks; else the closest miss per method."""
    per_method: dict[str, list[dict[str, Any]]] = {}
    for task, entry in tasks.items():
        for method, row in entry["rows"].items():
            if method in ("sam", "adamw") or row["time"] is None:
                continue
            per_method.setdefault(method, []).append({
                "task": task, "time": row["time"], "matches": row["matches_sam"],
                "gap_points": 100 * (row["mean"] - row["sam"]),
            })  # fmt: skip
    passing = {
        m: [e["task"] for e in es if e["matches"] and e["time"] <= PRESET_TIME]
        for m, es in per_method.items()
    }
    winners = sorted(m for m, ts in passing.items() if len(ts) >= 2)
    # the closest miss: the method matching SAM on the most tasks, by its least time there
    misses = []
    for method, entries in per_method.items():
        matched = [e for e in entries if e["matches"]]
        misses.append({
            "method": method, "tasks_matched": len(matched),
            "times_where_matched": sorted(round(e["time"], 3) for e in matched),
            "over_time_by": (
                round(sorted(e["time"] for e in matched)[1] - PRESET_TIME, 3)
                if len(matched) >= 2 else None
            ),
        })  # fmt: skip
    misses.sort(key=lambda m: (-m["tasks_matched"], m["over_time_by"] or 9.0))
    return {"winners": winners, "misses": misses, "bar_time": PRESET_TIME}


def gpu_sam(row: dict[str, Any]) -> str:
    if not row["source"].startswith("gpu/"):
        return ""
    return f" (SAM {row['sam']:.3f} ± {row['sam_sd']:.3f})"


def render(result: dict[str, Any]) -> str:
    lines = [
        "# Which method when: accuracy against step time",
        "",
        "Produced by `python examples/scripts/choosing.py` from the committed runs and step-time"
        " measurements. Best `val_acc` over the seeds (mean ± sd, n); time: mean step over the"
        " whole run as a ratio to SAM's (`benchmarks/short_runs_time.py`, interleaved, 1 thread;"
        " `-`: not measured). Frontier: no other method is at least as fast and at least as"
        " accurate. Matches SAM: mean at least SAM's mean minus SAM's sd, SAM of the row's own"
        " comparison (the GPU rows: the GPU's SAM, shown in brackets).",
    ]
    for task, entry in result["tasks"].items():
        lines += [
            "",
            f"### {TASKS[task]}",
            "",
            "| method | n | best val_acc | time / SAM | matches SAM | on the frontier | runs |",
            "|---|---:|---:|---:|---|---|---|",
        ]
        rows = sorted(entry["rows"].values(), key=lambda r: (r["time"] or 9.0, -r["mean"]))
        for r in rows:
            time = "-" if r["time"] is None else f"{r['time']:.2f}x"
            lines.append(
                f"| {r['name']} | {r['n']} | {r['mean']:.3f} ± {r['sd']:.3f} | {time} |"
                f" {'yes' if r['matches_sam'] else 'no'}{gpu_sam(r)} |"
                f" {'**yes**' if r['frontier'] else ''}"
                f" | `{r['source']}` |"
            )
    verdict = result["preset"]
    lines += ["", "### A named preset?", ""]
    if verdict["winners"]:
        lines.append(
            f"Matches SAM at no more than {verdict['bar_time']}x SAM's time on two tasks or"
            f" more: {', '.join(verdict['winners'])}."
        )
    else:
        lines.append(
            f"No method matches SAM at no more than {verdict['bar_time']}x SAM's time on two"
            " tasks. The closest:"
        )
        lines.append("")
        for miss in verdict["misses"][:4]:
            over = miss["over_time_by"]
            lines.append(
                f"- {miss['method']}: matches SAM on {miss['tasks_matched']} of"
                f" {len(TASKS)} tasks, at {miss['times_where_matched']} of SAM's time"
                + ("" if over is None else f" (its second-fastest match is {over:+.2f} over)")
            )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TASKS), figsize=(6 * len(TASKS), 5.6))
    markers = "oosDv^<>PXh*"
    style = {m: (plt.get_cmap("tab10")(i % 10), markers[i]) for i, m in enumerate(ACCURACY)}
    for ax, (task, entry) in zip(axes, result["tasks"].items()):
        rows = {m: r for m, r in entry["rows"].items() if r["time"] is not None}
        line = [rows[m] for m in entry["frontier"]]
        ax.plot([r["time"] for r in line], [r["mean"] for r in line], "--", color="k",
                lw=1, alpha=0.7, label="Pareto frontier", zorder=1)  # fmt: skip
        for method, r in rows.items():
            color, marker = style[method]
            ax.errorbar(r["time"], r["mean"], yerr=0 if r["n"] < 2 else r["sd"], fmt=marker,
                        color=color, capsize=3, ms=8 if r["frontier"] else 6,
                        mec="k" if r["frontier"] else color,
                        label=f"{r['name']} (n={r['n']})", zorder=2)  # fmt: skip
        sam = entry["rows"]["sam"]
        ax.axhspan(sam["mean"] - sam["sd"], sam["mean"] + sam["sd"], color="tab:blue",
                   alpha=0.10, label="SAM ± sd", zorder=0)  # fmt: skip
        ax.axvline(PRESET_TIME, color="k", ls=":", lw=1, label=f"{PRESET_TIME}x SAM's time")
        ax.set_title(f"{TASKS[task]} (frontier: black edges)")
        ax.set_xlabel("mean step time / SAM's (interleaved, whole run)")
        ax.set_ylabel("best val_acc (mean ± sd over seeds)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    result = table()
    text = render(result)
    save(args.out, "pareto", result, text)
    plot(result, os.path.join(args.out, "pareto.png"))
    print(text)


if __name__ == "__main__":
    sys.exit(main())
