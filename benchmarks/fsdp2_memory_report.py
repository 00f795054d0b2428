"""The pure part of ``fsdp2_memory.py``: medians, ratios, the goal's verdicts, the shapes'
regimes, merging a run into the saved results, and the markdown table. No torch here."""

from __future__ import annotations

import statistics

GOAL = 0.85  # SL-SAM's per-rank peak / SAM's, under each strategy
#: glibc told to unmap every block over 128 KiB when freed: the RSS then follows live memory.
RETURNED = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
#: What one shape's entry of the results holds (the rest is shared by every shape).
SHAPE_KEYS = ("batch_per_rank", "seq", "steps", "repeats", "threads", "runs", "returned",
              "summary", "command", "malloc_env", "date", "minutes", "cpu_minutes",
              "machine", "estimate")  # fmt: skip


def shape_name(batch: int, seq: int) -> str:
    return f"{batch}x{seq}"


def summarize(runs: dict, returned: dict | None = None, goal: float = GOAL) -> dict:
    """``runs[strategy][method]``: a list of repeats, each the ranks' result dicts;
    ``returned[strategy][method]``: the ranks' results of the run with :data:`RETURNED`.

    Returns per configuration the median over repeats of the per-rank peak training MB
    and of its max over ranks, the ratios to SAM (same strategy) and FSDP2 / DDP (same
    method), the peak with freed memory returned (max over ranks) and its ratio to SAM, and
    the goal's verdict per strategy (SL-SAM / SAM <= ``goal``), on the default RSS peak
    (``met``) and on the peak with freed memory returned (``returned_met``)."""
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
        sam = methods.get("sam", {})
        for method, row in methods.items():
            for key, ratio in (("peak_mb", "ratio_to_sam"), ("returned_mb", "returned_to_sam")):
                base = sam.get(key)
                row[ratio] = row[key] / base if base and key in row else None
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
    """The results by shape, from either format: this one (``shapes``), or the single-shape
    one of the first version of the script (batch 8, sequence 128, no ``shapes`` key)."""
    if "shapes" in result:
        return dict(result["shapes"])
    entry = {k: result[k] for k in SHAPE_KEYS if k in result}
    entry.setdefault("seq", 128)
    return {shape_name(entry["batch_per_rank"], entry["seq"]): entry}


def merge(saved: dict | None, new: dict) -> dict:
    """``new``'s shapes replace the same shapes of ``saved`` (the results on disk, either
    format); ``saved``'s other shapes stay as they were, in their place."""
    shapes = as_shapes(saved) if saved else {}
    shapes.update(new["shapes"])
    return {**new, "shapes": shapes}


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _verdict(met: bool | None) -> str:
    return "-" if met is None else "met" if met else "**missed**"


def _shape_lines(result: dict) -> list[str]:
    world = result["world"]
    lines = [
        "| shape | batch per rank (global) x tokens | steps, runs | weights + grads + AdamW"
        " state per rank: DDP / FSDP2 MB | activations saved for backward MB | logits MB"
        " | regime | run |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    for name, s in result["shapes"].items():
        e = s.get("estimate") or {}
        params = e.get("weights_grads_adamw_mb", {})
        param_text = " / ".join(f"{params[k]:.0f}" for k in ("ddp", "fsdp2") if k in params)
        run = (
            f"`{s['command']}`, {s['minutes']:.1f} min ({s.get('cpu_minutes', 0):.1f} CPU min),"
            f" {s['date'][:10]}"
        )
        lines.append(
            f"| {name} | {s['batch_per_rank']} ({s['batch_per_rank'] * world}) x {s['seq']}"
            f" | {s['steps']}, {s['repeats']} + 1 | {param_text or '-'}"
            f" | {_f(e.get('saved_activations_mb'), 0)} | {_f(e.get('logits_mb'), 1)}"
            f" | {regime(e) if e else '-'} | {run} |"
        )
    return lines


def render(result: dict) -> str:
    """The markdown report of ``fsdp2_memory.main``'s result (``result["shapes"]``: one
    entry per shape, each with its own runs, summary, command, date and estimate)."""
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
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}, Python {m['python']},"
        f" torch {m['torch']}, GPU: {m['cuda'] or 'none'}. Each shape's numbers come from the"
        " run named in its row (a run with `--shapes` measures only the shapes it names and"
        " keeps the others' results as they were).",
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
        "| shape | strategy | method | peak training MB (max of ranks) | runs | per rank"
        " | / SAM | FSDP2 / DDP | freed returned: peak MB | per rank | / SAM"
        " | before training | active ratio |",
        "|---|---|---|" + "---:|" * 10,
    ]
    for name, s in result["shapes"].items():
        for strategy, methods in s["summary"]["rows"].items():
            for method, row in methods.items():
                runs = ", ".join(f"{v:.0f}" for v in row["repeats_mb"])
                back = " / ".join(f"{v:.0f}" for v in row.get("returned_per_rank_mb", []))
                lines.append(
                    f"| {name} | {strategy} | {method} | {row['peak_mb']:.0f} | {runs}"
                    f" | {' / '.join(f'{v:.0f}' for v in row['per_rank_mb'])}"
                    f" | {_f(row['ratio_to_sam'])} | {_f(row['fsdp2_over_ddp'])}"
                    f" | {_f(row.get('returned_mb'), 0)} | {back or '-'}"
                    f" | {_f(row.get('returned_to_sam'))}"
                    f" | {_f(row.get('returned_setup_mb'), 0)} | {_f(row['active_ratio'])} |"
                )
    lines += [
        "",
        "MB are MiB. *Runs*: each run's max over ranks. *Freed returned*: one more run per"
        " configuration, measured the same way, with glibc told to give every freed block over"
        f" 128 KiB back to the OS ({' '.join(f'{k}={v}' for k, v in RETURNED.items())}): the"
        " RSS then follows the live memory (the CPU counterpart of"
        " `torch.cuda.max_memory_allocated`) instead of keeping the heap that the default"
        " allocator grows and keeps; *before training*: that run's setup RSS above the runtime"
        " (weights, optimizer state, written buffers). *Active ratio*: parameter fraction with"
        " a gradient, summed over a step's passes.",
        "",
        f"## Goal: SL-SAM's per-rank peak <= {result['goal']:.2f}x SAM's, same shape, same"
        " strategy",
        "",
        "| shape | strategy | SL-SAM / SAM | verdict | SL-SAM / SAM, freed returned | verdict"
        " | goal |",
        "|---|---|---:|---|---:|---|---:|",
    ]
    for name, s in result["shapes"].items():
        for strategy, v in s["summary"]["goal"].items():
            lines.append(
                f"| {name} | {strategy} | {v['ratio']:.3f} | {_verdict(v['met'])}"
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
