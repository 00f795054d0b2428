"""How the layer bandit's loss behaves on real gradient norms: record once, replay many.

    python benchmarks/bandit_replay.py            # both offline tasks, about 15 minutes

1. **Record.** A dense SAM run of each offline task (the vision task for 12 epochs, the
   text task for its 2 epochs, the comparisons' configurations) writes every layer's
   first-pass gradient norm at every step (``runs/bandit_traces/<task>.pt``; reused when
   present).
2. **Replay.** Each candidate loss drives a bandit through the recorded norms: it draws a
   mask, learns from the norms of the drawn layers and draws again, exactly as in
   training, over 3 sampling seeds. The paper's losses and the library's rank loss run
   through :class:`~lightning_slsam.selection.bandit.LayerBandit`; the other scale-free
   candidates that were considered (normalising by the step's largest ``r/p``, linearly or
   squared, or by a running mean of it) are written out here.

Reported per loss: Spearman correlation of each layer's activation frequency with its mean
gradient norm; final normalised entropy (1.0 = uniform); the range of the number of layers
at the floor ``p_min`` and at ``p = 1`` over the steps; and the variance that Algorithm 2
minimises, ``sum(r**2 / p)`` for the last 30 steps' mean norms ``r``, relative to the
uniform distribution's (the optimum, ``p`` proportional to ``r``, is given alongside).
Writes ``benchmarks/results/bandit_replay.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from examples.report import rank_correlation
from lightning_slsam.core.engine import normalized_entropy
from lightning_slsam.selection.bandit import LayerBandit, kl_projection

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
ROOT = os.path.dirname(HERE)
TASKS = {
    # name: (task config, epochs, the step budgets the comparisons use)
    "vision": ("examples/configs/tasks/efficientnet_digits.yaml", 12, (92, 276)),
    "text": ("examples/configs/tasks/minilm_rotten_tomatoes.yaml", 2, (454,)),
}
RATIO, P_MIN = 0.2, 1e-3
#: (label, loss, alpha): the library's losses first, then the candidates written out here.
CANDIDATES = [
    ("shifted (paper default)", "shifted", 1e-3),
    ("shifted, alpha 1e-6", "shifted", 1e-6),
    ("rank, alpha 0.01", "rank", 0.01),
    ("rank, alpha 0.03 (library)", "rank", 0.03),
    ("rank, alpha 0.1", "rank", 0.1),
    ("max-normalised r/p, alpha 0.03", "max1", 0.03),
    ("max-normalised (r/p)^2, alpha 0.03", "max2", 0.03),
    ("running-mean-normalised (r/p)^2, alpha 0.03", "ema", 0.03),
]


def record(task: str, path: str) -> None:
    """Train the task densely with SAM and save every layer's first-pass norm per step."""
    import lightning as L
    import yaml

    from lightning_slsam import SAM
    from lightning_slsam.methods.spec import MethodSpec
    from lightning_slsam.selection.rules import AllLayers

    config_path, epochs, _ = TASKS[task]
    with open(os.path.join(ROOT, config_path)) as handle:
        config = yaml.safe_load(handle)
    trace: list[torch.Tensor] = []

    class Recorder(AllLayers):
        def update(self, active, norms, inclusion=None) -> bool:
            trace.append(norms.clone())
            return False

    class RecordingSpec(MethodSpec):
        def selection(self, layers, generator):
            return Recorder(layers.num_layers)

    class RecordingSAM(SAM):
        spec_class = RecordingSpec

    L.seed_everything(config["seed_everything"])
    model = _instantiate(config["model"])
    data = _instantiate(config["data"])
    sam = RecordingSAM()
    trainer = L.Trainer(
        max_epochs=epochs, callbacks=[sam], logger=False, enable_checkpointing=False,
        num_sanity_val_steps=0, limit_val_batches=0, enable_progress_bar=False,
    )  # fmt: skip
    trainer.fit(model, data)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"names": sam.layer_names, "norms": torch.stack(trace)}, path)


def _instantiate(spec: dict):
    module, _, name = spec["class_path"].rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    return cls(**spec.get("init_args", {}))


def replay(norms: torch.Tensor, loss: str, alpha: float, seed: int) -> dict:
    """Drive one bandit through the recorded norms; the selection's statistics."""
    steps, n = norms.shape
    budget = RATIO * n
    library = loss in ("shifted", "paper", "rank")
    gen = torch.Generator().manual_seed(seed)
    bandit = LayerBandit(n, RATIO, P_MIN, alpha, loss, gen) if library else None
    p = torch.full((n,), RATIO, dtype=torch.float64)
    scale = None
    counts = torch.zeros(n, dtype=torch.float64)
    entropy, floor, full = [], [], []
    for t in range(steps):
        if bandit is not None:
            mask = bandit.sample()
            bandit.update(mask, norms[t])
            p = bandit.probs
        else:
            mask = _draw(p, gen)
            z = torch.where(mask, norms[t], 0.0) / p
            if loss == "ema":
                scale = z.max() if scale is None else 0.9 * scale + 0.1 * z.max()
                zz = z / scale
                k = torch.where(mask, zz[mask].max() ** 2 - zz**2, 0.0)
            else:
                zz = z / z.max().clamp_min(1e-300)
                k = torch.where(mask, 1 - (zz if loss == "max1" else zz**2), 0.0)
            p = kl_projection(torch.log(p) - alpha * k / p, budget, P_MIN, 1.0)
        counts += mask.double()
        entropy.append(normalized_entropy(p))
        floor.append(int((p <= P_MIN * (1 + 1e-9)).sum()))
        full.append(int((p >= 1 - 1e-9).sum()))
    recent = norms[-30:].mean(0)
    uniform = float((recent**2 / RATIO).sum())
    optimum = kl_projection(torch.log(recent.clamp_min(1e-300)), budget, P_MIN, 1.0)
    return {
        "spearman": rank_correlation(counts, norms.mean(0)),
        "final_entropy": entropy[-1],
        "floor_range": [min(floor), max(floor)],
        "full_range": [min(full), max(full)],
        "variance_vs_uniform": float((recent**2 / p).sum()) / uniform,
        "optimum_vs_uniform": float((recent**2 / optimum).sum()) / uniform,
        "entropy": entropy,
        "floor": floor,
    }


def _draw(p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    while True:
        mask = torch.rand(p.numel(), generator=gen, dtype=torch.float64) < p
        if bool(mask.any()):
            return mask


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=os.path.join(ROOT, "runs", "bandit_traces"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results: dict[str, dict] = {}
    for task, (_, _, budgets) in TASKS.items():
        path = os.path.join(args.traces, f"{task}.pt")
        if not os.path.isfile(path):
            print(f"recording {task} (dense SAM run) -> {path}", flush=True)
            record(task, path)
        trace = torch.load(path)["norms"].double()
        for steps in budgets:
            key = f"{task}, {steps} steps"
            results[key] = {}
            for label, loss, alpha in CANDIDATES:
                runs = [replay(trace[:steps], loss, alpha, s) for s in range(args.seeds)]
                results[key][label] = _summary(runs)
                print(f"{key:20s} {label:45s} {_row(results[key][label])}", flush=True)
    _write(results, args.out)


def _summary(runs: list[dict]) -> dict:
    def mean(key: str) -> float:
        return statistics.mean(r[key] for r in runs)

    return {
        "spearman": mean("spearman"),
        "final_entropy": mean("final_entropy"),
        "floor_range": _range([r["floor_range"] for r in runs]),
        "full_range": _range([r["full_range"] for r in runs]),
        "variance_vs_uniform": mean("variance_vs_uniform"),
        "optimum_vs_uniform": mean("optimum_vs_uniform"),
        "entropy": [statistics.mean(x) for x in zip(*(r["entropy"] for r in runs))],
        "floor": [statistics.mean(x) for x in zip(*(r["floor"] for r in runs))],
    }


def _range(ranges: list[list[int]]) -> list[int]:
    return [min(r[0] for r in ranges), max(r[1] for r in ranges)]


def _row(s: dict) -> str:
    return (
        f"| {s['spearman']:.2f} | {s['final_entropy']:.3f} | {s['floor_range'][0]}-"
        f"{s['floor_range'][1]} | {s['full_range'][0]}-{s['full_range'][1]} |"
        f" {s['variance_vs_uniform']:.3g} ({s['optimum_vs_uniform']:.3f}) |"
    )


def _write(results: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    lines = [
        "# The bandit's loss on recorded gradient norms",
        "",
        "Produced by `python benchmarks/bandit_replay.py`: each loss drives a bandit"
        f" (layer ratio {RATIO}, p_min {P_MIN}) through the per-layer first-pass gradient"
        " norms of a dense SAM run, 3 sampling seeds. Spearman: activation frequency against"
        " mean gradient norm. Floor / p = 1: range over the steps of the number of layers"
        " there. Variance: `sum(r^2/p)` at the end (last 30 steps' mean norms), relative to"
        " uniform sampling; in brackets the best possible (p proportional to r).",
    ]
    for key, rows in results.items():
        lines += [
            "",
            f"## {key}",
            "",
            "| loss | Spearman | final entropy | at floor | at p = 1 | variance vs uniform |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        lines += [f"| {label} {_row(s)}" for label, s in rows.items()]
    with open(os.path.join(out, "bandit_replay.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    slim = {k: {label: {m: v for m, v in s.items() if m not in ("entropy", "floor")}
                for label, s in rows.items()} for k, rows in results.items()}  # fmt: skip
    with open(os.path.join(out, "bandit_replay.json"), "w") as handle:
        json.dump(slim, handle, indent=2)
    _plot(results, os.path.join(out, "bandit_replay.png"))
    print(f"wrote {out}/bandit_replay.md, .json, .png")


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ["shifted (paper default)", "rank, alpha 0.03 (library)"]
    keys = [k for k in results if not k.startswith("vision, 92")]
    fig, axes = plt.subplots(2, len(keys), figsize=(6 * len(keys), 7), squeeze=False)
    for col, key in enumerate(keys):
        for label in shown:
            s = results[key][label]
            axes[0][col].plot(s["entropy"], label=label)
            axes[1][col].plot(s["floor"], label=label)
        axes[0][col].set_title(key)
        axes[0][col].set_ylabel("normalised entropy")
        axes[1][col].set_ylabel("layers at p_min")
        axes[1][col].set_xlabel("step")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
