"""``lightning-slsam compare``: train several methods on one task and tabulate them.

    lightning-slsam compare --config examples/configs/tasks/minilm_rotten_tomatoes.yaml \\
        --methods adamw,sam,slsam,random_slsam --seeds 3 --out runs/compare

Every (method, seed) pair is one ``lightning-slsam fit`` run in a process of its own (so
peak memory is measured per run), on the task config plus the method's callback from
:data:`lightning_slsam.METHODS` and a recorder. Runs go seed by seed, every method within a
seed, so a slow spell of a shared machine spreads over the methods instead of landing on
one. The table gives, per method, the best validation metric over the run (mean ± std over
seeds, as the SL-SAM paper reports), the final one, the active ratio, the training time per
epoch (batches only, validation excluded; each run's mean over all its epochs, median over the
seeds) and the peak memory, the last two also relative to SAM, and for the bandit methods
how the selection behaved (Spearman correlation of each layer's activation frequency with
its mean gradient norm, final entropy, layers at the floor). Plots: the metric against the
active ratio (the paper's Figure 1), each bandit method's per-layer activation frequency
and final probability (its Figure 3), and the entropy and floor count over the steps.

``--variant LABEL=METHOD`` adds a configuration of a method under its own name, e.g.
``--variant warm=slsam --option warm.dense_warmup=0.3 --methods slsam,warm``. Extra
arguments after ``--`` go to every ``fit`` run, e.g. ``-- --trainer.max_epochs=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from lightning_slsam.callback import find_sam_callback
from lightning_slsam.methods import METHODS, make_callbacks
from lightning_slsam.metrics import normalized_entropy, rank_correlation

__all__ = ["RunRecorder", "main"]


class RunRecorder(Callback):
    """Records one run's figures and writes them to ``path`` (JSON) at the end of fit.

    Args:
        path: the JSON file to write.
        monitor: the validation metric to track (default ``"val_acc"``).
        mode: ``"max"`` (default) or ``"min"``: which value of ``monitor`` is best.
    """

    def __init__(self, path: str, monitor: str = "val_acc", mode: str = "max") -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"`mode` must be 'max' or 'min', got {mode!r}.")
        self.path, self.monitor, self.mode = path, monitor, mode
        self.values: list[float] = []
        self.epoch_times: list[float] = []
        self.entropy: list[float] = []
        self.floor: list[float] = []
        self._epoch = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._epoch += time.perf_counter() - self._start
        sam = find_sam_callback(trainer)
        if sam is not None and sam.engine is not None:
            self.entropy.append(normalized_entropy(sam.engine.selection.probs))
            floor = sam.selection_metrics().get("slsam/floor_layers")
            if floor is not None:
                self.floor.append(floor)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epoch_times.append(self._epoch)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        if value is not None and not trainer.sanity_checking:
            self.values.append(float(value))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        sam = find_sam_callback(trainer)
        best = (max if self.mode == "max" else min)(self.values) if self.values else None
        if torch.cuda.is_available():
            memory = torch.cuda.max_memory_allocated() / 2**20
        else:
            memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        record = {
            "monitor": self.monitor,
            "best": best,
            "final": self.values[-1] if self.values else None,
            "values": self.values,
            "epoch_times": self.epoch_times,
            "global_step": trainer.global_step,
            "peak_memory_mb": memory,
            "memory_kind": "cuda max_memory_allocated" if torch.cuda.is_available() else "peak RSS",
            "active_ratio": sam.mean_active_ratio if sam is not None else 1.0,
            "layer_frequency_png": sam.frequency_plot_path if sam is not None else None,
            "layer_frequency_csv": sam.frequency_csv_path if sam is not None else None,
            "entropy": self.entropy,
            "floor_layers": self.floor,
        }
        if sam is not None and sam.engine is not None:
            engine = sam.engine
            record["spearman_frequency_norm"] = rank_correlation(
                engine.frequencies(), engine.mean_norms()
            )
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "w") as handle:
            json.dump(record, handle, indent=2)


def _parse_variants(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, str]:
    """``["warm=slsam"]`` -> ``{"warm": "slsam"}``: a label for a configuration of a method."""
    variants: dict[str, str] = {}
    for item in items:
        label, _, method = item.partition("=")
        if not label or method not in METHODS or label in METHODS or "." in label:
            parser.error(
                f"--variant {item!r} must read LABEL=METHOD with METHOD one of {sorted(METHODS)}"
                " and LABEL a new name"
            )
        variants[label] = method
    return variants


def _parse_options(
    parser: argparse.ArgumentParser,
    items: list[str],
    methods: list[str],
    variants: dict[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """``["slsam.layer_ratio=0.25"]`` -> ``{"slsam": {"layer_ratio": 0.25}}`` (YAML values),
    checked by building each method's callback with them."""
    variants = variants or {}
    options: dict[str, dict[str, Any]] = {}
    for item in items:
        name, _, value = item.partition("=")
        method, _, key = name.partition(".")
        if not (value and key) or method not in methods:
            parser.error(f"--option {item!r} must read METHOD.KEY=VALUE with METHOD in --methods")
        options.setdefault(method, {})[key] = yaml.safe_load(value)
    for method, kwargs in options.items():
        try:
            make_callbacks(variants.get(method, method), **kwargs)
        except (TypeError, ValueError) as err:
            parser.error(f"--option for {method}: {err}")
    return options


def _method_config(
    method: str,
    seed: int,
    out: str,
    monitor: str,
    mode: str,
    options: dict[str, Any],
    base: str | None = None,
) -> dict[str, Any]:
    """The config of one run of ``method`` (a label of ``base`` when given)."""
    cls, preset = METHODS[base or method]
    preset = {**preset, **options}
    run_dir = os.path.join(out, "runs", method, f"seed{seed}")
    callbacks: list[dict[str, Any]] = []
    if cls is not None:
        callbacks.append({"class_path": f"lightning_slsam.{cls.__name__}", "init_args": preset})
    recorder = {"path": os.path.join(run_dir, "run.json"), "monitor": monitor, "mode": mode}
    callbacks.append({"class_path": "lightning_slsam.compare.RunRecorder", "init_args": recorder})
    return {
        "seed_everything": seed,
        "trainer": {
            "callbacks": callbacks,
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {
                    "save_dir": os.path.join(out, "runs"),
                    "name": method,
                    "version": f"seed{seed}",
                },
            },
        },
    }


def _stats(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(records: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per-method means (and std of the metric) over the seeds."""
    rows = {}
    for method, runs in records.items():
        best = [r["best"] for r in runs if r["best"] is not None]
        final = [r["final"] for r in runs if r["final"] is not None]
        # Each run's training time per epoch (its total over its epochs, so a costlier
        # first epoch counts), then the median over the seeds: one run slowed by a busy
        # machine does not move it, as it would move a mean.
        epoch = [statistics.mean(r["epoch_times"]) for r in runs if r["epoch_times"]]
        spearman = [r.get("spearman_frequency_norm") for r in runs]
        spearman = [x for x in spearman if x is not None and x == x]
        entropy = [r["entropy"][-1] for r in runs if r.get("entropy")]
        floor = [r["floor_layers"][-1] for r in runs if r.get("floor_layers")]
        rows[method] = {
            "seeds": len(runs),
            "best": _stats(best) if best else (None, None),
            "final": _stats(final) if final else (None, None),
            "active_ratio": statistics.mean(r["active_ratio"] for r in runs),
            "epoch_time_s": statistics.median(epoch) if epoch else None,
            "peak_memory_mb": statistics.mean(r["peak_memory_mb"] for r in runs),
            "spearman": statistics.mean(spearman) if spearman else None,
            "final_entropy": statistics.mean(entropy) if entropy else None,
            "final_floor": statistics.mean(floor) if floor else None,
        }
    base = rows.get("sam") or rows.get("adasam")
    for row in rows.values():
        for key in ("epoch_time_s", "peak_memory_mb"):
            ok = base is not None and base[key] and row[key] is not None
            row[f"{key}_vs_sam"] = row[key] / base[key] if ok else None
    return rows


def render(rows: dict[str, dict[str, Any]], monitor: str, task: str) -> str:
    def pct(value: float | None) -> str:
        return "" if value is None else f" ({(value - 1) * 100:+.1f}%)"

    lines = [
        f"# Comparison on `{task}`",
        "",
        f"`{monitor}`: best over the run and final, mean ± std over seeds. Active ratio:"
        " parameter fraction with a gradient, summed over a step's passes (AdamW 1.0x, SAM"
        " 2.0x). Epoch time: training batches only, each run's mean over all its epochs (a"
        " costlier warm-up counts), median over the seeds."
        " Memory: peak RSS of the run's process on"
        " a CPU (CUDA: max_memory_allocated). Percentages relative to SAM. Selection:"
        " Spearman correlation of the layers' activation frequencies with their mean"
        " first-pass gradient norms, final normalised entropy of the distribution (1.0 ="
        " uniform), layers at the floor p_min at the end (bandit methods).",
        "",
        f"| method | seeds | best {monitor} | final {monitor} | active ratio | epoch time (s) |"
        " peak memory (MB) | Spearman | entropy | at floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for method, row in rows.items():
        (bm, bs), (fm, fs) = row["best"], row["final"]
        best = "-" if bm is None else f"{bm:.4f} ± {bs:.4f}"
        final = "-" if fm is None else f"{fm:.4f} ± {fs:.4f}"
        epoch = row["epoch_time_s"]
        floor = row.get("final_floor")
        lines.append(
            f"| {method} | {row['seeds']} | {best} | {final} | {row['active_ratio']:.3f}x"
            f" | {'-' if epoch is None else f'{epoch:.1f}'}{pct(row['epoch_time_s_vs_sam'])}"
            f" | {row['peak_memory_mb']:.0f}{pct(row['peak_memory_mb_vs_sam'])}"
            f" | {num(row.get('spearman'), '.2f')} | {num(row.get('final_entropy'), '.3f')}"
            f" | {num(floor, '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: dict[str, dict[str, Any]], monitor: str, path: str) -> None:
    """The SL-SAM paper's Figure 1: the metric against the active ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5), constrained_layout=True)
    for method, row in rows.items():
        mean, std = row["best"]
        if mean is None:
            continue
        ax.errorbar(row["active_ratio"], mean, yerr=std, fmt="o", capsize=4, label=method)
        ax.annotate(method, (row["active_ratio"], mean), textcoords="offset points",
                    xytext=(5, 5), fontsize=8)  # fmt: skip
    ax.set_xlabel("active ratio (parameter fraction with a gradient, summed over passes)")
    ax.set_ylabel(f"best {monitor}")
    ax.set_title("Accuracy against the gradient work per step")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_selection(records: dict[str, list[dict[str, Any]]], path: str) -> bool:
    """Entropy of the layer distribution and layers at the floor over the steps, per method
    (mean over the seeds). Returns False (no file) when no method has a learning selection."""
    traced = {m: runs for m, runs in records.items() if any(r.get("floor_layers") for r in runs)}
    if not traced:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_e, ax_f) = plt.subplots(1, 2, figsize=(12, 4.6), constrained_layout=True)
    for n, (method, runs) in enumerate(traced.items()):
        # Ten colours, then the same colours dashed: every line stays distinguishable.
        style = {"color": f"C{n % 10}", "ls": "-" if n < 10 else "--", "lw": 1.3}
        for key, ax in (("entropy", ax_e), ("floor_layers", ax_f)):
            series = [r[key] for r in runs if r.get(key)]
            length = min(len(x) for x in series)
            mean = [statistics.mean(x[i] for x in series) for i in range(length)]
            ax.plot(range(1, length + 1), mean, label=method, **style)
    ax_e.set_ylabel("normalised entropy (1.0 = uniform)")
    ax_f.set_ylabel("layers at the floor p_min")
    for ax in (ax_e, ax_f):
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    # One legend for both panels, below them, so no line is hidden behind it.
    fig.legend(*ax_e.get_legend_handles_labels(), loc="outside lower center", fontsize=8,
               ncol=min(len(traced), 4), frameon=False)  # fmt: skip
    ax_e.set_title("How far the layer distribution moved from uniform")
    ax_f.set_title("How many layers the bandit pushed to the floor")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="lightning-slsam compare", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--render", metavar="OUT", help="only re-tabulate and re-plot OUT/comparison.json"
    )
    parser.add_argument(
        "--config",
        action="append",
        help="task config (model, data, trainer); repeat to stack files",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="METHOD.KEY=VALUE",
        help="override a method's option, e.g. slsam.layer_ratio=0.25",
    )
    parser.add_argument("--methods", default="adamw,sam,slsam", help="names from METHODS")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=METHOD",
        help="a configuration of METHOD under its own name, set with --option LABEL.KEY=VALUE",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="reuse the runs of an interrupted compare in --out (each run.json) with the same"
        " configuration, and train only the missing ones",
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="first seed (default: the task config's seed_everything, else 42)",
    )
    parser.add_argument("--monitor", default="val_acc")
    parser.add_argument("--mode", default="max", choices=["max", "min"])
    parser.add_argument("--out", default="runs/compare")
    args = parser.parse_args(argv)
    if args.render:
        return _render_saved(args.render, args.monitor)
    if not args.config:
        parser.error("--config is required (or --render OUT)")
    variants = _parse_variants(parser, args.variant)
    methods = [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in methods if m not in METHODS and m not in variants]
    if unknown:
        parser.error(
            f"unknown method(s) {unknown}; choose from {sorted(METHODS)} or a --variant label"
        )
    for path in args.config:
        if not os.path.isfile(path):
            parser.error(f"--config {path!r} is not a file")
    options = _parse_options(parser, args.option, methods, variants)
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    os.makedirs(os.path.join(args.out, "configs"), exist_ok=True)

    first, origin = _first_seed(args.seed, args.config)
    seeds = list(range(first, first + args.seeds))
    print(f"== seeds {', '.join(map(str, seeds))} ({origin})", flush=True)
    runs = [(seed, m) for seed in seeds for m in methods]
    records: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    started, trained = time.perf_counter(), 0
    for index, (seed, method) in enumerate(runs, 1):
        config = _method_config(method, seed, args.out, args.monitor, args.mode,
                                options.get(method, {}), variants.get(method))  # fmt: skip
        config_path = os.path.join(args.out, "configs", f"{method}_seed{seed}.yaml")
        run_json = config["trainer"]["callbacks"][-1]["init_args"]["path"]
        # The task and the extra arguments, as a comment: --resume reuses a run only if
        # this whole text is unchanged.
        origin = json.dumps({"task": args.config, "extra": extra})
        config_text = f"# {origin}\n" + yaml.safe_dump(config)
        if args.resume and _same_file(config_path, config_text) and os.path.isfile(run_json):
            print(f"== run {index}/{len(runs)}: {method}, seed {seed} (kept)", flush=True)
        else:
            with open(config_path, "w") as handle:
                handle.write(config_text)
            eta = ""
            if trained:
                left = (time.perf_counter() - started) / trained * (len(runs) - index + 1)
                eta = f", about {left / 60:.0f} min left"
            print(f"== run {index}/{len(runs)}: {method}, seed {seed}{eta}", flush=True)
            configs = [arg for path in args.config for arg in ("--config", path)]
            command = [sys.executable, "-m", "lightning_slsam.cli", "fit", *configs,
                       "--config", config_path, *extra]  # fmt: skip
            done = subprocess.run(command)
            if done.returncode != 0:
                raise SystemExit(
                    f"the {method} run with seed {seed} failed (exit {done.returncode})"
                )
            trained += 1
        with open(run_json) as handle:
            records[method].append(json.load(handle))

    return _write(records, args.config, args.monitor, args.out)


def _first_seed(given: int | None, configs: list[str]) -> tuple[int, str]:
    """The first seed and where it came from: ``--seed``, else the last task config's
    integer ``seed_everything``, else 42."""
    seed, source = None, None
    for path in configs:
        with open(path) as handle:
            loaded = yaml.safe_load(handle)
        value = loaded.get("seed_everything") if isinstance(loaded, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            seed, source = value, path
    if given is not None:
        if seed is not None and seed != given:
            return given, f"--seed; the config's seed_everything {seed} is replaced"
        return given, "--seed"
    if seed is not None:
        return seed, f"seed_everything of {source}"
    return 42, "default: no integer seed_everything in the config"


def _same_file(path: str, text: str) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path) as handle:
        return handle.read() == text


def _render_saved(out: str, monitor: str) -> dict[str, Any]:
    path = os.path.join(out, "comparison.json")
    if not os.path.isfile(path):
        raise SystemExit(f"--render {out!r}: no comparison.json there")
    with open(path) as handle:
        saved = json.load(handle)
    configs = saved["task"] if isinstance(saved["task"], list) else [saved["task"]]
    monitor = next(iter(saved["runs"].values()))[0].get("monitor", monitor)
    return _write(saved["runs"], configs, monitor, out)


def _write(
    records: dict[str, list[dict[str, Any]]], configs: list[str], monitor: str, out: str
) -> dict[str, Any]:
    """Tabulates, plots and saves the runs' records in ``out``."""
    rows = summarize(records)
    task = " + ".join(os.path.basename(path) for path in configs)
    table = render(rows, monitor, task)
    with open(os.path.join(out, "comparison.md"), "w") as handle:
        handle.write(table)
    with open(os.path.join(out, "comparison.json"), "w") as handle:
        json.dump({"task": configs, "rows": rows, "runs": records}, handle, indent=2)
    plot(rows, monitor, os.path.join(out, "accuracy_vs_active_ratio.png"))
    saved = ["comparison.md/.json", "accuracy_vs_active_ratio.png"]
    if plot_selection(records, os.path.join(out, "selection_over_steps.png")):
        saved.append("selection_over_steps.png")
    # Each bandit method's first run: per-layer frequency and final probability.
    first_bandit = True
    for method, runs in records.items():
        png = runs[0].get("layer_frequency_png") if runs else None
        if not (png and os.path.isfile(png) and any(r.get("floor_layers") for r in runs)):
            continue
        names = ["layer_frequency.png"] if first_bandit else []
        names.append(f"layer_frequency_{method}.png")
        for name in names:
            shutil.copy(png, os.path.join(out, name))
        saved += names
        first_bandit = False
    print(table)
    print(f"Saved in {out}: {', '.join(saved)}")
    return {"rows": rows, "records": records}
