"""What SL-SAM reports: distribution entropy and the per-layer activation record.

The per-layer record is the SL-SAM paper's Figure 3: for each layer, the fraction of
training steps in which it was active. It is written as CSV (one row per layer) and
as a PNG chart. Tensors taken out of sampling (``always_active``, the detected head,
``always_frozen``) are in both too, after the sampled layers and marked with their role.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "ROLES",
    "FixedTensor",
    "normalized_entropy",
    "plot_layer_frequency",
    "rank_correlation",
    "write_layer_frequency_csv",
]


#: A layer's role in the record: drawn by the selection, or taken out of sampling.
ROLES = ("sampled", "always_active", "always_frozen")

#: A tensor taken out of sampling: (name, parameter count, role), role one of ``ROLES[1:]``.
FixedTensor = tuple[str, int, str]


def normalized_entropy(probs: Tensor) -> float:
    """Entropy of ``probs / probs.sum()`` divided by ``log(N)``: 1.0 is uniform.

    Falls toward 0 as the bandit concentrates on few layers; 1.0 for a single layer.
    """
    n = probs.numel()
    if n <= 1:
        return 1.0
    q = probs.double() / probs.double().sum()
    entropy = -(q * torch.log(q.clamp_min(1e-300))).sum().item()
    return entropy / math.log(n)


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
