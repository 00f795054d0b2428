"""What SAM buys, measured: the share of SAM's gain over AdamW each method keeps.

    python examples/scripts/benefit.py        # docs/results/benefit/share.{md,json,png}

Each benefit task is a folder ``docs/results/benefit/<task>/`` of ``python -m examples.compare
--report test_acc`` outputs (their plans: ``examples/scripts/plans/cpu_benefit_*.txt``);
every run's ``run.json`` sits beside the ``config.yaml`` that trained it, which says its
learning rate, its method and its radius. Per task:

1. **Chosen on validation.** AdamW's learning rate and SAM's radius (at that learning
   rate) are the values whose best ``val_acc`` over the run, averaged over the seeds, is
   highest; every other row runs at both unless its label says otherwise (``(rho r)``,
   ``(lr l)``: a method at a setting of its own).
2. **Read on test.** A run's accuracy is its ``test_acc`` at the evaluation where its
   ``val_acc`` was best ("best epoch"), and its ``test_acc`` at the end of the run ("end").
3. **SAM's gain** is SAM's mean minus AdamW's; it is real when it exceeds twice its
   standard error (the two means' standard errors over seeds, in quadrature) and each of
   the two rests on at least 5 seeds (with fewer the table shows it as not a claim yet).
4. **The share of SAM's gain kept** by a method is ``(method - AdamW) / (SAM - AdamW)``,
   with a bootstrap interval: each row's seeds, AdamW's and SAM's resampled independently
   (2,000 draws, the 2.5th and 97.5th percentiles).
5. **Step time.** Each row's mean step time relative to SAM's, from
   ``benchmarks/results/short_runs_time.json`` (every method trained on the task's own batches
   for the whole run, interleaved step by step in one process; a control is timed as its
   sampler, a row at another radius as its method).
6. **Controls.** A row labelled ``<label>_rho0`` is a layer sampler at a radius of 1e-8:
   its sparse updates alone. Its share beside the sampler's own says how much of the
   sampler's gain its sampling gives and how much the perturbation adds.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import re
import statistics
from typing import Any

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "docs", "results", "benefit")
#: task folder -> its name in the tables
TASKS = {
    "mlp_noisy": "MLP from scratch, digits, 40% label noise",
    "effnet_noisy": "EfficientNet-Lite0 fine-tune, digits, 40% label noise",
    "minilm_noisy": "MiniLM-L6 fine-tune, Rotten Tomatoes, 30% of the labels wrong",
    "vit_noisy": "ViT from scratch, digits, 40% label noise",
}
TIMES = os.path.join(ROOT, "benchmarks", "results", "short_runs_time.json")
#: a later measurement of some methods beside AdamW and SAM (``short_runs_time.py --out``)
MORE_TIMES = os.path.join(ROOT, "benchmarks", "results", "single_pass", "short_runs_time.json")
DRAWS = 2000
#: the plot's lowest share: a row under it (a diverged run) is marked at the floor
FLOOR = -1.5
#: the radius of the controls: sparse updates without a perturbation
CONTROL_RHO = 1e-8
#: the options that size a method without a radius (its rows are named by them, not by rho)
SIZES = {"MESA": ("weight", "tau", "decay", "start"),
         "SAF": ("weight", "tau", "delay", "start_epoch"),
         "SLSAMSAF": ("weight", "tau", "delay", "start_epoch")}  # fmt: skip
#: a row's control where it is not its label's ``_rho0`` run: SAF's step on the bandit's
#: draw against the bandit's sparse updates alone
CONTROLS = {"slsam_saf": "slsam_rho0"}
#: where a method's callback class lives (the package's, or examples/methods.py's)
METHOD_MODULES = ("lightning_slsam.", "examples.methods.")
#: options of a method sized by its radius that a control varies: a row names them where
#: they differ from these defaults, after its radius
VARIED = {"ARWP": {"growth": 10.0, "eta": 0.1}}
#: seeds of AdamW and of SAM below which SAM's gain is shown but not claimed
CLAIM_SEEDS = 5


def read_runs(folder: str) -> list[dict[str, Any]]:
    """Every run of a task folder: its label, seed, learning rate, method, radius and
    accuracies, from its ``run.json`` and the ``config.yaml`` beside it."""
    found = []
    for path in sorted(glob.glob(os.path.join(folder, "**", "run.json"), recursive=True)):
        here = os.path.dirname(path)
        with open(path) as handle:
            run = json.load(handle)
        with open(os.path.join(here, "config.yaml")) as handle:
            config = yaml.safe_load(handle)
        sam = [c for c in config["trainer"].get("callbacks") or []
               if c["class_path"].startswith(METHOD_MODULES)
               and not c["class_path"].endswith("RunRecorder")]  # fmt: skip
        method = sam[0]["class_path"].rsplit(".", 1)[-1] if sam else "AdamW"
        options = sam[0]["init_args"] if sam else {}
        # The loss's label smoothing (the mechanism control): a setting of the row, and
        # AdamW with it is a row, not the baseline.
        smoothing = float(config["model"]["init_args"].get("label_smoothing") or 0.0)
        found.append({
            "group": os.path.relpath(here, folder).split(os.sep)[0],
            "label": os.path.basename(os.path.dirname(here)),
            "seed": int(os.path.basename(here).removeprefix("seed")),
            "lr": float(config["model"]["init_args"]["learning_rate"]),
            "method": method,
            "rho": float(options["rho"]) if sam else None,
            "setting": tuple((k, float(options[k])) for k in SIZES.get(method, ()))
            + tuple((k, float(options[k])) for k, default in VARIED.get(method, {}).items()
                    if float(options.get(k, default)) != default)
            + ((("label_smoothing", smoothing),) if smoothing else ()),
            "best_val": run["best"],
            "best_epoch": run["report_at_best"],
            "end": run["report_final"],
        })  # fmt: skip
    return found


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error over seeds (0 for one seed)."""
    mean = statistics.mean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return mean, se


def choose(runs: list[dict[str, Any]], key: str) -> tuple[Any, dict[Any, float]]:
    """The value of ``key`` (learning rate, radius) whose runs' best ``val_acc``, averaged
    over seeds, is highest; and every value's average."""
    by: dict[Any, list[float]] = {}
    for run in runs:
        by.setdefault(run[key], []).append(run["best_val"])
    means = {value: statistics.mean(v) for value, v in by.items()}
    return max(means, key=means.__getitem__), means


def share(row: list[float], adamw: list[float], sam: list[float],
          rng: random.Random) -> tuple[float, float, float]:  # fmt: skip
    """The share of SAM's gain ``row`` keeps, and its bootstrap interval over seeds."""

    def one(r: list[float], a: list[float], s: list[float]) -> float:
        gain = statistics.mean(s) - statistics.mean(a)
        return (statistics.mean(r) - statistics.mean(a)) / gain if gain else math.nan

    draws = []
    for _ in range(DRAWS):
        value = one(*([rng.choice(x) for _ in x] for x in (row, adamw, sam)))
        if math.isfinite(value):
            draws.append(value)
    draws.sort()
    if not draws:
        return one(row, adamw, sam), math.nan, math.nan
    low, high = draws[int(0.025 * len(draws))], draws[int(0.975 * len(draws)) - 1]
    return one(row, adamw, sam), low, high


def task_table(runs: list[dict[str, Any]], seed: int = 0) -> dict[str, Any]:
    """The task's choices, SAM's gain and every row's share of it."""
    adamw_runs = [r for r in runs if r["method"] == "AdamW" and not r["setting"]]
    lr, lr_means = choose(adamw_runs, "lr")
    sam_runs = [r for r in runs if r["method"] == "SAM" and r["lr"] == lr]
    if not sam_runs:  # a task whose SAM sweep has not run yet
        raise LookupError(f"no SAM run at AdamW's chosen learning rate {lr:g} yet")
    rho, rho_means = choose(sam_runs, "rho")
    base = {"adamw": [r for r in adamw_runs if r["lr"] == lr],
            "sam": [r for r in sam_runs if r["rho"] == rho]}  # fmt: skip
    result: dict[str, Any] = {"lr": lr, "lr_val": lr_means, "rho": rho, "rho_val": rho_means}
    for point in ("best_epoch", "end"):
        a, s = ([r[point] for r in base[k]] for k in ("adamw", "sam"))
        (ma, sa), (ms, ss) = mean_se(a), mean_se(s)
        gain, se = ms - ma, math.hypot(sa, ss)
        result[point] = {"adamw": (ma, sa, len(a)), "sam": (ms, ss, len(s)), "gain": gain,
                         "gain_se": se, "real": gain > 2 * se,
                         "enough_seeds": min(len(a), len(s)) >= CLAIM_SEEDS}  # fmt: skip
    rows: dict[str, Any] = {}
    # One row per (label, radius): a method run at SAM's radius and at its own; of SAM's
    # sweep only the chosen radius is a row.
    keys = sorted({(r["label"], r["rho"], r["lr"], r["setting"]) for r in runs
                   if r["method"] != "AdamW" or r["setting"]},
                  key=lambda k: (k[0] != "sam", k[0], k[2] != lr, k[2], k[1], k[3]))  # fmt: skip
    for label, radius, rate, setting in keys:
        mine = [r for r in runs
                if (r["label"], r["rho"], r["lr"], r["setting"])
                == (label, radius, rate, setting)]  # fmt: skip
        if mine[0]["method"] == "SAM" and (label != "sam" or radius != rho or rate != lr):
            continue  # the sweep's other points
        name, named = label, [f"{k} {v:g}" for k, v in setting]
        sized = mine[0]["method"] in SIZES or radius is None  # (AdamW has no radius)
        if not sized and radius != rho and not label.endswith("_rho0"):
            named.insert(0, f"rho {radius:g}")
        if named:  # a method at a setting of its own
            name += " (" + ", ".join(named) + ")"
        if rate != lr:  # a method at a learning rate of its own
            name += f" (lr {rate:g})"
        row: dict[str, Any] = {"method": mine[0]["method"], "rho": radius, "lr": rate,
                               "seeds": len(mine), "setting": dict(setting)}  # fmt: skip
        for point in ("best_epoch", "end"):
            values = [r[point] for r in mine]
            a, s = ([r[point] for r in base[k]] for k in ("adamw", "sam"))
            rng = random.Random(f"{seed}:{name}:{point}")  # a row's interval: its own draws
            row[point] = {"acc": mean_se(values), "share": share(values, a, s, rng)}
        row["val"] = mean_se([r["best_val"] for r in mine])
        rows[name] = row
    # Controls: each sampler's share split into what its sampling alone keeps (its run at a
    # radius near 0) and what the perturbation adds.
    for name, row in rows.items():
        # A control runs at its sampler's learning rate; one serves every radius.
        label, rate = name.split(" (")[0], re.search(r" \(lr [^)]*\)", name)
        control = rows.get(CONTROLS.get(label, f"{label}_rho0") + (rate[0] if rate else ""))
        if control is not None:
            row["split"] = {point: (control[point]["share"][0],
                                    row[point]["share"][0] - control[point]["share"][0])
                            for point in ("best_epoch", "end")}  # fmt: skip
    # The sweeps themselves, for the record: every learning rate and radius on val and test.
    result["sweep"] = {
        f"AdamW lr {value:g}" if key == "lr" else f"SAM rho {value:g}": {
            point: mean_se([r[point] for r in group if r[key] == value])
            for point in ("best_val", "best_epoch", "end")
        }
        for key, group in (("lr", adamw_runs), ("rho", sam_runs))
        for value in sorted({r[key] for r in group})
    }
    result["rows"] = rows
    return result


def add_times(task: str, table: dict[str, Any], times: dict[str, float]) -> None:
    for label, row in table["rows"].items():
        row["time"] = time_of(label, times)
    table["adamw_time"] = times.get("adamw")


def step_times(task: str, path: str = TIMES, *more: str) -> dict[str, float]:
    """Each configuration's mean step time relative to SAM's on ``task`` (a task folder is
    named as its task in benchmarks/short_runs_time.py; empty when it was not measured).

    ``more``: later measurements, each with AdamW in it; a configuration only they timed
    joins at its time relative to AdamW's in its own run, times AdamW's relative to SAM's
    here (so its ratio to AdamW is the one measured beside it)."""
    times: dict[str, float] = {}
    for where in (path, *more):
        if not os.path.exists(where):
            continue
        with open(where) as handle:
            results = json.load(handle)["results"]
        for result in results:
            if result["task"] != task:
                continue
            found = {label: row["ratio_to_sam"] for label, row in result["configs"].items()}
            if not times:
                times = found
            elif "adamw" in times and "adamw" in found:
                scale = times["adamw"] / found["adamw"]
                times.update({k: v * scale for k, v in found.items() if k not in times})
    return times


#: Configurations that do the step work of another: SparseLayerSAM() without its update
#: scaling draws and computes as SparseLayerSAM() does; LookSAM at another ``alpha`` runs the
#: same passes (at ``alpha=0`` a reuse step skips one scaled add, a little less).
SAME_WORK = {"slsam_unscaled": "slsam", "looksam_alpha01": "looksam", "looksam_alpha0": "looksam"}


def time_of(label: str, times: dict[str, float]) -> float | None:
    """A row's step time: its own label's, a control's sampler's, a radius variant's method's."""
    base = label.split(" (")[0].removesuffix("_rho0")
    return times.get(SAME_WORK.get(base, base))


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats at once on time (lower) and share (higher)."""
    best, kept = -math.inf, []
    for time, value in sorted(points):
        if value > best:
            kept.append((time, value))
            best = value
    return kept


def plot(tables: dict[str, dict[str, Any]], path: str) -> None:
    """Share of SAM's gain against step time relative to SAM's, a panel per task (two to a
    row) and a marker per point of the run (best epoch: circles, end: squares), the
    frontier drawn; controls pale, rows under ``FLOOR`` marked at the floor with their
    share."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    columns = min(2, len(tables))
    rows = math.ceil(len(tables) / columns)
    figure = Figure(figsize=(6.5 * columns, 5.2 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax in axes[len(tables) :]:
        ax.set_axis_off()
    for ax, (task, t) in zip(axes, tables.items()):
        for point, marker, colour in (("best_epoch", "o", "tab:blue"), ("end", "s", "tab:orange")):
            points = [] if t.get("adamw_time") is None else [(t["adamw_time"], 0.0)]
            for label, row in t["rows"].items():
                time = row.get("time")
                if time is None:
                    continue
                share, low, high = row[point]["share"]
                if share < FLOOR:  # diverged: a mark at the panel's floor, not its scale
                    ax.plot(time, FLOOR + 0.05, "v", color=colour, ms=6)
                    if point == "best_epoch":
                        ax.annotate(f"{label}: {share:.0f}", (time, FLOOR + 0.05), fontsize=6,
                                    xytext=(3, 6), textcoords="offset points")  # fmt: skip
                    continue
                points.append((time, share))
                control = label.endswith("_rho0") or "_rho0 (" in label
                ax.errorbar(time, share, yerr=[[share - max(low, FLOOR)], [high - share]],
                            fmt=marker, color=colour, alpha=0.4 if control else 1.0,
                            capsize=2, ms=5)  # fmt: skip
                if point == "best_epoch" and not control:
                    ax.annotate(label, (time, share), fontsize=7, xytext=(4, 2),
                                textcoords="offset points")  # fmt: skip
            if points:
                edge = frontier(points)
                ax.plot(*zip(*edge), "-", color=colour, lw=1,
                        label=f"frontier, {point.replace('_', ' ')}")  # fmt: skip
        if t.get("adamw_time") is not None:
            ax.plot(t["adamw_time"], 0.0, "kD", ms=6)
            ax.annotate("AdamW", (t["adamw_time"], 0.0), fontsize=7, xytext=(3, -10),
                        textcoords="offset points")  # fmt: skip
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.axhline(0.9, color="grey", lw=0.6, ls=":")
        ax.axhline(0.0, color="black", lw=0.6)
        ax.axvline(0.5, color="grey", lw=0.6, ls=":")
        ax.set_ylim(FLOOR, None)
        ax.set(title=TASKS.get(task, task), xlabel="step time / SAM's",
               ylabel="share of SAM's gain kept (AdamW 0, SAM 1)")  # fmt: skip
        ax.legend(fontsize=8, loc="lower right")
    figure.savefig(path, dpi=110)


def render(tables: dict[str, dict[str, Any]]) -> str:
    lines = ["# What SAM buys: the share of SAM's gain each method keeps", ""]
    for task, t in tables.items():
        lines += [f"## {TASKS.get(task, task)}", "",
                  f"AdamW's learning rate chosen on validation: {t['lr']:g}; SAM's radius:"
                  f" {t['rho']:g}.", ""]  # fmt: skip
        for point, words in (("best_epoch", "at the best epoch"), ("end", "at the end")):
            g = t[point]
            if not g["enough_seeds"]:
                size = f"{g['adamw'][2]} seeds of AdamW and {g['sam'][2]} of SAM"
                verdict = ("above" if g["real"] else "not above") + (
                    f" twice its standard error, on {size}: not a claim yet (it needs"
                    f" {CLAIM_SEEDS} each)"
                )
            else:
                verdict = "real" if g["real"] else "not above twice its standard error"
            lines.append(
                f"- SAM's gain {words}: {g['gain']:+.4f} ± {g['gain_se']:.4f} ({verdict});"
                f" AdamW {g['adamw'][0]:.4f}, SAM {g['sam'][0]:.4f}."
            )
        if not (t["best_epoch"]["real"] and t["end"]["real"]):
            lines += [
                "",
                "Where SAM's gain is not real, a share divides by a difference within the seeds'"
                " noise and says nothing: read each row's test accuracy against AdamW's"
                " instead (a method should not lose accuracy where SAM gains nothing).",
            ]
        lines += [
            "",
            "| row | method | rho | seeds | best val acc | test acc, best epoch | share kept |"
            " test acc, end | share kept | step time / SAM | step time / AdamW |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for label, row in t["rows"].items():
            cells = ["{:.4f} ± {:.4f}".format(*row["val"])]
            for point in ("best_epoch", "end"):
                (m, se), (sh, lo, hi) = row[point]["acc"], row[point]["share"]
                cells.append(f"{m:.4f} ± {se:.4f} | {sh:.2f} [{lo:.2f}, {hi:.2f}]")
            time, adamw = row.get("time"), t.get("adamw_time")
            cells.append("-" if time is None else f"{time:.2f}")
            cells.append("-" if time is None or not adamw else f"{time / adamw:.2f}")
            radius = "-" if row["method"] in SIZES or row["rho"] is None else f"{row['rho']:g}"
            lines.append(f"| {label} | {row['method']} | {radius} | {row['seeds']} | "
                         + " | ".join(cells) + " |")  # fmt: skip
        split = {label: row["split"] for label, row in t["rows"].items() if "split" in row}
        if split:
            lines += ["", "Each layer sampler's share, split into what its sparse updates alone"
                      " keep (the same sampler at rho 1e-8) and what the perturbation adds:", "",
                      "| row | sampling alone, best epoch | perturbation adds | sampling alone,"
                      " end | perturbation adds |", "|---|---:|---:|---:|---:|"]  # fmt: skip
            for label, parts in split.items():
                lines.append(
                    f"| {label} | "
                    + " | ".join(
                        f"{a:.2f} | {b:+.2f}" for a, b in (parts["best_epoch"], parts["end"])
                    )
                    + " |"
                )
        lines += ["", "The sweeps (mean ± standard error over seeds):", "",
                  "| run | best val acc | test acc, best epoch | test acc, end |",
                  "|---|---:|---:|---:|"]  # fmt: skip
        for name, cells in t["sweep"].items():
            lines.append(
                f"| {name} | "
                + " | ".join(f"{m:.4f} ± {se:.4f}" for m, se in cells.values())
                + " |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=OUT, help="the benefit tasks' folder")
    parser.add_argument("--times", nargs="+", default=[TIMES, MORE_TIMES],
                        help="short_runs_time.py's results, the first the reference")  # fmt: skip
    args = parser.parse_args(argv)
    tables = {}
    for task in sorted(os.listdir(args.results)):
        folder = os.path.join(args.results, task)
        if os.path.isdir(folder) and glob.glob(os.path.join(folder, "**", "run.json"),
                                               recursive=True):  # fmt: skip
            try:
                tables[task] = task_table(read_runs(folder))
            except LookupError as missing:
                print(f"{task}: left out of the table ({missing})")
                continue
            add_times(task, tables[task], step_times(task, *args.times))
    text = render(tables)
    # A share is plotted only where SAM's gain is real at one point of the run at least.
    gained = {task: t for task, t in tables.items() if t["best_epoch"]["real"] or t["end"]["real"]}
    if any(row.get("time") is not None for t in gained.values() for row in t["rows"].values()):
        plot(gained, os.path.join(args.results, "share.png"))
    with open(os.path.join(args.results, "share.md"), "w") as handle:
        handle.write(text)
    with open(os.path.join(args.results, "share.json"), "w") as handle:
        json.dump(tables, handle, indent=1, default=str)
    print(text)
    return tables


if __name__ == "__main__":
    main()
