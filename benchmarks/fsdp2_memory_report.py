"""The pure part of ``fsdp2_memory.py``: medians, ratios, the goal's verdicts, the shapes'
regimes, the Trainer against the plain loop, merging a run into the saved results, and the
markdown tables. No torch here."""

from __future__ import annotations

import statistics

GOAL = 0.85  # SL-SAM's per-rank peak / SAM's, under each strategy
#: glibc told to unmap every block over 128 KiB when freed: the RSS then follows live memory.
RETURNED = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
#: What one shape's entry of the results holds (the rest is shared by every shape).
SHAPE_KEYS = ("batch_per_rank", "seq", "steps", "repeats", "threads", "runs", "returned",
              "summary", "command", "malloc_env", "date", "minutes", "cpu_minutes",
              "machine", "estimate")  # fmt: skip
#: The front-ends a configuration trains through: ``loop``, the library's engine in a plain
#: loop (the reference); ``trainer``, the Hugging Face Trainer (``transformers.Trainer`` for
#: AdamW, ``lightning_slsam.hf.SAMTrainer`` for the SAM methods).
LOOP, TRAINER = "loop", "trainer"
#: Results saved before the paper's SL-SAM was named ``slsam_paper`` call it ``slsam``.
_RENAMED = {"slsam": "slsam_paper"}


def shape_name(batch: int, seq: int) -> str:
    return f"{batch}x{seq}"


def entry_name(route: str, batch: int, seq: int) -> str:
    """The key of a route's results at a shape: the shape's name for the plain loop (as
    before the Trainer was measured), the shape and the route otherwise."""
    shape = shape_name(batch, seq)
    return shape if route == LOOP else f"{shape} {route}"


def summarize(runs: dict, returned: dict | None = None, goal: float = GOAL) -> dict:
    """``runs[strategy][method]``: a list of repeats, each the ranks' result dicts;
    ``returned[strategy][method]``: the ranks' results of the run with :data:`RETURNED`.

    Returns per configuration the median over repeats of the per-rank peak training MB
    and of its max over ranks, the ratios to AdamW and to SAM (same strategy) and FSDP2 /
    DDP (same method), the peak with freed memory returned (max over ranks) and its ratios
    to AdamW and SAM, and the goal's verdict per strategy (SL-SAM / SAM <= ``goal``), on
    the default RSS peak (``met``) and on the peak with freed memory returned
    (``returned_met``)."""
    returned = returned or {}
    rows: dict = {}
    for strategy, methods in runs.items():
        for method, repeats in methods.items():
            peaks = [max(r["training_mb"] for r in ranks) for ranks in repeats]
            world = len(repeats[0])
            rank_values = [[ranks[i]["training_mb"] for ranks in repeats] for i in range(world)]
            setup = [max(r["setup_mb"] - r["runtime_mb"] for r in ranks) for ranks in repeats]
            rows.setdefault(strategy, {})[method] = {
                "peak_mb": statistics.median(peaks),
                "repeats_mb": peaks,
                "per_rank_mb": [statistics.median(v) for v in rank_values],
                "setup_mb": statistics.median(setup),
                "param_mb": repeats[0][0].get("param_mb"),
                "optimizer_state_mb": repeats[0][0].get("optimizer_state_mb"),
                "active_ratio": repeats[0][0].get("active_ratio"),
                "masks_agree": all(len({str(r.get("masks")) for r in rs}) == 1 for rs in repeats),
            }
            ranks = returned.get(strategy, {}).get(method)
            if ranks:
                row = rows[strategy][method]
                row["returned_mb"] = max(r["training_mb"] for r in ranks)
                row["returned_per_rank_mb"] = [r["training_mb"] for r in ranks]
                row["returned_setup_mb"] = max(r["setup_mb"] - r["runtime_mb"] for r in ranks)
    for methods in rows.values():
        for method, row in methods.items():
            for base_method in ("adamw", "sam"):
                base_row = methods.get(base_method, {})
                for key, ratio in (("peak_mb", "ratio_to_"), ("returned_mb", "returned_to_")):
                    base = base_row.get(key)
                    row[ratio + base_method] = row[key] / base if base and key in row else None
            ddp = rows.get("ddp", {}).get(method, {}).get("peak_mb")
            fsdp2 = rows.get("fsdp2", {}).get(method, {}).get("peak_mb")
            row["fsdp2_over_ddp"] = fsdp2 / ddp if fsdp2 and ddp else None
    verdict = {}
    for strategy, methods in rows.items():
        slsam = methods.get("slsam_paper", {})
        ratio, back = slsam.get("ratio_to_sam"), slsam.get("returned_to_sam")
        if ratio is not None:
            verdict[strategy] = {
                "ratio": ratio,
                "goal": goal,
                "met": ratio <= goal,
                "returned_ratio": back,
                "returned_met": None if back is None else back <= goal,
            }
    return {"rows": rows, "goal": verdict}


def regime(estimate: dict) -> str:
    """Which tensors dominate AdamW's per-rank memory at a shape: ``parameters`` when the
    weights, gradients and AdamW state (4 parameter sizes, per rank, under both strategies)
    are over twice the activations saved for backward, ``activations`` when the activations
    exceed them under both, ``mixed`` otherwise."""
    params, saved = estimate["weights_grads_adamw_mb"], estimate["saved_activations_mb"]
    if min(params.values()) > 2 * saved:
        return "parameters"
    if saved > max(params.values()):
        return "activations"
    return "mixed"


def as_shapes(result: dict) -> dict:
    """The results by entry (a route at a shape, :func:`entry_name`), from any format: this
    one (``shapes``), the single-shape one of the first version of the script (batch 8,
    sequence 128, no ``shapes`` key), or one before routes (every entry the plain loop's) or
    before the paper's SL-SAM was named ``slsam_paper``."""
    if "shapes" in result:
        entries = {name: dict(entry) for name, entry in result["shapes"].items()}
    else:
        entry = {k: result[k] for k in SHAPE_KEYS if k in result}
        entry.setdefault("seq", 128)
        entries = {shape_name(entry["batch_per_rank"], entry["seq"]): entry}
    for entry in entries.values():
        entry.setdefault("route", LOOP)
        for key in ("runs", "returned"):
            if key in entry:
                entry[key] = {s: _renamed(ms) for s, ms in entry[key].items()}
    return entries


def _renamed(methods: dict) -> dict:
    if any(name in methods for name in _RENAMED.values()):
        return methods
    return {_RENAMED.get(method, method): runs for method, runs in methods.items()}


def against_loop(shapes: dict) -> list[dict]:
    """Each configuration of a route other than the plain loop beside the loop's at the same
    shape, strategy and method (``shapes``: the results' entries, summarized): the per-rank
    peaks of both (max over ranks, median over runs) and the route's over the loop's, on the
    default RSS (``peak``) and with freed memory returned (``returned``)."""
    loops = {(e["batch_per_rank"], e["seq"]): e for e in shapes.values()
             if e.get("route", LOOP) == LOOP}  # fmt: skip
    rows = []
    for entry in shapes.values():
        if entry.get("route", LOOP) == LOOP:
            continue
        loop = loops.get((entry["batch_per_rank"], entry["seq"]), {})
        for strategy, methods in entry["summary"]["rows"].items():
            for method, row in methods.items():
                base = loop.get("summary", {}).get("rows", {}).get(strategy, {}).get(method, {})
                out = {"shape": shape_name(entry["batch_per_rank"], entry["seq"]),
                       "route": entry["route"], "strategy": strategy, "method": method}  # fmt: skip
                for kind in ("peak", "returned"):
                    mine, theirs = row.get(f"{kind}_mb"), base.get(f"{kind}_mb")
                    out[f"{kind}_mb"], out[f"loop_{kind}_mb"] = mine, theirs
                    out[f"{kind}_over_loop"] = mine / theirs if mine and theirs else None
                rows.append(out)
    return rows


def merge(saved: dict | None, new: dict) -> dict:
    """``new``'s entries (a route at a shape) replace the same entries of ``saved`` (the
    results on disk, any format); ``saved``'s other entries stay as they were, in their
    place."""
    shapes = as_shapes(saved) if saved else {}
    shapes.update(new["shapes"])
    return {**new, "shapes": shapes}


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _verdict(met: bool | None) -> str:
    return "-" if met is None else "met" if met else "**missed**"


def _where(entry: dict) -> str:
    """The shape and route cells of an entry's rows."""
    return f"| {shape_name(entry['batch_per_rank'], entry['seq'])} | {entry.get('route', LOOP)}"


def _shape_lines(result: dict) -> list[str]:
    world = result["world"]
    lines = [
        "| shape | route | batch per rank (global) x tokens | steps, runs | weights + grads +"
        " AdamW state per rank: DDP / FSDP2 MB | activations saved for backward MB | logits MB"
        " | regime | run |",
        "|---|---|---|---|---:|---:|---:|---|---|",
    ]
    for s in result["shapes"].values():
        e = s.get("estimate") or {}
        params = e.get("weights_grads_adamw_mb", {})
        param_text = " / ".join(f"{params[k]:.0f}" for k in ("ddp", "fsdp2") if k in params)
        run = (
            f"`{s['command']}`, {s['minutes']:.1f} min ({s.get('cpu_minutes', 0):.1f} CPU min),"
            f" {s['date'][:10]}"
        )
        lines.append(
            f"{_where(s)} | {s['batch_per_rank']} ({s['batch_per_rank'] * world}) x {s['seq']}"
            f" | {s['steps']}, {s['repeats']} + 1 | {param_text or '-'}"
            f" | {_f(e.get('saved_activations_mb'), 0)} | {_f(e.get('logits_mb'), 1)}"
            f" | {regime(e) if e else '-'} | {run} |"
        )
    return lines


def _route_lines(result: dict) -> list[str]:
    """The table of :func:`against_loop` (none without a route beside the loop)."""
    rows = against_loop(result["shapes"])
    if not rows:
        return []
    lines = [
        "",
        "## The Trainer against the plain loop: same shape, strategy and method",
        "",
        "| shape | route | strategy | method | peak MB: loop | route | route / loop"
        " | freed returned: loop | route | route / loop |",
        "|---|---|---|---|" + "---:|" * 6,
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['route']} | {r['strategy']} | {r['method']}"
            f" | {_f(r['loop_peak_mb'], 0)} | {_f(r['peak_mb'], 0)} | {_f(r['peak_over_loop'])}"
            f" | {_f(r['loop_returned_mb'], 0)} | {_f(r['returned_mb'], 0)}"
            f" | {_f(r['returned_over_loop'])} |"
        )
    return lines


def render(result: dict) -> str:
    """The markdown report of ``fsdp2_memory.main``'s result (``result["shapes"]``: one
    entry per route and shape, each with its own runs, summary, command, date and
    estimate)."""
    m, world = result["machine"], result["world"]
    lines = [
        "# SAM and SL-SAM under FSDP2 and DDP: per-rank peak memory",
        "",
        f"{result['description']}; {world} gloo processes, each training its own batch,"
        f" {result['threads']} thread per process; per configuration the median of the runs"
        " in fresh processes. Two shapes (below): a batch whose activations dominate"
        " AdamW's memory, and one whose weights, gradients and AdamW state do (the regime of"
        " the paper's LLM fine-tuning). Per rank, as `memory.py`: the peak RSS while training"
        " (VmHWM, reset after setup) minus the runtime RSS (after the imports and the process"
        " group, before the model exists), the optimizer state of every parameter allocated"
        " first. DDP: the whole model on every rank, the SAM methods' gradients averaged by"
        " the engine inside `no_sync`; FSDP2: `fully_shard` on every decoder layer and the"
        " root over a 1-D mesh. SL-SAM: the paper's defaults (layer ratio 0.2), seed 0 on"
        " every rank.",
        "",
        "Two routes. `loop`: the library's engine in a plain loop. `trainer`: the Hugging Face"
        " Trainer, `transformers.Trainer` for AdamW and `lightning_slsam.hf.SAMTrainer` for"
        ' the SAM methods, under accelerate\'s FSDP2 (`fsdp="full_shard auto_wrap"`,'
        " `fsdp_version` 2, by decoder layer), on the same token stream. The Trainer shards"
        " the model, builds its optimizer and (SAMTrainer) rebuilds the engine on the shards"
        " inside `train()`, so there setup ends after a first, warm-up optimizer step: the"
        " optimizer state of every parameter is allocated when training begins, the peak is"
        " reset after the warm-up step and the steps after it are measured, for all three"
        " methods alike.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}, Python {m['python']},"
        f" torch {m['torch']}, GPU: {m['cuda'] or 'none'}. Each row's numbers come from the"
        " run named in its row (a run with `--shapes` or `--routes` measures only the shapes"
        " and routes it names and keeps the others' results as they were).",
        "",
        *_shape_lines(result),
        "",
        "*Weights + grads + AdamW state*: 4 x the fp32 parameters, halved per rank by FSDP2"
        " (DDP's AdamW also holds its gradient buckets, one more parameter size). *Activations"
        " saved for backward*: the tensors autograd keeps from one forward of the batch and the"
        " loss (saved-tensor hooks, distinct storages, parameters excluded); the backward"
        " adds transients such as the logits' gradient. *Logits*: one fp32 batch x tokens x"
        " vocabulary tensor. Both estimated in one process, outside the measured runs.",
        "",
        "| shape | route | strategy | method | peak training MB (max of ranks) | runs"
        " | per rank | / AdamW | / SAM | FSDP2 / DDP | freed returned: peak MB | per rank"
        " | / AdamW | / SAM | before training | active ratio |",
        "|---|---|---|---|" + "---:|" * 12,
    ]
    for s in result["shapes"].values():
        for strategy, methods in s["summary"]["rows"].items():
            for method, row in methods.items():
                runs = ", ".join(f"{v:.0f}" for v in row["repeats_mb"])
                back = " / ".join(f"{v:.0f}" for v in row.get("returned_per_rank_mb", []))
                lines.append(
                    f"{_where(s)} | {strategy} | {method} | {row['peak_mb']:.0f} | {runs}"
                    f" | {' / '.join(f'{v:.0f}' for v in row['per_rank_mb'])}"
                    f" | {_f(row.get('ratio_to_adamw'))} | {_f(row['ratio_to_sam'])}"
                    f" | {_f(row['fsdp2_over_ddp'])}"
                    f" | {_f(row.get('returned_mb'), 0)} | {back or '-'}"
                    f" | {_f(row.get('returned_to_adamw'))} | {_f(row.get('returned_to_sam'))}"
                    f" | {_f(row.get('returned_setup_mb'), 0)} | {_f(row['active_ratio'])} |"
                )
    lines += [
        "",
        "MB are MiB. *Runs*: each run's max over ranks. */ AdamW*, */ SAM*: against the same"
        " route and strategy at the same shape. *Freed returned*: one more run per"
        " configuration, measured the same way, with glibc told to give every freed block over"
        f" 128 KiB back to the OS ({' '.join(f'{k}={v}' for k, v in RETURNED.items())}): the"
        " RSS then follows the live memory (the CPU counterpart of"
        " `torch.cuda.max_memory_allocated`) instead of keeping the heap that the default"
        " allocator grows and keeps; *before training*: that run's setup RSS above the runtime"
        " (weights, optimizer state, written buffers; on the Trainer route, after the warm-up"
        " step). *Active ratio*: parameter fraction with a gradient, summed over a step's"
        " passes.",
        *_route_lines(result),
        "",
        f"## Goal: SL-SAM's per-rank peak <= {result['goal']:.2f}x SAM's, same shape, same"
        " route, same strategy",
        "",
        "| shape | route | strategy | SL-SAM / SAM | verdict | SL-SAM / SAM, freed returned"
        " | verdict | goal |",
        "|---|---|---|---:|---|---:|---|---:|",
    ]
    for s in result["shapes"].values():
        for strategy, v in s["summary"]["goal"].items():
            lines.append(
                f"{_where(s)} | {strategy} | {v['ratio']:.3f} | {_verdict(v['met'])}"
                f" | {_f(v.get('returned_ratio'))} | {_verdict(v.get('returned_met'))}"
                f" | {v['goal']:.2f} |"
            )
    agree = all(
        r["masks_agree"]
        for s in result["shapes"].values()
        for ms in s["summary"]["rows"].values()
        for r in ms.values()
    )
    lines += ["", f"Both ranks drew the same layers every step: {'yes' if agree else '**no**'}."]
    if result.get("notes"):
        lines += ["", result["notes"]]
    return "\n".join(lines) + "\n"
