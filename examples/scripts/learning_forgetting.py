"""Learning against forgetting: a table and a plot from ``compare`` runs of the
language-model task, whose config logs the forgetting monitor (``BookRetention``).

    python examples/scripts/compare_parallel.py \
        examples/scripts/plans/cpu_lm_forgetting.txt --jobs 2
    python examples/scripts/learning_forgetting.py docs/results/lm_forgetting

Per run (``DIR/runs/METHOD/seedN``): the in-domain result (``run.json``: the best and last
held-out next-token accuracy on the Rotten Tomatoes sentences) and, from ``metrics.csv``,
the retention measurements on the Brontës' novels at fit start and at the end: how much
the reference loss rose, how much the reference accuracy fell, and the KL divergence of the
next-token distribution from the pretrained model's. Writes ``DIR/forgetting.md`` (per
method: mean ± sd over seeds, and each seed) and ``DIR/forgetting.png`` (in-domain accuracy
against the rise of the reference loss, one point per method and seed: up is learning
more, left is forgetting less).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
from typing import Any


def retention(path: str) -> dict[str, float] | None:
    """The first and last ``forgetting/*`` values of a run's ``metrics.csv``."""
    if not os.path.isfile(path):
        return None
    rows: list[dict[str, float]] = []
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            if row.get("forgetting/loss"):
                keys = ("forgetting/loss", "forgetting/accuracy", "forgetting/kl")
                rows.append({k: float(row[k]) for k in keys})
    cost = None
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            if row.get("forgetting/fraction"):
                cost = float(row["forgetting/fraction"])
    if len(rows) < 2:
        return None
    first, last = rows[0], rows[-1]
    return {
        "loss_start": first["forgetting/loss"], "loss_end": last["forgetting/loss"],
        "loss_rise": last["forgetting/loss"] - first["forgetting/loss"],
        "accuracy_drop": first["forgetting/accuracy"] - last["forgetting/accuracy"],
        "kl": last["forgetting/kl"], "cost_fraction": cost if cost is not None else float("nan"),
    }  # fmt: skip


def collect(folder: str) -> dict[str, dict[str, dict[str, Any]]]:
    """method -> seed -> the run's figures."""
    runs = os.path.join(folder, "runs")
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for method in sorted(os.listdir(runs)):
        for seed in sorted(os.listdir(os.path.join(runs, method))):
            base = os.path.join(runs, method, seed)
            record = os.path.join(base, "run.json")
            kept = retention(os.path.join(base, "metrics.csv"))
            if not os.path.isfile(record) or kept is None:
                continue
            with open(record) as handle:
                run = json.load(handle)
            if run.get("final") is None:  # stopped before its first validation
                continue
            found.setdefault(method, {})[seed.removeprefix("seed")] = {
                "best": run["best"], "final": run["final"],
                "active_ratio": run.get("active_ratio") or 1.0, **kept,
            }  # fmt: skip
    return found


def _ms(values: list[float], fmt: str = ".4f") -> str:
    if len(values) < 2:
        return format(values[0], fmt)
    return f"{statistics.mean(values):{fmt}} ± {statistics.stdev(values):{fmt}}"


def render(found: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [
        "| method | seeds | in-domain accuracy, last | reference loss rise | reference accuracy"
        " drop | KL from the pretrained model | active ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    order = sorted(found, key=lambda m: -statistics.mean(r["final"] for r in found[m].values()))
    for method in order:
        runs = list(found[method].values())
        lines.append(
            f"| {method} | {len(runs)} | {_ms([r['final'] for r in runs])}"
            f" | {_ms([r['loss_rise'] for r in runs], '.3f')}"
            f" | {_ms([r['accuracy_drop'] for r in runs])}"
            f" | {_ms([r['kl'] for r in runs], '.3f')}"
            f" | {statistics.mean(r['active_ratio'] for r in runs):.3f} |"
        )
    lines += ["", "Each seed (in-domain accuracy / reference loss rise / KL):", ""]
    for method in order:
        each = ", ".join(f"{s}: {r['final']:.3f} / {r['loss_rise']:.3f} / {r['kl']:.3f}"
                         for s, r in found[method].items())  # fmt: skip
        lines.append(f"- {method}: {each}")
    costs = [r["cost_fraction"] for m in found.values() for r in m.values()]
    costs = [c for c in costs if c == c]
    if costs:
        lines += ["", f"The monitor's cost: {min(costs):.1%} to {max(costs):.1%} of a run."]
    return "\n".join(lines) + "\n"


def plot(found: dict[str, dict[str, dict[str, Any]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5), layout="constrained")
    markers = "osD^v<>px*h"
    for i, (method, runs) in enumerate(sorted(found.items())):
        xs = [r["loss_rise"] for r in runs.values()]
        ys = [r["final"] for r in runs.values()]
        ax.scatter(xs, ys, marker=markers[i % len(markers)], s=46, label=method, alpha=0.85)
    ax.set_xlabel("rise of the loss on the Brontës' novels (nats; left: forgets less)")
    ax.set_ylabel("held-out next-token accuracy, Rotten Tomatoes (up: learns more)")
    ax.set_title("Learning against forgetting, one point per method and seed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a compare --out folder (with runs/)")
    args = parser.parse_args(argv)
    found = collect(args.folder)
    if not found:
        raise SystemExit(f"{args.folder}: no finished run with retention measurements")
    text = render(found)
    with open(os.path.join(args.folder, "forgetting.md"), "w") as handle:
        handle.write(text)
    plot(found, os.path.join(args.folder, "forgetting.png"))
    print(text)
    return text


if __name__ == "__main__":
    main()
