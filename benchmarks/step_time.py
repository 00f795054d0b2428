"""Mean training-step time of the plugin's methods, interleaved in one process.

Every method trains its own copy of the same model on the same batches. The runs are
interleaved (each round times one step of every method, in a rotating order) so that a
noisy machine slows all of them alike and the ratios survive. Each method's figure is its
mean cost per step over whole periods of its step schedule (``step_cost.summarize``: RST's
coin and LookSAM's interval mix SAM steps with cheaper ones); the defaults, 20 timed rounds
after 5 warm-up rounds, time four whole LookSAM intervals from a SAM step and the
``10 / min(p, 1 - p)`` steps RST's coin needs at ``p = 0.5``.

Methods are named as in ``lightning_slsam.METHODS`` (``adamw``, ``sam``, ``slsam_paper``
-- the paper's SL-SAM --, ``slsam`` -- ``SparseLayerSAM()`` --, ``random_slsam``, ``s2sam``,
``sl_s2sam``, ``rst``, ``esam``, ``ssamf``, ``looksam``, ``slsam_depth``, ...), plus
``sam_reference``: a hand-written SAM + AdamW loop (two passes, full weight copy) to compare
the plugin's SAM against. The combinations (``slsam_rst``, ``slsam_looksam``,
``slsam_depth``) run on the paper's preset, as they did before their classes defaulted to
``preset="default"`` (:data:`OPTIONS`). The plugin's methods run
:class:`lightning_slsam.core.engine.SAMEngine` -- the code SAMMixin calls inside
Lightning -- so the figures are the training step's own cost (no data loading, no Lightning
loop).

    python benchmarks/step_time.py --model minilm --methods adamw,sam_reference,sam,slsam_paper
    python benchmarks/run_all.py      # every model, every method, memory and overheads
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as dt
import json
import os
import platform
import sys
import time
from collections.abc import Callable

import torch
from models import Workload, make_workload
from step_cost import RULE, kinds_text, schedule_of, summarize

from lightning_slsam import make_engine
from lightning_slsam.core.partition import build_partition
from lightning_slsam.methods.registry import SPECS

DEFAULT_METHODS = "adamw,sam_reference,sam,slsam_paper"
#: Options of a method beyond its name's: the combinations measure the paper's SL-SAM on
#: another schedule, the configuration their rows measured before 0.3.
OPTIONS = {name: {"preset": "paper"} for name in ("slsam_rst", "slsam_looksam", "slsam_depth")}


def method_names(spec: str) -> list[str]:
    """``spec`` (comma-separated, or ``all``) as a list of known method names."""
    known = ["sam_reference", *SPECS]
    names = known if spec == "all" else [m.strip() for m in spec.split(",")]
    unknown = [m for m in names if m not in known]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {known}")
    return names


def make_step(
    name: str, work: Workload, model: torch.nn.Module, lr: float, rho: float, ratio: float
) -> Callable[[dict], None]:
    """One training step of method ``name`` on ``model`` (``step.engine`` if any)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    if name == "adamw":

        def adamw(batch):
            opt.zero_grad(set_to_none=True)
            work.loss(model, batch).mean().backward()
            opt.step()

        adamw.engine, adamw.optimizer = None, opt  # type: ignore[attr-defined]
        return adamw
    if name == "sam_reference":
        params = [p for p in model.parameters() if p.requires_grad]

        def sam_reference(batch):
            opt.zero_grad(set_to_none=True)
            work.loss(model, batch).mean().backward()
            with torch.no_grad():
                norm = torch.norm(torch.stack([p.grad.norm(p=2) for p in params]), p=2)
                old = [p.clone() for p in params]
                for p in params:
                    p.add_(p.grad * (rho / (norm + 1e-12)))
            opt.zero_grad(set_to_none=True)
            work.loss(model, batch).mean().backward()
            with torch.no_grad():
                for p, o in zip(params, old):
                    p.copy_(o)
            opt.step()

        sam_reference.engine, sam_reference.optimizer = None, opt  # type: ignore[attr-defined]
        return sam_reference
    options = {"rho": rho, "seed": 0, **OPTIONS.get(name, {})}
    if "layer_ratio" in {f.name for f in dataclasses.fields(SPECS[name][0])}:
        options["layer_ratio"] = ratio
    engine = make_engine(name, model, **options)

    def step(batch):
        def compute_loss(index=None):
            part = batch if index is None else {k: v[index] for k, v in batch.items()}
            return work.loss(model, part)

        engine.train_step(compute_loss, opt, batch_size=work.batch_size(batch))

    step.engine, step.optimizer = engine, opt  # type: ignore[attr-defined]
    return step


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved(
    steps: dict[str, Callable],
    batches: list,
    warmup: int,
    kinds: dict[str, list[str | None]] | None = None,
) -> dict[str, list[float]]:
    """Per-method step times, one step of each per round, in a rotating order; ``kinds``, if
    given, receives each timed step's kind (``None`` for a step without an engine)."""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r, batch in enumerate(batches):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            _sync()
            start = time.perf_counter()
            steps[name](batch)
            _sync()
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
                if kinds is not None:
                    result = getattr(getattr(steps[name], "engine", None), "last_result", None)
                    kinds.setdefault(name, []).append(getattr(result, "kind", None))
        done = ", ".join(f"{n} {times[n][-1]:.3f}s" for n in names if times[n])
        print(f"  round {r + 1}/{len(batches)}{': ' + done if done else ''}", flush=True)
    return times


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def measure(
    model_name: str,
    names: list[str],
    rounds: int,
    warmup: int,
    lr: float = 1e-4,
    rho: float = 0.01,
    ratio: float = 0.2,
    device: str = "cpu",
) -> dict:
    """Step times of ``names`` on ``model_name``: each method's mean cost per step over
    whole periods of its schedule (``step_cost.summarize``), ratios, active ratios."""
    work = make_workload(model_name, warmup + rounds, device)
    steps = {}
    for name in names:
        steps[name] = make_step(name, work, copy.deepcopy(work.model), lr, rho, ratio)
    kinds: dict[str, list[str | None]] = {}
    times = interleaved(steps, work.batches, warmup, kinds)
    figures = {
        name: summarize(times[name], warmup, schedule_of(steps[name].engine), kinds.get(name))
        for name in names
    }
    mean = {name: row["mean_s"] for name, row in figures.items()}
    base = mean.get("adamw")
    rows = {}
    for name in names:
        engine = steps[name].engine
        passes = None
        if engine is not None and engine.last_result is not None:
            done = max(engine.num_steps - engine.num_skipped, 1)
            passes = engine.active_ratio_sum / done
        rows[name] = {
            **figures[name],
            "ratio_to_sam": mean[name] / mean["sam"] if "sam" in mean else None,
            "ratio_to_adamw": mean[name] / base if base else None,
            "active_ratio": {"adamw": 1.0, "sam_reference": 2.0}.get(name, passes),
            "samples": times[name],
            "sample_kinds": kinds.get(name),
        }
    return {
        "model": model_name,
        "description": work.description,
        "num_layers": build_partition(work.model).num_layers,
        "rounds": rounds,
        "warmup": warmup,
        "methods": rows,
    }


def render(result: dict) -> str:
    lines = [
        f"# Step time on {result['description']}",
        "",
        f"{result['num_layers']} layers; {result['rounds']} interleaved rounds after"
        f" {result['warmup']} warm-up rounds. Step: the {RULE}; timed steps: those it"
        f" counts (by kind where a method mixes kinds). {result.get('stamp', '')}",
        "",
        "| method | mean step (s) | timed steps | min-max (s) | time / SAM | time / AdamW"
        " | active ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in result["methods"].items():
        ratio = row["active_ratio"]
        lines.append(
            f"| {name} | {row['mean_s']:.3f} | {kinds_text(row['steps'], row['kinds'])}"
            f" | {row['min_s']:.3f}-{row['max_s']:.3f}"
            f" | {_fmt(row['ratio_to_sam'])} | {_fmt(row['ratio_to_adamw'])}"
            f" | {'-' if ratio is None else f'{ratio:.3f}'} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--methods", default=DEFAULT_METHODS)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layer-ratio", type=float, default=0.2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--name", default=None, help="results file: step_time_<name>")
    args = parser.parse_args(argv)
    names = method_names(args.methods)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = measure(args.model, names, args.rounds, args.warmup, ratio=args.layer_ratio,
                     device=device)  # fmt: skip
    result["machine"] = machine()
    result["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    m = result["machine"]
    result["stamp"] = (
        f"{m['platform']}, {m['cpu_threads']} threads, torch {m['torch']},"
        f" GPU: {m['cuda'] or 'none'}, {result['date']}."
    )
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"step_time_{args.name or args.model}")
    with open(stem + ".json", "w") as handle:
        json.dump(result, handle, indent=2)
    with open(stem + ".md", "w") as handle:
        handle.write(render(result))
    print(render(result))
    return result


if __name__ == "__main__":
    main()
