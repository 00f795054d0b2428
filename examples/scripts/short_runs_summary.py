"""The goal check of the short-fine-tune comparison, from its saved comparisons.

    python examples/scripts/short_runs_summary.py docs/results/short_vision_92 \\
        docs/results/short_vision_276 docs/results/short_text_454 > summary.md

For each comparison and each SL-SAM configuration: its best validation accuracy (mean ±
std over the seeds), whether that lies within SAM's seed spread (at least SAM's mean minus
SAM's standard deviation) or above it, its epoch time relative to SAM's (the goal is at
most 0.75x), and its margin over Random-SL-SAM in units of the two runs' pooled standard
deviation (a margin above 2 is "clearly above").
"""

from __future__ import annotations

import json
import math
import os
import sys

BASELINES = ("adamw", "sam", "random_slsam")
TIME_GOAL = 0.75


def rows(out: str) -> list[str]:
    with open(os.path.join(out, "comparison.json")) as handle:
        saved = json.load(handle)["rows"]
    sam_mean, sam_std = saved["sam"]["best"]
    rand_mean, rand_std = saved["random_slsam"]["best"]
    lines = [
        f"### {os.path.basename(out.rstrip('/'))}",
        "",
        f"SAM: {sam_mean:.4f} ± {sam_std:.4f}; Random-SL-SAM: {rand_mean:.4f} ± {rand_std:.4f};"
        f" AdamW: {saved['adamw']['best'][0]:.4f} ± {saved['adamw']['best'][1]:.4f}.",
        "",
        "| configuration | best accuracy | within SAM's spread | time / SAM | over Random-SL-SAM"
        " (pooled std) | goal met |",
        "|---|---:|---|---:|---:|---|",
    ]
    for method, row in saved.items():
        if method in BASELINES:
            continue
        mean, std = row["best"]
        within = mean >= sam_mean - sam_std
        time = row["epoch_time_s_vs_sam"]
        pooled = math.sqrt((std**2 + rand_std**2) / 2) or 1e-12
        margin = (mean - rand_mean) / pooled
        fast = time is not None and time <= TIME_GOAL
        lines.append(
            f"| {method} | {mean:.4f} ± {std:.4f} | {'yes' if within else 'no'}"
            f" ({mean - sam_mean:+.4f}) | {'-' if time is None else f'{time:.2f}x'}"
            f" | {margin:+.1f} | {'yes' if within and fast else 'no'} |"
        )
    return lines


def main(outs: list[str]) -> None:
    if not outs:
        raise SystemExit(__doc__)
    lines = []
    for out in outs:
        lines += [*rows(out), ""]
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
