"""Time the demo end to end and record what it prints: the one measurement that the README,
docs/quickstart.md and the demo config quote (a test holds them to it).

    python benchmarks/demo_time.py          # -> benchmarks/results/demo.{json,md}

It runs ``lightning-slsam fit --demo`` as ``make demo`` does, in a scratch folder, and keeps
the wall time from start to exit (the installation ``make demo`` runs first on a fresh
machine is not counted), the steps, the final validation accuracy and the step it was
measured at. Measure on an otherwise idle machine: a busy one gives a longer time.
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

RESULTS = Path(__file__).resolve().parent / "results"

_SUMMARY = re.compile(r"Run summary \((?P<method>\w+), (?P<steps>\d+) steps\)")
_VAL_ACC = re.compile(r"final val_acc: (?P<acc>[0-9.]+) \(validated at step (?P<at>\d+)\)")


def parse(output: str) -> dict:
    """The method, steps, final validation accuracy and its step from a run's output; raises
    ``ValueError`` when the run summary is missing or says the run was cut short."""
    summary, acc = _SUMMARY.search(output), _VAL_ACC.search(output)
    if summary is None or acc is None:
        raise ValueError("the output holds no run summary with a final val_acc")
    if "stopped at step" in output[summary.start() :]:
        raise ValueError("the demo stopped before its planned length: " + output[-500:])
    return {
        "method": summary["method"],
        "steps": int(summary["steps"]),
        "val_acc": float(acc["acc"]),
        "validated_at": int(acc["at"]),
    }


def measure() -> dict:
    """Run the demo once and return its record."""
    import torch

    command = [sys.executable, "-m", "lightning_slsam.cli", "fit", "--demo"]
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        done = subprocess.run(
            command, cwd=scratch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the demo failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
    return {
        **parse(done.stdout),
        "seconds": round(seconds, 1),
        "command": "lightning-slsam fit --demo",
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": date.today().isoformat(),
    }


def table(record: dict) -> str:
    minutes = record["seconds"] / 60
    return "\n".join([
        "# The demo, timed (`python benchmarks/demo_time.py`)",
        "",
        f"`{record['command']}` on {record['cpus']} CPU cores ({record['processor']},"
        f" torch {record['torch']}, {record['torch_threads']} threads), {record['date']};"
        " the installation that `make demo` runs first on a fresh machine is not counted.",
        "",
        "| method | steps | validation accuracy (at step) | wall time |",
        "|---|---:|---:|---:|",
        f"| {record['method']} | {record['steps']} | {record['val_acc']:.4f}"
        f" ({record['validated_at']}) | {record['seconds']:.0f} s ({minutes:.1f} min) |",
        "",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "demo"), help="path without suffix")
    args = parser.parse_args(argv)
    record = measure()
    Path(args.out + ".json").write_text(json.dumps(record, indent=2) + "\n")
    Path(args.out + ".md").write_text(table(record))
    print(table(record))


if __name__ == "__main__":
    main()
