"""Peak memory of one method on one model, in a process of its own.

    python benchmarks/memory.py --model minilm --method slsam_paper --steps 8

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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--method", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, os.path.dirname(__file__))
    from models import make_workload
    from step_time import make_step

    # The model's library is imported before the runtime is read, so its code (about 240 MB
    # for transformers) does not count as the training's memory.
    __import__("timm" if args.model in ("vit", "deit_small") else "transformers")
    cuda = torch.cuda.is_available()
    runtime = _rss_mb()
    work = make_workload(args.model, args.steps, "cuda" if cuda else "cpu")
    step = make_step(args.method, work, work.model, 1e-4, 0.01, 0.2)
    # Steady state: optimizer state for every parameter (zero gradients, lr 0).
    opt = step.optimizer
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in work.model.parameters():
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
    for batch in work.batches:
        step(batch)
    result = {
        "model": args.model,
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
