"""What a drawn layer costs in an SL-SAM step: is its parameter count the right cost for
the compute budget (``SparseLayerSAM()``'s, preset ``"default"``)?

    python benchmarks/layer_cost.py                 # MiniLM-L6 and the small Llama
    python benchmarks/layer_cost.py --models minilm --rounds 12

Every configuration trains its own copy of the model with SL-SAM's engine on a fixed set
of active tensors, interleaved step by step in one process (``step_time.interleaved``).
Each set contains the model's lowest tensor, so back-propagation always runs the whole
depth (the floor every SL-SAM step pays, ``benchmarks/PROFILE.md`` section 3); what a set
adds above the floor is the weight gradients, perturbation, backup and optimizer update of
its tensors. Compared per parameter: a vocabulary embedding (a gather forward, a
scatter-add gradient, but a dense update of every row; the Llama's is tied to its output
projection, a matrix product over every token), matrices of the same total size,
and many small tensors (where a fixed cost per tensor would show). Writes
``benchmarks/results/layer_cost.{md,json}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import make_workload
from step_time import interleaved, machine

from lightning_slsam import make_engine
from lightning_slsam.selection.rules import LayerSelection

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


class Fixed(LayerSelection):
    """The same layers every step."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask, self.num_layers = mask, mask.numel()

    def sample(self) -> torch.Tensor:
        return self.mask.clone()


def sets(names: list[str], numel: list[int]) -> dict[str, list[int]]:
    """The active sets (layer indices) compared: each starts with the anchor, the lowest
    small tensor (back-propagation then runs the whole depth)."""
    anchor = next(i for i, n in enumerate(numel) if n <= 4096)
    embedding = next(i for i, n in enumerate(names) if "embed" in n and numel[i] > 1e6)
    small = [i for i, n in enumerate(numel) if n <= 4096 and i != anchor]
    matrices = sorted((i for i in range(len(names)) if numel[i] > 4096 and i != embedding),
                      key=lambda i: numel[i])  # fmt: skip
    chosen, total = [], 0
    for i in matrices:  # the smallest matrices first, up to the embedding's size
        if total >= numel[embedding]:
            break
        chosen.append(i)
        total += numel[i]
    return {
        "floor": [anchor],
        f"+ embedding ({names[embedding]})": [anchor, embedding],
        "+ matrices of that size": [anchor, *chosen],
        f"+ {len(small)} small tensors": [anchor, *small],
    }


def measure(model_name: str, rounds: int, warmup: int) -> dict:
    work = make_workload(model_name, warmup + rounds)
    probe = make_engine("slsam_paper", work.model, seed=0)
    names, numel = probe.partition.names, probe.partition.numel
    configurations = sets(names, numel)
    steps, engines = {}, {}
    for label, layers in configurations.items():
        model = copy.deepcopy(work.model)
        engine = make_engine("slsam_paper", model, seed=0, rho=0.01)
        mask = torch.zeros(len(names), dtype=torch.bool)
        mask[layers] = True
        engine.selection = Fixed(mask)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(batch, engine=engine, model=model, opt=opt):
            engine.train_step(lambda index=None: work.loss(model, batch).mean(), opt)

        steps[label], engines[label] = step, engine
    times = interleaved(steps, work.batches, warmup)
    median = {k: statistics.median(v) for k, v in times.items()}
    floor = median["floor"]
    rows = []
    for label, layers in configurations.items():
        extra_numel = sum(numel[i] for i in layers) - numel[layers[0]]
        extra = median[label] - floor
        rows.append({
            "set": label,
            "tensors": len(layers) - 1,
            "parameters": extra_numel,
            "median_step_s": median[label],
            "above_floor_s": extra,
            "ns_per_parameter": extra / extra_numel * 1e9 if extra_numel else None,
            "ms_per_tensor": extra / (len(layers) - 1) * 1e3 if len(layers) > 1 else None,
        })  # fmt: skip
    return {"model": model_name, "description": work.description, "rows": rows,
            "rounds": rounds, "warmup": warmup}  # fmt: skip


def render(results: list[dict], info: dict) -> str:
    lines = [
        "# What a drawn layer costs in an SL-SAM step",
        "",
        "Produced by `python benchmarks/layer_cost.py`. Each set holds the model's lowest"
        " tensor (back-propagation runs the whole depth) plus the tensors named; their cost"
        " is the median step time above the floor (the lowest tensor alone), interleaved in"
        " one process.",
        "",
        f"Machine: {info['processor']}, {info['cpu_threads']} threads, torch {info['torch']}.",
    ]
    for result in results:
        lines += ["", f"## {result['model']}: {result['description']}", "",
                  "| active set above the floor | tensors | parameters | median step (s) |"
                  " above floor (s) | ns / parameter | ms / tensor |",
                  "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for row in result["rows"]:
            ns = row["ns_per_parameter"]
            ms = row["ms_per_tensor"]
            lines.append(
                f"| {row['set']} | {row['tensors']} | {row['parameters']:,} |"
                f" {row['median_step_s']:.3f} | {row['above_floor_s']:+.3f} |"
                f" {'-' if ns is None else f'{ns:.2f}'} | {'-' if ms is None else f'{ms:.2f}'} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="minilm,llama")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    results = [measure(m, args.rounds, args.warmup) for m in args.models.split(",")]
    info = machine()
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "layer_cost.json"), "w") as handle:
        json.dump({"machine": info, "results": results}, handle, indent=2)
    table = render(results, info)
    with open(os.path.join(RESULTS, "layer_cost.md"), "w") as handle:
        handle.write(table)
    print(table)


if __name__ == "__main__":
    main()
