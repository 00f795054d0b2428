"""The evidence for LookSAM's reuse check (``lightning_slsam.methods.looksam``): every
committed LookSAM configuration, how many times the SAM step's own correction its reuse
steps add, and its accuracy against SAM's.

    python examples/scripts/looksam_table.py   # docs/results/looksam_alpha/amplification.{md,json}

A LookSAM reuse step adds ``alpha * ||g||`` along ``g_v``, the part of the SAM gradient
orthogonal to the gradient; the SAM step's own part is ``ratio = ||g_v|| / ||g||`` of the
gradient. The *amplification* ``alpha / ratio`` is measured as the check measures it: at the
first SAM step of a one-step fit of the task (the task's config, each run's seed, so the same
model and first batch as the run). Per row: the amplification (mean over the seeds, and its
range), the best validation accuracy over the seeds (mean ± sd, n), SAM's of the same task
(the CPU comparisons' SAM), and whether the row matches SAM (mean at least SAM's mean minus
SAM's seed sd, the rule of ``choosing.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch
import yaml
from choosing import (  # the same runs, the same rule
    RESULTS,
    TASK_CONFIGS,
    build,
    matches_sam,
    runs,
    save,
    spread,
)

from lightning_slsam import LookSAM
from lightning_slsam.methods.looksam import AMPLIFICATION_LIMIT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "docs", "results", "looksam_alpha")
#: (task, task kind, results folder, run label, alpha, SAM's folder)
ROWS = [
    ("vision92", "vision", "choosing/vision_92", "looksam", 0.7, "short_vision_92"),
    ("vision92", "vision", "looksam_alpha/vision_92", "looksam_a010", 0.1, "short_vision_92"),
    ("vision276", "vision", "choosing/vision_276", "looksam", 0.7, "short_vision_276"),
    ("text454", "text", "choosing/text_454", "looksam", 0.7, "short_text_454"),
    ("text454", "text", "looksam_alpha/text_454", "looksam_a035", 0.35, "short_text_454"),
    ("text454", "text", "looksam_alpha/text_454", "looksam_a010", 0.1, "short_text_454"),
    ("lm454", "lm", "lm_forgetting", "looksam", 0.7, "lm_forgetting"),
]


def first_ratio(kind: str, seed: int) -> float:
    """``||g_v|| / ||g||`` at the first SAM step of the task's run with ``seed``."""
    with open(os.path.join(ROOT, TASK_CONFIGS[kind])) as handle:
        spec = yaml.safe_load(handle)
    pl.seed_everything(seed, verbose=False)
    model, data = build(spec["model"]), build(spec["data"])
    callback = LookSAM()
    with tempfile.TemporaryDirectory() as scratch:  # the fit's layer chart
        trainer = pl.Trainer(
            max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
            default_root_dir=scratch,
        )  # fmt: skip
        trainer.fit(model, datamodule=data)
    ratio = callback.engine.parts.orthogonal_ratio
    assert ratio is not None
    return ratio


def table() -> list[dict[str, Any]]:
    rows, cache = [], {}
    for task, kind, folder, label, alpha, sam_folder in ROWS:
        records = runs(folder, label)
        sam = [float(r["best"]) for r in runs(sam_folder, "sam")]
        if not records or not sam:
            continue
        base = os.path.join(RESULTS, folder, "runs", label)
        seeds = sorted(int(d.removeprefix("seed")) for d in os.listdir(base)
                       if os.path.isfile(os.path.join(base, d, "run.json")))  # fmt: skip
        for seed in seeds:
            if (kind, seed) not in cache:
                cache[kind, seed] = first_ratio(kind, seed)
        amplification = [alpha / cache[kind, s] for s in seeds]
        mean, sd = spread([float(r["best"]) for r in records])
        sam_mean, sam_sd = spread(sam)
        rows.append({
            "task": task, "folder": folder, "label": label, "alpha": alpha, "seeds": seeds,
            "ratio": [cache[kind, s] for s in seeds],
            "amplification": sum(amplification) / len(amplification),
            "amplification_range": [min(amplification), max(amplification)],
            "n": len(records), "best": mean, "best_sd": sd,
            "sam": sam_mean, "sam_sd": sam_sd, "n_sam": len(sam),
            "gap_points": 100 * (mean - sam_mean), "matches_sam": matches_sam(mean, sam),
            "per_seed": [
                {"seed": s, "amplification": a, "best": float(r["best"]),
                 "within_sam": float(r["best"]) >= sam_mean - sam_sd}
                for s, a, r in zip(seeds, amplification, records)
            ],
        })  # fmt: skip
    return sorted(rows, key=lambda r: r["amplification"])


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "# LookSAM's reuse against SAM's own correction: the reuse check's evidence",
        "",
        "Produced by `python examples/scripts/looksam_table.py` from the committed runs."
        " Ratio: `||g_v|| / ||g||` at the first SAM step, the SAM gradient's component"
        " orthogonal to the gradient over the gradient (measured as the check does, on each"
        " run's model and first batch). Amplification: `alpha / ratio`, how many times that"
        " component a reuse step adds (mean over the seeds, range). Matches SAM: the mean best"
        " `val_acc` at least SAM's mean minus SAM's seed sd (the CPU comparison's SAM of the"
        f" task). LookSAM warns above {AMPLIFICATION_LIMIT:g}. Sorted by amplification.",
        "",
        "| amplification (range) | task | alpha | ratio | runs | n | best val_acc | SAM (n)"
        " | gap (points) | matches SAM | warned |",
        "|---:|---|---:|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        low, high = r["amplification_range"]
        ratio = sum(r["ratio"]) / len(r["ratio"])
        lines.append(
            f"| {r['amplification']:.1f} ({low:.1f}-{high:.1f}) | {r['task']} | {r['alpha']:g}"
            f" | {ratio:.3f} | {r['folder']}/{r['label']} | {r['n']}"
            f" | {r['best']:.3f} ± {r['best_sd']:.3f} | {r['sam']:.3f} ± {r['sam_sd']:.3f}"
            f" ({r['n_sam']}) | {r['gap_points']:+.1f} | {'yes' if r['matches_sam'] else '**no**'}"
            f" | {'yes' if r['amplification'] > AMPLIFICATION_LIMIT else 'no'} |"
        )
    lines += [
        "",
        "Each run on its own (the check sees one run: its own first SAM step). Within SAM: the"
        " run's best `val_acc` at least SAM's mean minus SAM's seed sd.",
        "",
        "| amplification | task | alpha | seed | best val_acc | within SAM | warned |",
        "|---:|---|---:|---:|---:|---|---|",
    ]
    seeds = sorted(
        ((s, r) for r in rows for s in r["per_seed"]), key=lambda x: x[0]["amplification"]
    )
    for s, r in seeds:
        lines.append(
            f"| {s['amplification']:.1f} | {r['task']} | {r['alpha']:g} | {s['seed']}"
            f" | {s['best']:.3f} | {'yes' if s['within_sam'] else '**no**'}"
            f" | {'yes' if s['amplification'] > AMPLIFICATION_LIMIT else 'no'} |"
        )
    warned = [r for r in rows if r["amplification"] > AMPLIFICATION_LIMIT]
    quiet = [r for r in rows if r["amplification"] <= AMPLIFICATION_LIMIT]
    lines += [
        "",
        f"Above {AMPLIFICATION_LIMIT:g}: {sum(not r['matches_sam'] for r in warned)} of"
        f" {len(warned)} rows under SAM. At {AMPLIFICATION_LIMIT:g} or less:"
        f" {sum(not r['matches_sam'] for r in quiet)} of {len(quiet)} rows under SAM.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    rows = table()
    text = render(rows)
    save(args.out, "amplification", {"limit": AMPLIFICATION_LIMIT, "rows": rows}, text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
