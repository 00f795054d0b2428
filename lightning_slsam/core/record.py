"""The record of a fit: the per-layer CSV and chart (the paper's Figure 3), the line printed
at its end, and the run's summary. A record never overwrites an earlier run's.
"""

from __future__ import annotations

import csv
import glob
import math
import os
import re
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from lightning_slsam.core.engine import SAMEngine
    from lightning_slsam.core.partition import LayerPartition

__all__ = ["RATIO_METRIC", "RECORD_STEM", "ROLES", "FixedTensor", "common_affixes", "fit_message",
           "fit_summary", "fixed_tensors", "fresh_stem", "layer_frequency_figure", "layers_line",
           "newest_chart", "out_of_sampling", "plot_layer_frequency",
           "ratio_label", "record_dir", "short_labels", "write_layer_frequency_csv",
           "write_record"]  # fmt: skip

#: A layer's role in the record: drawn by the selection, or taken out of sampling.
ROLES = ("sampled", "always_active", "always_frozen")

#: A tensor taken out of sampling: (name, parameter count, role), role one of ``ROLES[1:]``.
FixedTensor = tuple[str, int, str]


def write_layer_frequency_csv(path: str, names: Sequence[str], numel: Sequence[int],
                              counts: Tensor, steps: int, probs: Tensor,
                              mean_norms: Tensor | None = None, fixed: Sequence[FixedTensor] = (),
                              layer_steps: Tensor | None = None) -> str:  # fmt: skip
    """Write one row per layer, then the ``fixed`` tensors; returns ``path``."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        header = ["index", "layer", "role", "numel", "activations", "frequency", "final_prob"]
        writer.writerow(header + (["mean_grad_norm"] if mean_norms is not None else []))
        for i, name in enumerate(names):
            count = int(counts[i])
            own = steps if layer_steps is None else int(layer_steps[i])
            freq = count / own if own else 0.0
            row = [i, name, "sampled", int(numel[i]), count, f"{freq:.6f}", f"{probs[i]:.6f}"]
            if mean_norms is not None:
                row.append(f"{float(mean_norms[i]):.6g}")
            writer.writerow(row)
        for k, (name, size, role) in enumerate(fixed, len(names)):
            count = steps if role == "always_active" else 0
            row = [k, name, role, size, count, f"{count / steps if steps else 0.0:.6f}", ""]
            writer.writerow(row + ([""] if mean_norms is not None else []))
    return path


#: The longest tick label of the per-layer chart, in characters.
LABEL_WIDTH = 36
_ELLIPSIS = "\u2026"
_LABEL_PITCH = 0.15  # inches between two rotated tick labels
_COLOURS = {"sampled": "#4C72B0", "always_active": "#2E8540", "always_frozen": "#C44E52"}


def _units(name: str) -> list[str]:
    """A name's dotted parts, a number joined to the part before it (``layer.3``)."""
    units: list[str] = []
    for part in name.split("."):
        if part.isdigit() and units:
            units[-1] += "." + part
        else:
            units.append(part)
    return units


def common_affixes(names: Sequence[str]) -> tuple[str, str]:
    """The dotted prefix and suffix all ``names`` share, each name keeping a part at least.

    Example:
        >>> common_affixes(["base_model.model.layer.0.lora_A.default.weight",
        ...                 "base_model.model.layer.0.lora_B.default.weight"])
        ('base_model.model.layer.0.', '.default.weight')
        >>> common_affixes(["0.weight", "0.bias", "2.weight"])
        ('', '')
    """
    if not names:
        return "", ""
    units = [_units(name) for name in names]
    first, shortest = units[0], min(len(u) for u in units)
    head = tail = 0
    while head < shortest - 1 and all(u[head] == first[head] for u in units):
        head += 1
    while head + tail < shortest - 1 and all(u[-1 - tail] == first[-1 - tail] for u in units):
        tail += 1
    prefix, suffix = ".".join(first[:head]), ".".join(first[len(first) - tail :])
    return prefix + "." * bool(prefix), "." * bool(suffix) + suffix


def short_labels(
    names: Sequence[str], width: int = LABEL_WIDTH, shared: Sequence[str] | None = None
) -> list[str]:
    """Distinct labels of at most ``width`` characters (at least 10) for layer ``names``.

    The ``shared`` names (default: all) lose their :func:`common_affixes`, then a long name its
    commonest parts (``…``), never the last; clashing labels start with the position.

    Example:
        >>> names = [f"base_model.model.bert.encoder.layer.{i}.attention.self.{m}"
        ...          f".lora_{ab}.default.weight" for i in (0, 1) for m in ("query", "value")
        ...          for ab in "AB"]
        >>> short_labels(names)[:2]
        ['layer.0.attention.self.query.lora_A', 'layer.0.attention.self.query.lora_B']
        >>> short_labels(names, width=20)[:2]
        ['layer.0…query.lora_A', 'layer.0…query.lora_B']
        >>> short_labels(["x" * 20 + "1" + "y" * 20, "x" * 20 + "2" + "y" * 20], width=12)
        ['0:xxx…yyyyyy', '1:xxx…yyyyyy']
    """
    if width < 10:
        raise ValueError(f"`width` must be at least 10, got {width}.")
    shared = names if shared is None else shared
    prefix, suffix = common_affixes(shared)
    inner = set(shared)
    units = [_units(_strip(n, prefix, suffix) if n in inner else n) for n in names]
    holders: dict[str, int] = {}
    for name in names:
        for part in set(_units(name)):
            holders[part] = holders.get(part, 0) + 1
    kept: list[set[str]] = [set() for _ in names]
    while True:
        labels = [_fit(parts, holders, keep, width) for parts, keep in zip(units, kept)]
        merged = _merged(labels)
        grown = False
        for group in merged:
            sets = [set(units[i]) for i in group]
            telling = sets[0].union(*sets[1:]) - sets[0].intersection(*sets[1:])
            for i in group:
                grown |= not telling & set(units[i]) <= kept[i]
                kept[i] |= telling & set(units[i])
        if not grown:
            break
    for i in (i for group in merged for i in group):
        head = f"{i}:"
        labels[i] = head + _fit(units[i], holders, kept[i], width - len(head))
    return labels


def _strip(name: str, prefix: str, suffix: str) -> str:
    return name[len(prefix) : len(name) - len(suffix)]


def _merged(labels: list[str]) -> list[list[int]]:
    """The groups of positions that share a label."""
    positions: dict[str, list[int]] = {}
    for i, label in enumerate(labels):
        positions.setdefault(label, []).append(i)
    return [group for group in positions.values() if len(group) > 1]


def _fit(parts: list[str], holders: dict[str, int], keep: set[str], width: int) -> str:
    """``parts`` joined, the commonest dropped until it fits (never the last, nor ``keep``)."""
    shown = [True] * len(parts)
    order = sorted(
        (k for k in range(len(parts) - 1) if parts[k] not in keep),
        key=lambda k: (-holders[parts[k]], k),
    )
    label = _join(parts, shown)
    for k in order:
        if len(label) <= width:
            break
        shown[k] = False
        label = _join(parts, shown)
    return _cut(label, width)


def _join(parts: list[str], shown: list[bool]) -> str:
    """The shown parts joined by dots, each run of left-out parts as one ``…``."""
    text, gap = "", False
    for part, show in zip(parts, shown):
        if show:
            text += (_ELLIPSIS if gap else "." if text else "") + part
        gap = not show
    return text + (_ELLIPSIS if gap else "")


def _cut(text: str, width: int) -> str:
    """``text`` cut in its middle to ``width`` characters, keeping more of its end."""
    if len(text) <= width:
        return text
    head = (width - 1) // 3
    return text[:head] + _ELLIPSIS + text[len(text) - (width - 1 - head) :]


def ratio_label(probs: Tensor, layer_ratio: float | None, numel: Sequence[int] = ()) -> str:
    """The legend of the chart's mean-probability line, relating it to ``layer_ratio``.

    Example:
        >>> import torch
        >>> ratio_label(torch.tensor([0.1, 0.3]), 0.2)
        'layer_ratio 0.2 (= mean draw probability)'
        >>> ratio_label(torch.tensor([0.1, 0.5]), 0.2, numel=[300, 100])
        'mean draw probability 0.3 (layer_ratio 0.2 is a fraction of the parameters)'
        >>> ratio_label(torch.ones(3), None)
        'mean draw probability 1'
    """
    mean = float(probs.double().mean())
    if layer_ratio is None:
        return f"mean draw probability {mean:.3g}"
    if math.isclose(mean, layer_ratio, rel_tol=1e-3, abs_tol=1e-6):
        return f"layer_ratio {layer_ratio:g} (= mean draw probability)"
    text = f"mean draw probability {mean:.3g} (layer_ratio {layer_ratio:g}"
    if len(numel) == probs.numel():
        size = torch.tensor(numel, dtype=torch.float64)
        weighted = float((probs.double() * size).sum() / size.sum())
        if math.isclose(weighted, layer_ratio, rel_tol=1e-3, abs_tol=1e-6):
            return text + " is a fraction of the parameters)"
    return text + ")"


def layer_frequency_figure(names: Sequence[str], counts: Tensor, steps: int, probs: Tensor,
                           layer_ratio: float | None,
                           title: str = "SL-SAM: how often each layer was trained",
                           fixed: Sequence[FixedTensor] = (), numel: Sequence[int] = (),
                           layer_steps: Tensor | None = None) -> Figure:  # fmt: skip
    """The activation-frequency chart: a bar per layer, probabilities, and a histogram."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    own = torch.full((len(names),), steps) if layer_steps is None else layer_steps
    freq = (counts.double() / own.double().clamp(min=1)).numpy()
    n = len(names)
    total = n + len(fixed)
    roles = ["sampled"] * n + [role for _, _, role in fixed]
    all_names = [str(s) for s in names] + [name for name, _, _ in fixed]
    labels = short_labels(all_names, shared=[str(s) for s in names])
    bar_width = min(max(total * _LABEL_PITCH, 6.0), 16.0)
    every = math.ceil(total * _LABEL_PITCH / bar_width)
    ticks = list(range(0, total, every))
    label_height = 0.065 * max(len(labels[i]) for i in ticks) + 0.2
    fig = Figure(figsize=(bar_width + 4.6, 4.4 + 0.12 * (bar_width - 6.0) + label_height),
                 layout="constrained")  # fmt: skip
    ax_bar, ax_hist = fig.subplots(1, 2, width_ratios=[bar_width, 3.2])
    # Past 200 layers, touching bars drawn as one outline (a patch each is slow).
    width, blue = (0.8 if total <= 200 else 1.0), _COLOURS["sampled"]
    if total <= 200:
        bars = ax_bar.bar(range(n), freq, width=width, color=blue, label="activation frequency")
    else:
        edges = [i - 0.5 for i in range(n + 1)]
        bars = ax_bar.stairs(freq, edges, fill=True, color=blue, label="activation frequency")
    legend = [bars]
    active = [i for i, role in enumerate(roles) if role == "always_active"]
    frozen = [i for i, role in enumerate(roles) if role == "always_frozen"]
    if active:
        green, label = _COLOURS["always_active"], "always active (not sampled)"
        legend.append(ax_bar.bar(active, [1.0] * len(active), width=width, color=green,
                                 label=label))  # fmt: skip
    if frozen:
        red, label = _COLOURS["always_frozen"], "always frozen (not sampled)"
        legend += ax_bar.plot(frozen, [0.0] * len(frozen), "x", color=red, clip_on=False,
                              label=label)  # fmt: skip
    dot = 5 if total <= 60 else 3 if total <= 200 else 2
    legend += ax_bar.plot(range(n), probs.numpy(), "o", color="#DD8452", ms=dot,
                          label="final draw probability")  # fmt: skip
    mean, label = float(probs.double().mean()), ratio_label(probs, layer_ratio, numel)
    legend.append(ax_bar.axhline(mean, color="k", ls="--", lw=1, label=label))
    ax_bar.set_xlim(-0.5, total - 0.5)
    ax_bar.set_ylim(0, 1.02)
    ax_bar.set_xticks(ticks, [labels[i] for i in ticks], rotation=90, fontsize=7)
    for tick, i in zip(ax_bar.get_xticklabels(), ticks):
        tick.set_color(_COLOURS[roles[i]] if roles[i] != "sampled" else "black")
    ax_bar.set_xlabel(_axis_label([str(s) for s in names], every, bar_width))
    ax_bar.set_ylabel(f"fraction of {steps} steps")
    ax_hist.hist(freq, bins=20, range=(0, 1), color=_COLOURS["sampled"], edgecolor="white")
    ax_hist.set_xlabel("activation frequency")
    ax_hist.set_ylabel("layers")
    ax_hist.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_hist.set_ylim(bottom=0)
    ax_hist.set_title(f"{n} sampled layers" if fixed else f"{n} layers")
    ax_bar.set_title(title)
    texts = [str(handle.get_label()) for handle in legend]
    fig.legend(handles=legend, loc="outside lower center", frameon=False, fontsize=9,
               ncol=_legend_columns(texts, fig.get_figwidth()))  # fmt: skip
    return fig


def _legend_columns(texts: list[str], width: float) -> int:
    """The most columns in which a 9-point legend of ``texts`` fits ``width`` inches."""
    for columns in range(len(texts), 1, -1):
        rows = math.ceil(len(texts) / columns)
        chunks = [texts[k : k + rows] for k in range(0, len(texts), rows)]
        if sum(0.7 + 0.075 * max(map(len, chunk)) for chunk in chunks) <= width - 0.4:
            return columns
    return 1


def _axis_label(sampled: Sequence[str], every: int, width: float) -> str:
    """The layer axis' title, saying what the labels leave out, wrapped to ``width`` inches."""
    notes = [f"one label per {every} layers"] if every > 1 else []
    prefix, suffix = common_affixes(sampled)
    dropped = " and ".join(f"'{_cut(part, 40)}'" for part in (prefix, suffix) if part)
    if dropped:
        notes.append(f"sampled layers' names without {dropped}")
    if not notes:
        return "layer in model order"
    return "layer in model order\n" + textwrap.fill(f"({'; '.join(notes)})", int(width / 0.08))


def plot_layer_frequency(path: str, names: Sequence[str], counts: Tensor, steps: int,
                         probs: Tensor, layer_ratio: float | None,
                         title: str = "SL-SAM: how often each layer was trained",
                         fixed: Sequence[FixedTensor] = (), numel: Sequence[int] = (),
                         layer_steps: Tensor | None = None) -> str:  # fmt: skip
    """Save :func:`layer_frequency_figure` as a PNG at ``path``; returns ``path``."""
    fig = layer_frequency_figure(names, counts, steps, probs, layer_ratio, title, fixed, numel,
                                 layer_steps)  # fmt: skip
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


RECORD_STEM = "slsam_layer_frequency"
RATIO_METRIC = "slsam/mean_active_ratio"


def record_dir(trainer: Any) -> str:
    """Where the record goes: the logger's folder, else ``<default_root_dir>/slsam_records``."""
    if trainer.loggers:
        return trainer.log_dir or trainer.default_root_dir
    return os.path.join(trainer.default_root_dir, "slsam_records")


def fresh_stem(directory: str, versioned: bool) -> str:
    """A path stem overwriting no earlier record: a new ``version_N`` folder, or a ``_N`` suffix."""
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


def fit_message(name: str, engine: SAMEngine, chart: str | None) -> str:
    """The line printed at the end of fit."""
    message = (
        f"{name}: mean active ratio {engine.mean_active_ratio:.3f}x over the passes"
        f" (SAM: 2.0x, AdamW: 1.0x), {layers_line(engine)}."
    )
    fixed = out_of_sampling(engine.partition)
    message += f" {fixed}." if fixed else ""
    return message + (f" Per-layer activation chart: {chart}" if chart else "")


def layers_line(engine: SAMEngine) -> str:
    """The end-of-fit line's part on the layers (sampled, never selected) and skipped steps."""
    skipped = f"{engine.num_skipped} skipped steps"
    if not engine.sampled():
        return skipped
    layers = engine.partition.num_layers
    return f"{layers} sampled layers, {engine.never_selected()} never selected, {skipped}"


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
    """The run's mean active ratio and chart (found via the trainer under ``ddp_spawn``)."""
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
    stem: str, engine: SAMEngine, partition: LayerPartition, plot: bool, title: str,
    layer_ratio: float | None,
) -> tuple[str, str | None]:  # fmt: skip
    """Write ``stem.csv`` (and ``stem.png`` if ``plot``); returns both paths."""
    steps = engine.num_steps - engine.num_skipped
    probs = engine.selection.probs
    fixed = fixed_tensors(partition)
    csv_path = write_layer_frequency_csv(
        stem + ".csv", partition.names, partition.numel, engine.counts, steps, probs,
        engine.mean_norms(), fixed=fixed, layer_steps=engine.layer_steps(),
    )  # fmt: skip
    png_path = None
    if plot:
        png_path = plot_layer_frequency(
            stem + ".png", partition.names, engine.counts, steps, probs, layer_ratio,
            title=title, fixed=fixed, numel=partition.numel, layer_steps=engine.layer_steps(),
        )  # fmt: skip
    return csv_path, png_path
