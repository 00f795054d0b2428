"""Does a larger SAM radius make the language model forget less than AdamW at equal in-domain
accuracy? A table and a plot from the radius sweep of the language-model task.

    python examples/scripts/compare_parallel.py examples/scripts/plans/cpu_lm_radius.txt --jobs 2
    python examples/scripts/lm_radius.py docs/results/lm_radius --with docs/results/lm_forgetting

Each sub-folder of the sweep is one point: ``sam_rho<R>`` (SAM at radius R), ``adamw_lr<LR>``
(AdamW at learning rate LR), ``mesa_w<W>`` (MESA at weight W, the task's learning rate) or
``smooth<S>`` (AdamW at the task's learning rate with label smoothing S), read
as ``learning_forgetting.py`` reads a ``compare`` folder: the last held-out next-token accuracy
on the Rotten Tomatoes sentences (in-domain) and the rise of the loss on the Brontës' novels
(forgetting). ``--with`` adds a comparison folder's ``sam`` and ``adamw`` runs as SAM at
``--with-rho`` (default 0.01) and AdamW at ``--with-lr`` (default 3e-3), the task config's
settings; their seeds join the sweep's at the same point.

SAM at a radius "forgets less at equal accuracy" when its loss rise is under AdamW's at SAM's
accuracy -- read on AdamW's frontier (the learning rates no other rate beats on both counts),
linearly between the two rates whose accuracies bracket it -- by more than twice the standard
error of the difference. Outside AdamW's range
no such reading is made; a point AdamW beats on both counts (some rate learns as much or more
and forgets less) is said to be dominated. Writes ``DIR/radius.md`` and ``DIR/radius.png``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import re
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from learning_forgetting import collect

POINT = re.compile(r"^(sam_rho|adamw_lr|mesa_w|smooth)(.+)$")
#: A folder's prefix -> the method its runs are, and how a row names its point.
METHODS = {"sam_rho": "sam", "adamw_lr": "adamw", "mesa_w": "mesa", "smooth": "smooth"}
NAMES = {"sam": "SAM rho {:g}", "adamw": "AdamW lr {:g}", "mesa": "MESA weight {:g}",
         "smooth": "AdamW, label smoothing {:g}"}  # fmt: skip


def _mean_se(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], math.nan
    return statistics.mean(values), statistics.stdev(values) / math.sqrt(len(values))


Points = dict[tuple[str, float], dict[str, dict[str, Any]]]


def gather(folder: str, extra: str | None = None, extra_rho: float = 0.01,
           extra_lr: float = 3e-3) -> Points:  # fmt: skip
    """``(method, setting) -> seed -> run``: method ``"sam"`` (setting: the radius),
    ``"adamw"`` (setting: the learning rate), ``"mesa"`` (setting: its weight) or
    ``"smooth"`` (setting: the label smoothing)."""
    points: Points = {}
    for name in sorted(os.listdir(folder)):
        match = POINT.match(name)
        if not match or not os.path.isdir(os.path.join(folder, name, "runs")):
            continue
        method = METHODS[match.group(1)]
        for runs in collect(os.path.join(folder, name)).values():
            points.setdefault((method, float(match.group(2))), {}).update(runs)
    if extra is not None:
        found = collect(extra)
        for method, setting in (("sam", extra_rho), ("adamw", extra_lr)):
            for seed, run in found.get(method, {}).items():
                points.setdefault((method, setting), {}).setdefault(seed, run)
    return points


def summarise(points: Points) -> list[dict[str, Any]]:
    """One row per point: seeds, and mean and standard error of the in-domain accuracy,
    the reference loss rise and the KL."""
    rows = []
    for (method, setting), runs in sorted(points.items()):
        row: dict[str, Any] = {"method": method, "setting": setting, "seeds": len(runs)}
        for key in ("final", "loss_rise", "kl"):
            row[key], row[key + "_se"] = _mean_se([r[key] for r in runs.values()])
        rows.append(row)
    return rows


def at_equal_accuracy(row: dict[str, Any], adamw: list[dict[str, Any]]) -> dict[str, Any]:
    """SAM's point against AdamW's curve: the loss rise AdamW reaches at SAM's accuracy
    (linear between the bracketing rates), the difference and its standard error, and the
    verdict."""
    # AdamW's frontier: the rates no other rate beats on both counts (a rate past the best
    # accuracy learns less and forgets more: it is off the curve).
    frontier = [a for a in adamw if not any(
        b["final"] >= a["final"] and b["loss_rise"] < a["loss_rise"] for b in adamw)]  # fmt: skip
    curve = sorted(frontier, key=lambda r: r["final"])
    acc = row["final"]
    dominated = [a for a in curve if a["final"] >= acc and a["loss_rise"] < row["loss_rise"]]
    for low, high in itertools.pairwise(curve):
        if low["final"] <= acc <= high["final"]:
            span = high["final"] - low["final"]
            w = (acc - low["final"]) / span if span > 0 else 0.5
            rise = (1 - w) * low["loss_rise"] + w * high["loss_rise"]
            se_adamw = math.sqrt(((1 - w) * low["loss_rise_se"]) ** 2
                                 + (w * high["loss_rise_se"]) ** 2)  # fmt: skip
            diff = row["loss_rise"] - rise
            se = math.sqrt(row["loss_rise_se"] ** 2 + se_adamw**2)
            if se != se:  # a point of one seed
                verdict = "one seed: no reading"
            elif abs(diff) <= 2 * se:
                verdict = "the same, within twice the standard error"
            else:
                verdict = "forgets less" if diff < 0 else "forgets more"
            between = f"AdamW between lr {low['setting']:g} and {high['setting']:g}"
            return {"adamw_rise": rise, "diff": diff, "se": se, "verdict": verdict,
                    "between": between, "dominated": bool(dominated)}  # fmt: skip
    verdict = "dominated by AdamW" if dominated else "outside AdamW's range"
    return {"adamw_rise": math.nan, "diff": math.nan, "se": math.nan, "verdict": verdict,
            "between": "-", "dominated": bool(dominated)}  # fmt: skip


def _fmt(mean: float, se: float, digits: int) -> str:
    return f"{mean:.{digits}f}" if se != se else f"{mean:.{digits}f} ± {se:.{digits}f}"


def render(rows: list[dict[str, Any]]) -> str:
    adamw = [r for r in rows if r["method"] == "adamw"]
    lines = [
        "| point | seeds | in-domain accuracy, last | reference loss rise | KL from the"
        " pretrained model | AdamW's rise at this accuracy | difference | reading |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        name = NAMES[row["method"]].format(row["setting"])
        cells = [
            name,
            str(row["seeds"]),
            _fmt(row["final"], row["final_se"], 4),
            _fmt(row["loss_rise"], row["loss_rise_se"], 3),
            _fmt(row["kl"], row["kl_se"], 3),
        ]
        if row["method"] != "adamw" and len(adamw) >= 2:
            cmp = at_equal_accuracy(row, adamw)
            row["at_equal_accuracy"] = cmp
            shown = "-" if cmp["adamw_rise"] != cmp["adamw_rise"] else f"{cmp['adamw_rise']:.3f}"
            diff = "-" if cmp["diff"] != cmp["diff"] else _fmt(cmp["diff"], cmp["se"], 3)
            reading = cmp["verdict"] + (f" ({cmp['between']})" if cmp["between"] != "-" else "")
            cells += [shown, diff, reading]
        else:
            cells += ["", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Mean ± standard error over seeds. The reading compares a point's reference loss"
              " rise with AdamW's at the same in-domain accuracy, on AdamW's frontier (the rates"
              " no other rate beats on both counts), linear between the two rates around it;"
              " a difference counts when it exceeds twice its standard error."]  # fmt: skip
    return "\n".join(lines) + "\n"


#: Each method's curve in the plot: marker and legend.
CURVES = [("adamw", "o", "AdamW, by learning rate"), ("sam", "s", "SAM, by radius (lr 3e-3)"),
          ("mesa", "^", "MESA, by weight (lr 3e-3)"),
          ("smooth", "v", "AdamW, by label smoothing (lr 3e-3)")]  # fmt: skip


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Accuracy against the loss rise: every point (left) and the points near AdamW's
    frontier (right), each curve by its setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5), layout="constrained")
    adamw = [r for r in rows if r["method"] == "adamw"]
    near = [r for r in rows if adamw and r["final"] >= min(a["final"] for a in adamw) - 0.005]
    for ax, shown in zip(axes, (rows, near)):
        for method, marker, label in CURVES:
            points = sorted((r for r in shown if r["method"] == method), key=lambda r: r["setting"])
            if not points:
                continue
            xs, ys = [r["loss_rise"] for r in points], [r["final"] for r in points]
            xe = [
                0 if r["loss_rise_se"] != r["loss_rise_se"] else r["loss_rise_se"] for r in points
            ]
            ye = [0 if r["final_se"] != r["final_se"] else r["final_se"] for r in points]
            ax.errorbar(xs, ys, xerr=xe, yerr=ye, marker=marker, capsize=3, label=label)
            for r in points:
                ax.annotate(f"{r['setting']:g}", (r["loss_rise"], r["final"]), fontsize=8,
                            xytext=(4, 4 if method == "adamw" else -10),
                            textcoords="offset points")  # fmt: skip
        ax.set_xlabel("rise of the loss on the Brontës' novels (nats; left: forgets less)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_ylabel("held-out next-token accuracy, Rotten Tomatoes (up: learns more)")
    axes[0].set_title("Every point (mean ± standard error over seeds)")
    axes[1].set_title("Near AdamW's frontier")
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the sweep's folder: sam_rho*/, adamw_lr*/, mesa_w*/, ...")
    parser.add_argument("--with", dest="extra", help="a compare folder with sam and adamw runs")
    parser.add_argument("--with-rho", type=float, default=0.01)
    parser.add_argument("--with-lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    rows = summarise(gather(args.folder, args.extra, args.with_rho, args.with_lr))
    if not rows:
        raise SystemExit(f"{args.folder}: no finished run with retention measurements")
    text = render(rows)
    with open(os.path.join(args.folder, "radius.md"), "w") as handle:
        handle.write(text)
    plot(rows, os.path.join(args.folder, "radius.png"))
    print(text)
    return text


if __name__ == "__main__":
    main()
