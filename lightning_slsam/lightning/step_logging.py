"""What a SAM callback logs each step and writes at the end of fit.

Per step: the metrics of :func:`step_metrics` (namespaced ``slsam/...`` for loggers,
short names on the progress bar). At the end of fit: the per-layer record, a CSV and a
PNG of how often each layer was trained, in the logger's folder (without a logger, in
``<default_root_dir>/slsam_records/version_N``), never overwriting an earlier run's.
"""

from __future__ import annotations

import glob
import math
import os
import re
from typing import TYPE_CHECKING, Any

from lightning_slsam.lightning.metrics import (
    FixedTensor,
    normalized_entropy,
    plot_layer_frequency,
    write_layer_frequency_csv,
)

if TYPE_CHECKING:
    from lightning_slsam.core.engine import SparseSAMEngine
    from lightning_slsam.core.partition import LayerPartition
    from lightning_slsam.core.step import StepResult

__all__ = [
    "PROGRESS_BAR",
    "RATIO_METRIC",
    "RECORD_STEM",
    "fit_message",
    "fit_summary",
    "fixed_tensors",
    "fresh_stem",
    "newest_chart",
    "out_of_sampling",
    "record_dir",
    "step_metrics",
    "write_record",
]

RECORD_STEM = "slsam_layer_frequency"
RATIO_METRIC = "slsam/mean_active_ratio"


def record_dir(trainer: Any) -> str:
    """Where the end-of-fit record goes: the logger's folder, or without a logger
    ``<default_root_dir>/slsam_records`` (one ``version_N`` folder per run)."""
    if trainer.loggers:
        return trainer.log_dir or trainer.default_root_dir
    return os.path.join(trainer.default_root_dir, "slsam_records")


def fresh_stem(directory: str, versioned: bool) -> str:
    """A path stem for the record that overwrites no earlier run's: a new ``version_N``
    folder, or a ``_N`` suffix when the folder holds a record already."""
    if versioned:
        taken = glob.glob(os.path.join(directory, "version_*"))
        numbers = [int(m.group(1)) for p in taken if (m := re.search(r"version_(\d+)$", p))]
        directory = os.path.join(directory, f"version_{max(numbers, default=-1) + 1}")
    os.makedirs(directory, exist_ok=True)
    stem, k = os.path.join(directory, RECORD_STEM), 0
    while os.path.exists(stem + ".csv") or os.path.exists(stem + ".png"):
        k += 1
        stem = os.path.join(directory, f"{RECORD_STEM}_{k}")
    return stem


PROGRESS_BAR = {
    "sl_layers": "slsam/active_layers",
    "sl_ratio": "slsam/active_ratio",
    "sl_entropy": "slsam/entropy",
}


def fit_message(name: str, engine: SparseSAMEngine, chart: str | None) -> str:
    """The line printed at the end of fit."""
    message = (
        f"{name}: mean active ratio {engine.mean_active_ratio:.3f}x over the passes"
        f" (SAM: 2.0x, AdamW: 1.0x), {engine.partition.num_layers} sampled layers,"
        f" {engine.never_selected()} never selected, {engine.num_skipped} skipped steps."
    )
    fixed = out_of_sampling(engine.partition)
    message += f" {fixed}." if fixed else ""
    return message + (f" Per-layer activation chart: {chart}" if chart else "")


def out_of_sampling(partition: LayerPartition, shown: int = 6) -> str:
    """The tensors taken out of sampling, named (``""`` when there are none).

    Example:
        >>> import torch
        >>> from lightning_slsam.core.partition import build_partition
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> out_of_sampling(build_partition(net, always_active=["^1[.]"]))
        'Always active (trained every step, not sampled): 1.weight, 1.bias'
    """
    parts = []
    for label, names in (
        ("Always active (trained every step, not sampled)", partition.always_active_names),
        ("always frozen (never trained)", partition.always_frozen_names),
    ):
        if names:
            more = f" and {len(names) - shown} more" if len(names) > shown else ""
            parts.append(f"{label}: {', '.join(names[:shown])}{more}")
    text = "; ".join(parts)
    return text[:1].upper() + text[1:]


def fit_summary(trainer: Any, ratio: float, chart: str | None) -> dict[str, Any]:
    """The run's mean active ratio and chart; where the process that called ``fit`` did
    not train (``ddp_spawn``), the ratio from ``trainer.callback_metrics`` and the newest
    chart in the run's record folder."""
    if math.isnan(ratio) and RATIO_METRIC in trainer.callback_metrics:
        ratio = float(trainer.callback_metrics[RATIO_METRIC])
    if chart is None and not math.isnan(ratio):
        chart = newest_chart(record_dir(trainer))
    return {"mean_active_ratio": ratio, "layer_frequency_png": chart}


def newest_chart(directory: str) -> str | None:
    """The newest per-layer chart under ``directory`` (``None`` if there is none)."""
    found = glob.glob(os.path.join(directory, "**", f"{RECORD_STEM}*.png"), recursive=True)
    return max(found, key=os.path.getmtime) if found else None


def fixed_tensors(partition: LayerPartition) -> list[FixedTensor]:
    """The tensors taken out of sampling, as the record lists them."""
    return [
        *((n, p.numel(), "always_active") for n, p in
          zip(partition.always_active_names, partition.always_active)),
        *((n, p.numel(), "always_frozen") for n, p in
          zip(partition.always_frozen_names, partition.always_frozen)),
    ]  # fmt: skip


def write_record(
    stem: str, engine: SparseSAMEngine, partition: LayerPartition, plot: bool, title: str
) -> tuple[str, str | None]:
    """Write ``stem.csv`` (and ``stem.png`` if ``plot``): each layer's activation count,
    frequency, probability and mean gradient norm. Returns both paths."""
    steps = engine.num_steps - engine.num_skipped
    probs = engine.selection.probs
    fixed = fixed_tensors(partition)
    csv_path = write_layer_frequency_csv(
        stem + ".csv",
        partition.names,
        partition.numel,
        engine.counts,
        steps,
        probs,
        engine.mean_norms(),
        fixed=fixed,
    )
    png_path = None
    if plot:
        png_path = plot_layer_frequency(
            stem + ".png",
            partition.names,
            engine.counts,
            steps,
            probs,
            float(probs.mean()),
            title=title,
            fixed=fixed,
        )
    return csv_path, png_path


def step_metrics(
    result: StepResult, engine: SparseSAMEngine, distributed: bool
) -> dict[str, float]:
    """The metrics logged after each optimizer step."""
    total = max(result.trainable_numel, 1)
    per_pass = [n / total for n in result.pass_numel] + [0.0, 0.0]
    metrics = {
        "slsam/active_layers": float(result.active_mask.sum()),
        "slsam/active_ratio": result.active_ratio,
        "slsam/active_ratio_pass1": per_pass[0],
        "slsam/active_ratio_pass2": per_pass[1],
        "slsam/backward_passes": float(len(result.pass_numel) + result.extra_backward),
        "slsam/sam_step": float(result.kind in ("sam", "single")),
        "slsam/entropy": normalized_entropy(engine.selection.probs),
        "slsam/never_selected": float(int((engine.counts == 0).sum())),
        "slsam/skipped_steps": float(engine.num_skipped),
    }
    if distributed:
        metrics["slsam/allreduce_bytes"] = float(result.allreduce_bytes)
    return metrics
