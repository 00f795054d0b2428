"""What SL-SAM reports: distribution entropy and the per-layer activation record.

The per-layer record is the SL-SAM paper's Figure 3: for each layer, the fraction of
training steps in which it was active. It is written as CSV (one row per layer) and
as a PNG chart.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "normalized_entropy",
    "plot_layer_frequency",
    "rank_correlation",
    "write_layer_frequency_csv",
]


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
) -> str:
    """Write one row per layer: index, name, parameters, activations, frequency, final p
    and (when given) the layer's mean first-pass gradient norm."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        header = ["index", "layer", "numel", "activations", "frequency", "final_prob"]
        writer.writerow(header + (["mean_grad_norm"] if mean_norms is not None else []))
        for i, name in enumerate(names):
            count = int(counts[i])
            freq = count / steps if steps else 0.0
            row = [i, name, int(numel[i]), count, f"{freq:.6f}", f"{probs[i]:.6f}"]
            if mean_norms is not None:
                row.append(f"{float(mean_norms[i]):.6g}")
            writer.writerow(row)
    return path


def plot_layer_frequency(
    path: str,
    names: Sequence[str],
    counts: Tensor,
    steps: int,
    probs: Tensor,
    layer_ratio: float,
    title: str = "SL-SAM: how often each layer was trained",
) -> str:
    """Save the activation-frequency chart (bars per layer plus their histogram) as PNG."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    freq = (counts.double() / max(steps, 1)).numpy()
    n = len(names)
    fig, (ax_bar, ax_hist) = plt.subplots(
        1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [3, 1]}, constrained_layout=True
    )
    ax_bar.bar(
        range(n), freq, width=0.8 if n <= 60 else 1.0, color="#4C72B0", label="activation frequency"
    )
    ax_bar.plot(
        range(n),
        probs.numpy(),
        "o",
        ms=3 if n > 60 else 5,
        color="#DD8452",
        label="final probability",
    )
    ax_bar.axhline(layer_ratio, color="k", ls="--", lw=1, label=f"target ratio {layer_ratio:g}")
    ax_bar.set_xlim(-0.5, n - 0.5)
    ax_bar.set_ylim(0, 1.02)
    ax_bar.set_xlabel("layer (model order)")
    ax_bar.set_ylabel(f"fraction of {steps} steps")
    ax_bar.set_title(title)
    ax_bar.legend(loc="upper right", fontsize=8)
    if n <= 40:
        ax_bar.set_xticks(range(n), [str(s) for s in names], rotation=90, fontsize=6)
    ax_hist.hist(freq, bins=20, range=(0, 1), color="#4C72B0", edgecolor="white")
    ax_hist.set_xlabel("activation frequency")
    ax_hist.set_ylabel("layers")
    ax_hist.yaxis.get_major_locator().set_params(integer=True)
    ax_hist.set_title(f"{n} layers")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
