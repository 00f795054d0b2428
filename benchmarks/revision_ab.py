"""Same-host A/B of two revisions of the plugin: ``make bench``'s step times of SAM and
SL-SAM (``step_time.py``), each revision in its own process, alternated.

A refactor must not slow the step down. This checks out ``--before`` in a temporary git
worktree and runs, for each model, ``step_time.py`` of each revision in turn (its own
benchmark script, importing its own package), ``--repeats`` times, alternating the order
(A B B A ...) so that a drift of the machine lands on both. Per revision it takes the
median over the repeats of each run's median step time, and reports the after/before
ratio of SAM's and SL-SAM's step time, and of SL-SAM's ratio to SAM.

    python benchmarks/revision_ab.py --before 882acee --after HEAD

When the methods' names changed between the revisions, ``--methods-before`` names the
same configurations in the first one, in the same order (rows take the names of
``--methods``):

    python benchmarks/revision_ab.py --before f94ff83 --methods sam,slsam_paper,slsam \
        --methods-before sam,slsam,slsam_default

Writes ``benchmarks/results/revision_ab.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _worktree(revision: str, where: str) -> str:
    path = os.path.join(where, revision.replace("/", "_"))
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, revision],
                   check=True, capture_output=True)  # fmt: skip
    return path


def _run(tree: str, model: str, methods: str, rounds: int, out: str, threads: int) -> dict:
    """One ``step_time.py`` run of the tree's own benchmark on its own package."""
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": str(threads)}
    code = (
        "import sys, torch, lightning_slsam;"
        f"torch.set_num_threads({threads});"
        f"assert lightning_slsam.__file__.startswith({tree!r}), lightning_slsam.__file__;"
        f"sys.path.insert(0, {os.path.join(tree, 'benchmarks')!r});"
        "import step_time;"
        f"step_time.main(['--model', {model!r}, '--methods', {methods!r},"
        f" '--rounds', '{rounds}', '--out', {out!r}, '--name', 'ab'])"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tree,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    with open(os.path.join(out, "step_time_ab.json")) as handle:
        rows = json.load(handle)["methods"]
    return {name: row["median_s"] for name, row in rows.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision A (e.g. a commit)")
    parser.add_argument("--after", default="HEAD", help="git revision B")
    parser.add_argument("--models", default="minilm,vit,llama")
    parser.add_argument("--methods", default="sam,slsam_paper,slsam")
    parser.add_argument(
        "--methods-before",
        default=None,
        help="the same configurations by their names in --before (default: --methods)",
    )
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    after_names = args.methods.split(",")
    names = {"after": after_names, "before": (args.methods_before or args.methods).split(",")}
    if len(names["before"]) != len(after_names):
        parser.error("--methods-before must name as many methods as --methods")
    work = tempfile.mkdtemp(prefix="revision_ab_")
    trees = {}
    try:
        for label, revision in (("before", args.before), ("after", args.after)):
            trees[label] = _worktree(revision, os.path.join(work, label))
        times: dict = {m: {"before": [], "after": []} for m in args.models.split(",")}
        for model in times:
            for repeat in range(args.repeats):
                order = ["before", "after"] if repeat % 2 == 0 else ["after", "before"]
                for label in order:
                    out = os.path.join(work, "out", label)
                    methods = ",".join(names[label])
                    run = _run(trees[label], model, methods, args.rounds, out, args.threads)
                    # Keyed by today's names, so that both revisions' rows line up.
                    run = {a: run[b] for a, b in zip(after_names, names[label])}
                    times[model][label].append(run)
                    print(f"{model} {label} #{repeat}: " + ", ".join(
                        f"{k} {v * 1e3:.1f} ms" for k, v in run.items()), flush=True)  # fmt: skip
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree],
                           capture_output=True)  # fmt: skip
        shutil.rmtree(work, ignore_errors=True)
    result = {"before": args.before, "after": args.after, "names_before": names["before"],
              "repeats": args.repeats,
              "rounds": args.rounds, "threads": args.threads, "models": {},
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}  # fmt: skip
    for model, runs in times.items():
        med = {label: {m: statistics.median(r[m] for r in runs[label])
                       for m in after_names} for label in runs}  # fmt: skip
        result["models"][model] = {"median_s": med, "runs": runs}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "revision_ab.json"), "w") as handle:
        json.dump(result, handle, indent=2)
    table = render(result)
    with open(os.path.join(args.out, "revision_ab.md"), "w") as handle:
        handle.write(table)
    print(table)
    return result


def render(result: dict) -> str:
    methods = list(next(iter(result["models"].values()))["median_s"]["before"])
    lines = [
        f"# Step time before and after: `{result['before']}` -> `{result['after']}`",
        "",
        f"Same host, {result['threads']} threads, {result['date']}. Each cell: the median over"
        f" {result['repeats']} alternated processes of each run's median step time"
        f" ({result['rounds']} interleaved rounds; `benchmarks/revision_ab.py`). after/before"
        " within 0.97-1.03 is the refactor's bar.",
        "",
        *(
            [f"Before, the same configurations were named {', '.join(result['names_before'])}.", ""]
            if result.get("names_before") and result["names_before"] != methods
            else []
        ),
        "| model | method | before | after | after/before | ratio to SAM before | after |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for model, row in result["models"].items():
        b, a = row["median_s"]["before"], row["median_s"]["after"]
        for m in methods:
            lines.append(
                f"| {model} | {m} | {b[m] * 1e3:.1f} ms | {a[m] * 1e3:.1f} ms |"
                f" {a[m] / b[m]:.3f} | {b[m] / b['sam']:.3f} | {a[m] / a['sam']:.3f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
