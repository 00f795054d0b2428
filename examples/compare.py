"""Train several methods on one task and tabulate them, from the repository's root:

    python -m examples.compare --config examples/configs/tasks/minilm_rotten_tomatoes.yaml \\
        --methods adamw,sam,slsam,random_slsam --seeds 3 --out runs/compare

Every (method, seed) pair is one ``python -m lightning_slsam.cli fit`` run in a process of
its own (so peak memory is measured per run), on the task config plus the method's callback from
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

The task config's other callbacks run in every run. A SAM callback in it (a
``trainer.callbacks`` entry of one of the package's SAM classes) is kept with its options for
the method it is a configuration of (``SparseLayerSAM(layer_ratio=0.3)`` for ``slsam``),
replaced by each other method's callback and dropped for ``adamw``; compare says which, one
line per method, before training.

``--variant LABEL=METHOD`` adds a configuration of a method under its own name, e.g.
``--variant ranked=slsam_ablation --option ranked.bandit_loss=rank --methods slsam,ranked``.
Extra arguments after ``--`` go to every ``fit`` run, e.g. ``-- --trainer.max_epochs=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from examples.methods import registered
from examples.report import plot, plot_selection, rank_correlation, render, summarize
from lightning_slsam.cli.checks import callback_entry, command_line_value, resolve_callback
from lightning_slsam.core.engine import normalized_entropy
from lightning_slsam.lightning.callback import SAMCallback
from lightning_slsam.lightning.callbacks import METHODS, class_path, make_callbacks
from lightning_slsam.lightning.driver import find_sam_callback

__all__ = ["RunRecorder", "main"]


class RunRecorder(Callback):
    """Records one run's figures and writes them to ``path`` (JSON) at the end of fit.

    Args:
        path: the JSON file to write.
        monitor: the validation metric to track (default ``"val_acc"``).
        mode: ``"max"`` (default) or ``"min"``: which value of ``monitor`` is best.
        report: a held-out metric recorded beside ``monitor`` at every validation (e.g.
            ``"test_acc"`` on a data module's test split), reported at the evaluation where
            ``monitor`` was best and at the last: chosen on validation, read on test.
            ``None`` (default): none.
    """

    def __init__(
        self, path: str, monitor: str = "val_acc", mode: str = "max", report: str | None = None
    ) -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"`mode` must be 'max' or 'min', got {mode!r}.")
        self.path, self.monitor, self.mode, self.report = path, monitor, mode, report
        self.values: list[float] = []
        self.reported: list[float] = []
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
            if self.report is not None:
                held = trainer.callback_metrics.get(self.report)
                if held is None:
                    raise RuntimeError(
                        f"RunRecorder(report={self.report!r}): the validation logged no"
                        f" {self.report!r} (logged: {sorted(trainer.callback_metrics)}); give"
                        " the data module a test split (test_fraction > 0)."
                    )
                self.reported.append(float(held))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        sam = find_sam_callback(trainer)
        best = (max if self.mode == "max" else min)(self.values) if self.values else None
        at = self.values.index(best) if self.values else None  # the first best evaluation
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
        if self.report is not None:
            record.update({
                "report": self.report,
                "reported": self.reported,
                "report_at_best": self.reported[at] if at is not None else None,
                "report_final": self.reported[-1] if self.reported else None,
            })  # fmt: skip
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
        options.setdefault(method, {})[key] = command_line_value(value)
    for method, kwargs in options.items():
        try:
            make_callbacks(variants.get(method, method), **kwargs)
        except (TypeError, ValueError) as err:
            parser.error(f"--option for {method}: {err}")
    return options


@dataclass
class TaskCallbacks:
    """The task configs' ``trainer.callbacks`` (the last file that sets them, as ``fit``
    stacks them): the SAM callback, if one is there, and the others."""

    others: list[Any] = field(default_factory=list)
    #: Where the SAM callback was among the entries (a method's callback goes there).
    index: int = 0
    #: ``"FILE: trainer.callbacks[K]"``, the entry (``class_path``, ``init_args``), the
    #: callback it builds.
    where: str = ""
    entry: dict[str, Any] | None = None
    callback: SAMCallback | None = None


def _task_callbacks(parser: argparse.ArgumentParser, configs: list[str]) -> TaskCallbacks:
    """Reads the task configs' ``trainer.callbacks``; a SAM callback's options are checked."""
    path, listed = None, []
    for config in configs:
        with open(config) as handle:
            loaded = yaml.safe_load(handle)
        trainer = loaded.get("trainer") if isinstance(loaded, dict) else None
        if isinstance(trainer, dict) and "callbacks" in trainer:
            path, listed = config, trainer["callbacks"] or []
    listed = listed if isinstance(listed, list) else [listed]
    task = TaskCallbacks()
    for k, item in enumerate(listed):
        entry = callback_entry(item)
        cls = resolve_callback(entry["class_path"])
        if cls is None:
            task.others.append(item)
            continue
        where = f"{path}: trainer.callbacks[{k}]"
        if task.entry is not None:
            parser.error(
                f"{task.where} and {where} are both SAM callbacks; keep at most one (compare"
                " runs each method's own callback)"
            )
        try:
            task.callback = cls(**entry["init_args"])
        except (TypeError, ValueError) as err:
            parser.error(f"{where}: {err}")
        task.index, task.where, task.entry = len(task.others), where, entry
    return task


def _method_of(callback: SAMCallback) -> str | None:
    """The method name ``callback`` is a configuration of: the name of its class whose
    implied options it has, the most specific one (``slsam_paper`` for
    ``SparseLayerSAM(preset="paper")``, ``slsam`` for ``SparseLayerSAM(layer_ratio=0.3)``)."""
    names = [
        name
        for name, (cls, implied) in METHODS.items()
        if cls is type(callback) and all(getattr(callback, k) == v for k, v in implied.items())
    ]
    return max(names, key=lambda name: len(METHODS[name][1]), default=None)


def sam_callback(
    method: str, options: dict[str, Any], task: TaskCallbacks, base: str | None = None
) -> tuple[dict[str, Any] | None, str | None]:
    """The SAM callback entry of ``method``'s runs (``None`` for AdamW) and, when the task
    config holds a SAM callback, the line saying what the method does with it: keeps it
    (with its options, then ``options``) for the method it is a configuration of, replaces
    it with the method's own callback otherwise, drops it for AdamW."""
    cls, implied = METHODS[base or method]
    own = (
        None
        if cls is None
        else {"class_path": class_path(cls), "init_args": {**implied, **options}}
    )
    if task.callback is None or task.entry is None:
        return own, None
    given = f"the config's {task.callback!r} ({task.where})"
    if cls is None:
        return None, f"== {method}: drops {given}: plain AdamW, no SAM callback"
    if _method_of(task.callback) == (base or method):
        init_args = {**implied, **task.entry["init_args"], **options}
        runs = cls(**init_args)
        kept = {"class_path": class_path(cls), "init_args": init_args}
        return kept, (
            f"== {method}: keeps {given}, a configuration of {base or method}, with its"
            f" options: runs {runs!r}"
        )
    return own, f"== {method}: replaces {given} with its own callback {cls(**own['init_args'])!r}"


def _method_config(
    method: str,
    seed: int,
    out: str,
    monitor: str,
    mode: str,
    options: dict[str, Any],
    base: str | None = None,
    task: TaskCallbacks | None = None,
    report: str | None = None,
) -> dict[str, Any]:
    """The config of one run of ``method`` (a label of ``base`` when given): the task
    config's callbacks but a SAM one, the method's SAM callback (see :func:`sam_callback`),
    and a recorder."""
    task = task or TaskCallbacks()
    sam, _ = sam_callback(method, options, task, base)
    run_dir = os.path.join(out, "runs", method, f"seed{seed}")
    callbacks: list[Any] = list(task.others)
    if sam is not None:
        callbacks.insert(task.index, sam)
    recorder = {"path": os.path.join(run_dir, "run.json"), "monitor": monitor, "mode": mode}
    if report is not None:
        recorder["report"] = report
    # By its importable path: under ``python -m examples.compare`` this module is ``__main__``.
    callbacks.append({"class_path": "examples.compare.RunRecorder", "init_args": recorder})
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


def _with_repository_on_path() -> dict[str, str]:
    """The environment of a run: this one with the repository's root first on ``PYTHONPATH``,
    so that the runs import the tasks (``examples.tasks``) and :class:`RunRecorder`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    with registered():  # the combinations of examples.methods, by name
        return _main(argv)


def _main(argv: list[str] | None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m examples.compare", description=__doc__.splitlines()[0]
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
    parser.add_argument(
        "--methods",
        default="adamw,sam,slsam_paper,slsam",
        help="comma-separated method names or --variant labels; by default AdamW, SAM, the"
        " SL-SAM paper's method and what SparseLayerSAM() runs (default: %(default)s);"
        f" the methods: {', '.join(METHODS)}",
    )
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
    parser.add_argument(
        "--seeds",
        type=int,
        default=3,
        help="runs per method, with consecutive seeds from --seed (default: %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="first seed (default: the task config's seed_everything, else 42)",
    )
    parser.add_argument(
        "--monitor",
        default="val_acc",
        help="the logged validation metric to tabulate (default: %(default)s)",
    )
    parser.add_argument(
        "--mode",
        default="max",
        choices=["max", "min"],
        help="whether the best --monitor value is the largest or the smallest"
        " (default: %(default)s)",
    )
    parser.add_argument(
        "--report",
        default=None,
        help="a held-out metric to record beside --monitor, read at the evaluation where"
        " --monitor was best and at the last (e.g. test_acc, with a data module's"
        " test_fraction > 0): choose on validation, report on test",
    )
    parser.add_argument(
        "--out",
        default="runs/compare",
        help="folder for the runs, the table and the plots (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    # After `--` every word goes to each run's fit; compare's own options there (a misplaced
    # --resume) would reach fit and fail there, once per run. --config is fit's too.
    own = {o for a in parser._actions for o in a.option_strings} - {"--config", "-h", "--help"}
    misplaced = [word for word in extra if word.split("=", 1)[0] in own]
    if misplaced:
        parser.error(
            f"{misplaced[0].split('=', 1)[0]} is an option of compare, but it comes after `--`,"
            " where the words go to every run's `fit`: put it before `--`"
        )
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
    # What each method does with a SAM callback of the task config (printed before training).
    task, said = _task_callbacks(parser, args.config), []
    for method in methods:
        try:
            _, line = sam_callback(method, options.get(method, {}), task, variants.get(method))
        except (TypeError, ValueError) as err:
            parser.error(f"--option for {method} with the options of {task.where}: {err}")
        said += [line] if line else []
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    os.makedirs(os.path.join(args.out, "configs"), exist_ok=True)

    first, origin = _first_seed(args.seed, args.config)
    seeds = list(range(first, first + args.seeds))
    print(f"== seeds {', '.join(map(str, seeds))} ({origin})", flush=True)
    for line in said:
        print(line, flush=True)
    runs = [(seed, m) for seed in seeds for m in methods]
    records: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    started, trained = time.perf_counter(), 0
    for index, (seed, method) in enumerate(runs, 1):
        config = _method_config(method, seed, args.out, args.monitor, args.mode,
                                options.get(method, {}), variants.get(method), task,
                                args.report)  # fmt: skip
        config_path = os.path.join(args.out, "configs", f"{method}_seed{seed}.yaml")
        run_json = config["trainer"]["callbacks"][-1]["init_args"]["path"]
        # The task and the extra arguments, as a comment: --resume reuses a run only if
        # this whole text is unchanged.
        origin = json.dumps({"task": args.config, "extra": extra})
        config_text = f"# {origin}\n" + yaml.safe_dump(config)
        if args.resume and _same_file(config_path, config_text) and os.path.isfile(run_json):
            print(f"== run {index}/{len(runs)}: {method}, seed {seed} (kept)", flush=True)
        else:
            # A run that fails puts the earlier configuration back: its finished run (if any)
            # stays what --resume keeps.
            earlier = _read(config_path)
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
            done = subprocess.run(command, env=_with_repository_on_path())
            if done.returncode != 0:
                if earlier is None:
                    os.remove(config_path)
                else:
                    with open(config_path, "w") as handle:
                        handle.write(earlier)
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


def _read(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        return handle.read()


def _same_file(path: str, text: str) -> bool:
    return _read(path) == text


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


if __name__ == "__main__":
    main()
