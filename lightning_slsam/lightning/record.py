"""The record of a fit: the per-layer activation record written at the end of fit (the
SL-SAM paper's Figure 3), the line printed then, and the run's summary.

For each layer, the fraction of training steps in which it was active, its final
probability and mean first-pass gradient norm are written as CSV (one row per layer) and
as a PNG chart, in the logger's folder (without a logger, in
``<default_root_dir>/slsam_records/version_N``), never overwriting an earlier run's.
Tensors taken out of sampling (``always_active``, the detected head, ``always_frozen``)
are in both too, after the sampled layers and marked with their role.
"""

from __future__ import annotations

import csv
import glob
import math
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_slsam.core.engine import SparseSAMEngine
    from lightning_slsam.core.partition import LayerPartition

__all__ = [
    "RATIO_METRIC",
    "RECORD_STEM",
    "ROLES",
    "FixedTensor",
    "fit_message",
    "fit_summary",
    "fixed_tensors",
    "fresh_stem",
    "newest_chart",
    "out_of_sampling",
    "plot_layer_frequency",
    "rank_correlation",
    "record_dir",
    "write_layer_frequency_csv",
    "write_record",
]

#: A layer's role in the record: drawn by the selection, or taken out of sampling.
ROLES = ("sampled", "always_active", "always_frozen")

#: A tensor taken out of sampling: (name, parameter count, role), role one of ``ROLES[1:]``.
FixedTensor = tuple[str, int, str]


def rank_correlation(x: Tensor, y: Tensor) -> float:
    """Spearman's rank correlation of two equal-length vectors (ties get their mean rank).

    Entries where either value is NaN are left out; NaN if fewer than two remain or one
    side is constant.
    """
    x, y = x.double().flatten(), y.double().flatten()
    keep = ~(torch.isnan(x) | torch.isnan(y))
    x, y = x[keep], y[keep]
    if x.numel() < 2:
        return math.nan
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = math.sqrt(float((rx * rx).sum()) * float((ry * ry).sum()))
    return float((rx * ry).sum()) / denom if denom > 0 else math.nan


def _ranks(values: Tensor) -> Tensor:
    _, inverse, counts = torch.unique(values, return_inverse=True, return_counts=True)
    below = (torch.cumsum(counts, 0) - counts).double()
    return below[inverse] + (counts[inverse].double() - 1.0) / 2.0


def write_layer_frequency_csv(
    path: str,
    names: Sequence[str],
    numel: Sequence[int],
    counts: Tensor,
    steps: int,
    probs: Tensor,
    mean_norms: Tensor | None = None,
    fixed: Sequence[FixedTensor] = (),
) -> str:
    """Write one row per layer: index, name, role, parameters, activations, frequency,
    final p and (when given) the layer's mean first-pass gradient norm.

    The sampled layers come first (role ``sampled``), then the ``fixed`` tensors: an
    always-active one was trained in every step (frequency 1), an always-frozen one in
    none; neither has a probability or a measured norm (empty cells).
    """
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        header = ["index", "layer", "role", "numel", "activations", "frequency", "final_prob"]
        writer.writerow(header + (["mean_grad_norm"] if mean_norms is not None else []))
        for i, name in enumerate(names):
            count = int(counts[i])
            freq = count / steps if steps else 0.0
            row = [i, name, "sampled", int(numel[i]), count, f"{freq:.6f}", f"{probs[i]:.6f}"]
            if mean_norms is not None:
                row.append(f"{float(mean_norms[i]):.6g}")
            writer.writerow(row)
        for k, (name, size, role) in enumerate(fixed, len(names)):
            count = steps if role == "always_active" else 0
            row = [k, name, role, size, count, f"{count / steps if steps else 0.0:.6f}", ""]
            writer.writerow(row + ([""] if mean_norms is not None else []))
    return path


def plot_layer_frequency(
    path: str,
    names: Sequence[str],
    counts: Tensor,
    steps: int,
    probs: Tensor,
    layer_ratio: float,
    title: str = "SL-SAM: how often each layer was trained",
    fixed: Sequence[FixedTensor] = (),
) -> str:
    """Save the activation-frequency chart (bars per layer plus their histogram) as PNG.

    The ``fixed`` tensors follow the sampled layers: an always-active one as a bar of
    another colour at 1, an always-frozen one as a cross at 0; the histogram counts the
    sampled layers only.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    freq = (counts.double() / max(steps, 1)).numpy()
    n = len(names)
    total = n + len(fixed)
    fig, (ax_bar, ax_hist) = plt.subplots(
        1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [3, 1]}, constrained_layout=True
    )
    width = 0.8 if total <= 60 else 1.0
    ax_bar.bar(range(n), freq, width=width, color="#4C72B0", label="activation frequency")
    active = [n + k for k, (_, _, role) in enumerate(fixed) if role == "always_active"]
    frozen = [n + k for k, (_, _, role) in enumerate(fixed) if role == "always_frozen"]
    if active:
        ax_bar.bar(active, [1.0] * len(active), width=width, color="#55A868",
                   label="always active (not sampled)")  # fmt: skip
    if frozen:
        ax_bar.plot(frozen, [0.0] * len(frozen), "x", color="#C44E52", clip_on=False,
                    label="always frozen (not sampled)")  # fmt: skip
    ax_bar.plot(
        range(n),
        probs.numpy(),
        "o",
        ms=3 if n > 60 else 5,
        color="#DD8452",
        label="final probability",
    )
    ax_bar.axhline(layer_ratio, color="k", ls="--", lw=1, label=f"target ratio {layer_ratio:g}")
    ax_bar.set_xlim(-0.5, total - 0.5)
    ax_bar.set_ylim(0, 1.02)
    ax_bar.set_xlabel("layer (model order)")
    ax_bar.set_ylabel(f"fraction of {steps} steps")
    ax_bar.set_title(title)
    # Below the panels, so that no bar is hidden behind it.
    fig.legend(*ax_bar.get_legend_handles_labels(), loc="outside lower center", ncol=4,
               fontsize=8, frameon=False)  # fmt: skip
    if total <= 40:
        labels = [str(s) for s in names] + [name for name, _, _ in fixed]
        ax_bar.set_xticks(range(total), labels, rotation=90, fontsize=6)
    ax_hist.hist(freq, bins=20, range=(0, 1), color="#4C72B0", edgecolor="white")
    ax_hist.set_xlabel("activation frequency")
    ax_hist.set_ylabel("layers")
    ax_hist.yaxis.get_major_locator().set_params(integer=True)
    ax_hist.set_title(f"{n} sampled layers" if fixed else f"{n} layers")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
