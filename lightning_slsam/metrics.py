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

__all__ = ["normalized_entropy", "plot_layer_frequency", "write_layer_frequency_csv"]


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


def write_layer_frequency_csv(
    path: str,
    names: Sequence[str],
    numel: Sequence[int],
    counts: Tensor,
    steps: int,
    probs: Tensor,
) -> str:
    """Write one row per layer: index, name, parameters, activations, frequency, final p."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["index", "layer", "numel", "activations", "frequency", "final_prob"])
        for i, name in enumerate(names):
            count = int(counts[i])
            freq = count / steps if steps else 0.0
            writer.writerow([i, name, int(numel[i]), count, f"{freq:.6f}", f"{probs[i]:.6f}"])
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
