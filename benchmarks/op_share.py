"""Where an eager training step's CPU time goes: matrix products and attention kernels
against everything else (the part torch.compile can fuse), per model.

One AdamW step per model under ``torch.profiler`` after a warm-up step; the share is of the
operators' self CPU time. It bounds what compiling can gain on this machine: inductor hands
matrix products and attention to the same kernels as eager, so a step whose time is mostly
there cannot get much faster (``benchmarks/results/compile_step_time.md``).

    python benchmarks/op_share.py --models minilm,vit,llama --out benchmarks/results/op_share
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import make_workload
from step_time import machine

#: The kernels torch.compile does not replace on a CPU: matrix products, attention, convs.
KERNELS = (
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::mkldnn_convolution", "aten::convolution_backward",
)  # fmt: skip


def share(model_name: str) -> dict:
    work = make_workload(model_name, 2)
    config = getattr(work.model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # as the compile benchmark trains
    opt = torch.optim.AdamW(work.model.parameters(), lr=1e-4)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        work.loss(work.model, batch).mean().backward()
        opt.step()

    step(work.batches[0])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(work.batches[1])
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    kernels = sum(e.self_cpu_time_total for e in events if e.key in KERNELS)
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
    return {
        "model": model_name,
        "description": work.description,
        "kernel_share": kernels / total,
        "top": [(e.key, e.self_cpu_time_total / total) for e in top],
    }


def render(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# Where an eager step's CPU time goes",
        "",
        f"Machine: {m['processor']}, {m['cpu_threads']} torch threads, torch {m['torch']}."
        f" {result['date']}. One AdamW step per model under torch.profiler (self CPU time"
        " of the operators), after a warm-up step.",
        "",
        "| model | matrix products + attention | the rest (what compile can fuse) |"
        " largest operators |",
        "|---|---:|---:|---|",
    ]
    for row in result["rows"]:
        top = ", ".join(f"`{k}` {v:.2f}" for k, v in row["top"][:4])
        lines.append(f"| {row['model']} | {row['kernel_share']:.2f} |"
                     f" {1 - row['kernel_share']:.2f} | {top} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="minilm,vit,llama")
    parser.add_argument("--out", default="benchmarks/results/op_share")
    args = parser.parse_args(argv)
    result = {
        "machine": machine(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "rows": [share(name) for name in args.models.split(",")],
    }
    with open(f"{args.out}.json", "w") as f:
        json.dump(result, f, indent=1)
    with open(f"{args.out}.md", "w") as f:
        f.write(render(result))
    print(render(result))
    return result


if __name__ == "__main__":
    main()
