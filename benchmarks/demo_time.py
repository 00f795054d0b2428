"""Time the demo end to end and record what it prints: the measurements that the README,
docs/quickstart.md and the demo config quote (a test holds them to it).

    python benchmarks/demo_time.py                          # this machine's own kernels
    python benchmarks/demo_time.py --kernels avx2 --threads 1
    python benchmarks/demo_time.py --profile                # where a step's time goes

It runs ``lightning-slsam fit --demo`` as ``make demo`` does, in a scratch folder, and keeps
the wall time from start to exit (the installation ``make demo`` runs first on a fresh
machine is not counted), the steps, the final validation accuracy and the step it was
measured at: one row per machine and setting of ``benchmarks/results/demo.{json,md}``.
``--kernels avx2`` restricts torch's kernels (ATen, MKL, oneDNN) to AVX2 and ``--threads``
sets the thread count, so one machine shows what a CPU without AVX-512 or with one core
behind its two vCPUs takes. ``--profile`` times the demo's phases in one process (loading
and tokenising, the training steps, the validations) and the operators a step spends its
time in. Measure on an otherwise idle machine: a busy one gives a longer time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

_SUMMARY = re.compile(r"Run summary \((?P<method>\w+), (?P<steps>\d+) steps\)")
_VAL_ACC = re.compile(r"final val_acc: (?P<acc>[0-9.]+) \(validated at step (?P<at>\d+)\)")

#: The environment that restricts torch's CPU kernels to an instruction set.
KERNELS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "ONEDNN_MAX_CPU_ISA": "AVX2"},
}  # fmt: skip


def parse(output: str) -> dict:
    """The method, steps, final validation accuracy and its step from a run's output; raises
    ``ValueError`` when the run summary is missing or says the run was cut short."""
    summary, acc = _SUMMARY.search(output), _VAL_ACC.search(output)
    if summary is None or acc is None:
        raise ValueError("the output holds no run summary with a final val_acc")
    if re.search(r"stopped at step|interrupted by", output[summary.start() :]):
        raise ValueError("the demo stopped before its planned length: " + output[-500:])
    return {
        "method": summary["method"],
        "steps": int(summary["steps"]),
        "val_acc": float(acc["acc"]),
        "validated_at": int(acc["at"]),
    }


def environment(kernels: str, threads: int | None) -> dict[str, str]:
    """The variables a run under ``kernels`` and ``threads`` sets."""
    env = dict(KERNELS[kernels])
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _cpu() -> str:
    """The CPU's model name (``platform.processor()`` says only ``x86_64`` on Linux)."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(kernels: str = "native", threads: int | None = None) -> dict:
    """Run the demo once and return its record."""
    command = [sys.executable, "-m", "lightning_slsam.cli", "fit", "--demo"]
    env = {**os.environ, **environment(kernels, threads)}
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        done = subprocess.run(command, cwd=scratch, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
        seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the demo failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
    import torch

    return {
        **parse(done.stdout),
        "seconds": round(seconds, 1),
        "command": "lightning-slsam fit --demo",
        "kernels": kernels,
        "cpus": os.cpu_count(),
        "torch_threads": threads or torch.get_num_threads(),
        "processor": _cpu(),
        "torch": torch.__version__,
        "date": date.today().isoformat(),
    }


def profile(steps: int = 40, profiled: int = 20) -> dict:
    """The demo's phases timed in this process (startup to the first step: the model loaded,
    the sentences tokenised; each training step; each validation) over its first ``steps``
    steps with validation every 20, and the operators of ``profiled`` steps by share of
    their self CPU time."""
    begin = time.perf_counter()
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_slsam.cli.command import SLSAMCLI, demo_config_path

    class Phases(Callback):
        def __init__(self) -> None:
            self.times: dict[str, list[float]] = {"step": [], "validation": []}
            self.profiler: Any = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.times["startup"] = [time.perf_counter() - begin]

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == steps - profiled:
                self.profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU]
                )
                self.profiler.__enter__()
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            self.times["step"].append(time.perf_counter() - self.started)

        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            self.started_val = time.perf_counter()

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            self.times["validation"].append(time.perf_counter() - self.started_val)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.profiler.__exit__(None, None, None)

    args = [
        *("--config", demo_config_path(), f"--trainer.max_steps={steps}"),
        *("--trainer.val_check_interval=20", "--trainer.logger=false"),
        *("--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"),
    ]
    cli = SLSAMCLI(model_class=None, datamodule_class=None, subclass_mode_model=True,
                   subclass_mode_data=True, args=args, run=False,
                   save_config_callback=None)  # fmt: skip
    phases = Phases()
    cli.trainer.callbacks.append(phases)
    cli.trainer.fit(cli.model, cli.datamodule)
    events = phases.profiler.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
    step_times = phases.times["step"][2:]  # the first steps warm up
    return {
        "kernels": os.environ.get("ATEN_CPU_CAPABILITY", "native"),
        "torch_threads": torch.get_num_threads(),
        "processor": _cpu(),
        "startup_s": round(phases.times["startup"][0], 1),
        "step_s": round(sum(step_times) / len(step_times), 3),
        "validation_s": round(sum(phases.times["validation"]) / len(phases.times["validation"]), 1),
        "operators": [[e.key, round(e.self_cpu_time_total / total, 3)] for e in top],
        "date": date.today().isoformat(),
    }


def table(results: dict) -> str:
    """``demo.md``: each run's row, then each profile's phases and operators."""
    runs = results["runs"]
    lines = [
        "# The demo, timed (`python benchmarks/demo_time.py`)",
        "",
        "`lightning-slsam fit --demo` end to end, as `make demo` runs it once installed (the"
        " installation is not counted). `kernels`: `native` is what torch picks on the CPU;"
        " `avx2` restricts ATen, MKL and oneDNN to AVX2 (`--kernels avx2`), as on a CPU"
        " without AVX-512, and one thread stands for two vCPUs that are one core's two"
        " hyperthreads.",
        "",
        "| CPU | cores | kernels | threads | steps | validation accuracy (at step) | wall time"
        " | date |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    for r in runs:
        lines.append(
            f"| {r['processor']} | {r['cpus']} | {r['kernels']} | {r['torch_threads']} |"
            f" {r['steps']} | {r['val_acc']:.4f} ({r['validated_at']}) | {r['seconds']:.0f} s"
            f" ({r['seconds'] / 60:.1f} min) | {r['date']} |"
        )
    for p in results.get("profiles", []):
        lines += [
            "",
            f"## Where the time goes: {p['processor']}, {p['kernels']} kernels,"
            f" {p['torch_threads']} thread{'s' * (p['torch_threads'] > 1)} (`--profile`)",
            "",
            f"Startup to the first step (torch, Lightning and Transformers imported, the model"
            f" loaded, the sentences tokenised):"
            f" {p['startup_s']} s; a training step: {p['step_s']} s; a validation of the"
            f" 1,280 held-out sentences: {p['validation_s']} s. A step's self CPU time by"
            " operator:",
            "",
            "| operator | share |",
            "|---|---:|",
            *(f"| `{name}` | {share:.1%} |" for name, share in p["operators"]),
        ]
    return "\n".join(lines) + "\n"


def _same(a: dict, b: dict) -> bool:
    keys = ("processor", "kernels", "torch_threads")
    return all(a.get(k) == b.get(k) for k in keys)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "demo"), help="path without suffix")
    parser.add_argument("--kernels", choices=sorted(KERNELS), default="native")
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--profile", action="store_true", help="phases and operators instead")
    args = parser.parse_args(argv)
    path = Path(args.out + ".json")
    results = json.loads(path.read_text()) if path.exists() else {"runs": []}
    if args.profile:
        env = {**os.environ, **environment(args.kernels, args.threads)}
        code = "import json, sys; sys.path.insert(0, sys.argv[1]); import demo_time;"
        code += " print(json.dumps(demo_time.profile()))"
        with tempfile.TemporaryDirectory() as scratch:
            done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)],
                                  cwd=scratch, env=env, capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"the profile failed:\n{done.stderr[-3000:]}")
        record, key = json.loads(done.stdout.splitlines()[-1]), "profiles"
    else:
        record, key = measure(args.kernels, args.threads), "runs"
    kept = [r for r in results.get(key, []) if not _same(r, record)]
    results[key] = [*kept, record]
    path.write_text(json.dumps(results, indent=2) + "\n")
    Path(args.out + ".md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
