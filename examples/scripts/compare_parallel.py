"""Run the trainings of several ``python -m examples.compare`` commands in parallel processes.

``compare`` trains its (method, seed) runs one after another. On a machine with many cores
or a GPU that one small run leaves mostly idle, this script runs them side by side: each
line of PLAN holds the arguments of one ``compare`` command, every (method, seed) of every
line becomes one job, and ``--jobs`` of them run at once, each as
``compare --methods METHOD --seeds 1 --seed SEED --resume`` into the line's ``--out``. The
runs land exactly where the whole ``compare`` puts them, so running the line's own command
with ``--resume`` afterwards trains nothing and writes the table and the plots::

    python examples/scripts/compare_parallel.py PLAN --jobs 12 --deadline 600
    python -m examples.compare <a line of PLAN> --resume     # tabulate

Jobs start seed by seed: every line's runs of the first seed, in the order of the lines and
of their ``--methods``, then the next seed (list the longest runs first), so that a stop
leaves whole seeds. At ``--deadline``
seconds the jobs still running are stopped and listed; ``--resume`` later trains only them.
Each job's output goes to ``OUT/logs/METHOD_seedSEED.log``.

``--table DIR [DIR ...]`` tabulates the finished runs of each DIR (its ``runs/*/seed*/run.json``)
with the number of seeds per row, also when some seeds are missing, into ``DIR/table.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time


def _jobs(line: str) -> list[tuple[int, str, list[str], str]]:
    """(seed index, name, command, log) of each (method, seed) of a ``compare`` argument line."""
    words = shlex.split(line)
    split = words.index("--") if "--" in words else len(words)
    own, extra = words[:split], words[split:]
    keep, methods, seeds, first, out = [], [], 3, 42, "runs/compare"
    variants, options = {}, {}
    i = 0
    while i < len(own):
        flag, value = own[i], own[i + 1] if i + 1 < len(own) else ""
        if flag == "--methods":
            methods = value.split(",")
        elif flag == "--seeds":
            seeds = int(value)
        elif flag == "--seed":
            first = int(value)
        elif flag == "--out":
            out = value
        elif flag == "--variant":
            variants.setdefault(value.split("=", 1)[0], []).extend([flag, value])
        elif flag == "--option":
            options.setdefault(value.split(".", 1)[0], []).extend([flag, value])
        elif flag == "--resume":
            i += 1
            continue
        else:
            keep.extend([flag, value])
        i += 2
    jobs = []
    for seed in range(first, first + seeds):
        for method in methods:
            command = [
                sys.executable, "-m", "examples.compare", *keep,
                *variants.get(method, []), *options.get(method, []), "--methods", method,
                "--seeds", "1", "--seed", str(seed), "--out", out, "--resume", *extra,
            ]  # fmt: skip
            log = os.path.join(out, "logs", f"{method}_seed{seed}.log")
            jobs.append((seed - first, f"{out}:{method}:{seed}", command, log))
    return jobs


def table(folder: str) -> str:
    """Markdown table of the finished runs in ``folder``: per method the seeds, the best
    monitored value (mean, sample standard deviation, each seed's) and the active ratio."""
    rows = [
        "| method | seeds | best (mean ± sd) | each seed | active ratio |",
        "|---|---:|---:|---|---:|",
    ]
    runs = os.path.join(folder, "runs")
    for method in sorted(os.listdir(runs)):
        records = {}
        for seed in sorted(os.listdir(os.path.join(runs, method))):
            path = os.path.join(runs, method, seed, "run.json")
            if os.path.isfile(path):
                with open(path) as handle:
                    records[seed.removeprefix("seed")] = json.load(handle)
        if not records:
            continue
        best = [r["best"] for r in records.values()]
        spread = statistics.stdev(best) if len(best) > 1 else float("nan")
        ratio = statistics.mean(r.get("active_ratio") or 1.0 for r in records.values())
        each = ", ".join(f"{seed}: {r['best']:.3f}" for seed, r in records.items())
        rows.append(f"| {method} | {len(best)} | {statistics.mean(best):.4f} ± {spread:.4f}"
                    f" | {each} | {ratio:.3f} |")  # fmt: skip
    return "\n".join(rows) + "\n"


def main() -> None:
    if sys.argv[1:2] == ["--table"]:
        for folder in sys.argv[2:]:
            text = table(folder)
            with open(os.path.join(folder, "table.md"), "w") as handle:
                handle.write(text)
            print(f"{folder}:\n{text}")
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", help="a file with one compare argument line per line")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--deadline", type=float, default=float("inf"), help="seconds")
    args = parser.parse_args()
    with open(args.plan) as handle:
        lines = [ln for ln in handle.read().splitlines() if ln.strip() and not ln.startswith("#")]
    jobs = [job for line in lines for job in _jobs(line)]
    queue = [job[1:] for job in sorted(jobs, key=lambda job: job[0])]  # stable: plan order
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    started, running, results = time.monotonic(), {}, {}
    print(f"{len(queue)} jobs, {args.jobs} at a time", flush=True)
    while queue or running:
        while queue and len(running) < args.jobs:
            name, command, log = queue.pop(0)
            os.makedirs(os.path.dirname(log), exist_ok=True)
            with open(log, "w") as out:
                process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                           env=env, start_new_session=True)  # fmt: skip
            running[name] = (process, time.monotonic())
        for name, (process, begun) in list(running.items()):
            if process.poll() is not None:
                results[name] = {"exit": process.returncode, "seconds": time.monotonic() - begun}
                print(f"[{time.monotonic() - started:6.0f}s] {name} exit {process.returncode}"
                      f" in {time.monotonic() - begun:.0f}s", flush=True)  # fmt: skip
                del running[name]
        if time.monotonic() - started > args.deadline:
            for name, (process, begun) in running.items():
                os.killpg(process.pid, signal.SIGTERM)
                results[name] = {"exit": "stopped at the deadline",
                                 "seconds": time.monotonic() - begun}  # fmt: skip
            for name, _, _ in queue:
                results[name] = {"exit": "not started"}
            print(f"deadline: stopped {len(running)}, not started {len(queue)}", flush=True)
            break
        time.sleep(0.5)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
