"""Peak memory of one method on one model, in a process of its own.

    python benchmarks/memory.py --model minilm --method slsam_paper --steps 8
    python benchmarks/memory.py --task effnet_noisy --method saf --steps 8

``--model`` is one of ``models.py``'s workloads, ``--method`` a registry name; ``--task`` one
of ``short_runs_time.py``'s tasks (their training steps return the logits and the samples'
indices, which MESA and SAF read), ``--method`` then one of its configurations.

Prints one JSON line. On a CPU it reports the process's resident set (RSS):

* ``runtime_mb`` -- after the imports (Python, torch, and the model's library: timm or
  transformers), before the model exists;
* ``setup_mb`` -- after the model, the batches and the optimizer state exist;
* ``peak_mb`` -- the highest RSS while training (Linux's high-water mark, reset after
  setup, so model loading does not count);
* ``training_mb`` -- ``peak_mb - runtime_mb``: what the model and its training need, the
  CPU counterpart of ``torch.cuda.max_memory_allocated``.

On a GPU it reports ``torch.cuda.max_memory_allocated`` as ``training_mb``.

The optimizer state of every parameter is allocated before measuring (one AdamW step with
zero gradients), so every method is measured in its steady state: a layer-sampling method
has no optimizer state for layers never active yet early in a run, which would flatter it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys


def _rss_mb(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets VmHWM, the peak RSS, to the current RSS
        return True
    except OSError:
        return False


def _task_step(task: str, label: str, steps: int) -> tuple[float, object, list]:
    """The runtime's RSS, then one configuration's training step on a task of
    ``short_runs_time.py`` and its first ``steps`` batches (the run's length set to them)."""
    import short_runs_time as runs

    table = {**runs.BASELINES, **runs.METHODS, **runs.script_variants()}
    if label not in table:
        raise SystemExit(f"--method {label!r}: not a configuration of {task}; one of {list(table)}")
    config, _ = runs.TASKS[task]
    # The libraries and the task's code are imported before the runtime is read.
    __import__("transformers" if "minilm" in config or "glassllm" in config else "timm")
    with open(os.path.join(runs.ROOT, config)) as handle:
        spec = runs.yaml.safe_load(handle)
    for part in ("model", "data"):
        __import__(spec[part]["class_path"].rsplit(".", 1)[0])
    runtime = _rss_mb()
    module, batches, loss, lr = runs.load_task(config, 1)
    step = runs.make_step(*table[label], module, loss, lr)
    if step.engine is not None:  # the run's length (ARWP's noise schedule, MESA's start)
        step.engine.planned_steps = steps
    return runtime, step, batches[:steps]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="a workload of models.py")
    where.add_argument("--task", help="a task of short_runs_time.py")
    parser.add_argument("--method", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, os.path.dirname(__file__))
    cuda = torch.cuda.is_available()
    if args.task:
        runtime, step, batches = _task_step(args.task, args.method, args.steps)
    else:
        from models import make_workload
        from step_time import make_step

        # The model's library is imported before the runtime is read, so its code (about 240
        # MB for transformers) does not count as the training's memory.
        __import__("timm" if args.model in ("vit", "deit_small") else "transformers")
        runtime = _rss_mb()
        work = make_workload(args.model, args.steps, "cuda" if cuda else "cpu")
        step, batches = make_step(args.method, work, work.model, 1e-4, 0.01, 0.2), work.batches
    # Steady state: optimizer state for every parameter (zero gradients, lr 0).
    opt = step.optimizer
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    setup = _rss_mb()
    reset = _reset_peak()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for batch in batches:
        step(batch)
    result = {
        "model": args.model or args.task,
        "method": args.method,
        "steps": args.steps,
        "runtime_mb": runtime,
        "setup_mb": setup,
        "peak_mb": _rss_mb("VmHWM") if reset else float("nan"),
    }
    if cuda:
        torch.cuda.synchronize()
        result["training_mb"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        result["training_mb"] = result["peak_mb"] - runtime
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
