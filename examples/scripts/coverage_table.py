"""The evidence for the coverage guard rail (:mod:`lightning_slsam.selection.coverage`): every
committed layer-sampling row of the short fine-tunes, with the full updates its median
sampled layer could expect at fit start and its accuracy against SAM's.

    python examples/scripts/coverage_table.py   # docs/results/choosing/coverage.{md,json}

Per row (a configuration in one results folder): the run length (the runs' ``global_step``),
the figure the guard rail computes at fit start from the engine of today's classes built on
the task's model (``expected_updates``: the median sampled layer's ``steps * min(1, q *
cap)``), the best validation accuracy over the seeds (mean ± sd, n), SAM's in the same
folder (the choosing folders, run on the CPU: the CPU comparison's SAM of the same task),
and whether the row is *under SAM*: its mean below SAM's mean minus SAM's seed sd. Labels of
configurations no option runs any more are computed from their draw (uniform at
``layer_ratio`` 0.2) and cap where that is all they changed, and left out where they
changed the draw itself (a dense warm-up).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import yaml
from choosing import (  # the same runs, the same rule
    TASK_CONFIGS,
    accuracy,
    build,
    matches_sam,
    runs,
    save,
    spread,
)

from examples.methods import registered
from lightning_slsam import make_engine
from lightning_slsam.selection.coverage import FLOOR, expected_updates

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "docs", "results")
OUT = os.path.join(RESULTS, "choosing")
_PAPER_ABLATION = {"preset": "paper", "bandit_loss": "rank", "head_always_active": True}
_COMPUTE = {**_PAPER_ABLATION, "budget": "compute"}
#: label -> (method, options) of today's classes, or ("uniform", {"cap": c}) for a retired
#: uniform configuration that differed only by its update cap.
LABELS: dict[str, tuple[str, dict[str, Any]]] = {
    "slsam_paper": ("slsam_paper", {}),
    "random_slsam": ("random_slsam", {}),
    "random_default": ("random_slsam", {"preset": "default"}),
    "random_head_cap3": ("random_slsam", {"preset": "default"}),
    "random_head_cap2": ("uniform", {"cap": 2.0}),
    "random_head_scale": ("uniform", {"cap": 5.0}),
    "slsam_compute_cap3": ("slsam", {}),
    "slsam_compute_cap2": ("slsam_ablation", {**_COMPUTE, "max_update_scale": 2.0}),
    "slsam_rank": ("slsam_ablation", {"preset": "paper", "bandit_loss": "rank"}),
    "slsam_head": ("slsam_ablation", {"preset": "paper", "head_always_active": True}),
    "slsam_scale": ("slsam_ablation", {"preset": "paper", "max_update_scale": 5.0}),
    "slsam_rank_head_scale": ("slsam_ablation", {**_PAPER_ABLATION, "max_update_scale": 5.0}),
    "slsam_robust_compute": ("slsam_ablation", {**_COMPUTE, "max_update_scale": 5.0}),
    "slsam_rank_head_compute": ("slsam_ablation", _COMPUTE),
    "sl_s2sam": ("sl_s2sam", {}),
    "slsam_depth": ("slsam_depth", {}),
}
#: folder -> (task name, task kind, SAM's folder, {label in the folder: label above}); a
#: folder's "slsam" is the paper's method where it ran before the default changed.
FOLDERS = {
    "gpu/vision_92": ("vision92", "vision", "gpu/vision_92", {"slsam": "slsam_paper"}),
    "gpu/vision_276": ("vision276", "vision", "gpu/vision_276", {"slsam": "slsam_paper"}),
    "gpu/text_454": ("text454", "text", "gpu/text_454", {"slsam": "slsam_paper"}),
    "gpu/text_1362": ("text1362", "text", "gpu/text_1362", {"slsam": "slsam_paper"}),
    "short_vision_92": ("vision92", "vision", "short_vision_92", {"slsam": "slsam_paper"}),
    "short_vision_276": ("vision276", "vision", "short_vision_276", {"slsam": "slsam_paper"}),
    "short_text_454": ("text454", "text", "short_text_454", {"slsam": "slsam_paper"}),
    "choosing/vision_92": ("vision92", "vision", "short_vision_92", {}),
    "choosing/vision_276": ("vision276", "vision", "short_vision_276", {}),
    "choosing/text_454": ("text454", "text", "short_text_454", {}),
    "lm_454": ("lm454", "lm", "lm_454", {"slsam": "slsam_paper"}),
    "lm_forgetting": ("lm454", "lm", "lm_forgetting", {"slsam": "slsam_compute_cap3"}),
}


def _module(kind: str, cache: dict[str, torch.nn.Module]) -> torch.nn.Module:
    if kind not in cache:
        with open(os.path.join(ROOT, TASK_CONFIGS[kind])) as handle:
            entry = yaml.safe_load(handle)["model"]
        torch.manual_seed(0)
        cache[kind] = build(entry)
    return cache[kind]


def figure(label: str, kind: str, steps: int, cache: dict[str, torch.nn.Module]) -> float:
    """The guard rail's figure for ``label`` on the task's model over ``steps`` steps."""
    method, options = LABELS[label]
    if method == "uniform":
        return float(expected_updates(torch.tensor([0.2]), steps, options["cap"]))
    with registered():  # slsam_ablation, examples/methods.py's
        engine = make_engine(method, _module(kind, cache), seed=0, **options)
    value = expected_updates(engine.selection.inclusion(), steps, engine.update_scale)
    assert value is not None
    return value


def table() -> list[dict[str, Any]]:
    rows, cache = [], {}
    for folder, (task, kind, sam_folder, renames) in FOLDERS.items():
        sam = accuracy(sam_folder, "sam")
        base = os.path.join(RESULTS, folder, "runs")
        if not sam or not os.path.isdir(base):
            continue
        sam_mean, sam_sd = spread(sam)
        for label in sorted(os.listdir(base)):
            name = renames.get(label, label)
            records = runs(folder, label)
            if name not in LABELS or not records:
                continue
            steps = max(int(r["global_step"]) for r in records)
            mean, sd = spread([float(r["best"]) for r in records])
            rows.append({
                "task": task, "folder": folder, "label": label, "configuration": name,
                "steps": steps, "figure": figure(name, kind, steps, cache), "n": len(records),
                "best": mean, "best_sd": sd, "sam": sam_mean, "sam_sd": sam_sd, "n_sam": len(sam),
                "gap_points": 100 * (mean - sam_mean),
                "under_sam": not matches_sam(mean, sam),
            })  # fmt: skip
    return sorted(rows, key=lambda r: (r["figure"], r["task"], r["folder"]))


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Coverage against accuracy: the guard rail's evidence",
        "",
        "Produced by `python examples/scripts/coverage_table.py` from the committed runs. Figure:"
        " the full updates the median sampled layer can expect over the run, computed at fit"
        " start as the guard rail does (`steps * min(1, q * cap)`, today's engine on the task's"
        " model). Under SAM: the mean best `val_acc` below SAM's mean minus SAM's seed sd (SAM"
        " of the same folder; the CPU comparison's for the choosing folders). The guard rail"
        f" (`lightning_slsam.selection.coverage`) warns under {FLOOR:.0f}. Sorted by figure.",
        "",
        "| figure | task | folder | configuration | n | best val_acc | SAM (n) | gap (points)"
        " | under SAM | warned |",
        "|---:|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        warned = r["figure"] < FLOOR
        label = "" if r["label"] == r["configuration"] else f" (`{r['label']}`)"
        lines.append(
            f"| {r['figure']:.0f} | {r['task']} | {r['folder']} | {r['configuration']}"
            f"{label} | {r['n']}"
            f" | {r['best']:.3f} ± {r['best_sd']:.3f} | {r['sam']:.3f} ± {r['sam_sd']:.3f}"
            f" ({r['n_sam']}) | {r['gap_points']:+.1f} | {'**yes**' if r['under_sam'] else 'no'}"
            f" | {'yes' if warned else 'no'} |"
        )
    below = [r for r in rows if r["figure"] < FLOOR]
    above = [r for r in rows if r["figure"] >= FLOOR]
    lost_above = [r for r in above if r["under_sam"]]
    lines += [
        "",
        f"Under {FLOOR:.0f}: {sum(r['under_sam'] for r in below)} of {len(below)} rows under"
        f" SAM. At {FLOOR:.0f} or more: {len(lost_above)} of {len(above)} rows under SAM"
        + (
            " ("
            + "; ".join(
                f"{r['task']} {r['configuration']} {r['gap_points']:+.1f}" for r in lost_above
            )
            + ")."
            if lost_above
            else "."
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    rows = table()
    text = render(rows)
    save(args.out, "coverage", {"floor": FLOOR, "rows": rows}, text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
