"""The report of ``python -m examples.compare``: the table of methods (mean ± std over seeds),
the metric-against-active-ratio plot and the selection plots, from the runs' records."""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["mean_std", "plot", "plot_selection", "rank_correlation", "render", "selection_figure",
           "summarize"]  # fmt: skip


def rank_correlation(x: Tensor, y: Tensor) -> float:
    """Spearman's rank correlation, NaNs left out; NaN if under two remain or one is constant."""
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


def _stats(values: list[float]) -> tuple[float, float | None]:
    """Mean and standard deviation; no deviation (``None``) for a single run."""
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def mean_std(mean: float | None, std: float | None) -> str:
    """``"0.8312 ± 0.0041"``, ``"0.8312"`` for a single run, ``"-"`` for none.

    Example:
        >>> mean_std(0.83125, 0.0041), mean_std(0.28125, None), mean_std(None, None)
        ('0.8313 ± 0.0041', '0.2812', '-')
    """
    if mean is None:
        return "-"
    return f"{mean:.4f}" if std is None else f"{mean:.4f} ± {std:.4f}"


def summarize(records: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per-method means (and std of the metric) over the seeds."""
    rows = {}
    for method, runs in records.items():
        best = [r["best"] for r in runs if r["best"] is not None]
        final = [r["final"] for r in runs if r["final"] is not None]
        # Each run's training time per epoch (its total over its epochs, so a costlier
        # first epoch counts), then the median over the seeds: one run slowed by a busy
        # machine does not move it, as it would move a mean.
        epoch = [statistics.mean(r["epoch_times"]) for r in runs if r["epoch_times"]]
        spearman = [r.get("spearman_frequency_norm") for r in runs]
        spearman = [x for x in spearman if x is not None and x == x]
        entropy = [r["entropy"][-1] for r in runs if r.get("entropy")]
        floor = [r["floor_layers"][-1] for r in runs if r.get("floor_layers")]
        rows[method] = {
            "seeds": len(runs),
            "best": _stats(best) if best else (None, None),
            "final": _stats(final) if final else (None, None),
            "active_ratio": statistics.mean(r["active_ratio"] for r in runs),
            "epoch_time_s": statistics.median(epoch) if epoch else None,
            "peak_memory_mb": statistics.mean(r["peak_memory_mb"] for r in runs),
            "spearman": statistics.mean(spearman) if spearman else None,
            "final_entropy": statistics.mean(entropy) if entropy else None,
            "final_floor": statistics.mean(floor) if floor else None,
        }
        reported = [r for r in runs if r.get("report")]
        if reported:  # a held-out metric read where the monitored one was best, and last
            at_best = [r["report_at_best"] for r in reported if r["report_at_best"] is not None]
            last = [r["report_final"] for r in reported if r["report_final"] is not None]
            rows[method]["report"] = reported[0]["report"]
            rows[method]["report_at_best"] = _stats(at_best) if at_best else (None, None)
            rows[method]["report_final"] = _stats(last) if last else (None, None)
    base = rows.get("sam") or rows.get("adasam")  # the label of SAM's rows before 0.3
    for row in rows.values():
        for key in ("epoch_time_s", "peak_memory_mb"):
            ok = base is not None and base[key] and row[key] is not None
            row[f"{key}_vs_sam"] = row[key] / base[key] if ok else None
    return rows


def render(rows: dict[str, dict[str, Any]], monitor: str, task: str) -> str:
    def pct(value: float | None) -> str:
        return "" if value is None else f" ({(value - 1) * 100:+.1f}%)"

    lines = [
        f"# Comparison on `{task}`",
        "",
        f"`{monitor}`: best over the run and final, mean ± std over seeds (a single seed:"
        " its value). Active ratio:"
        " parameter fraction with a gradient, summed over a step's passes (AdamW 1.0x, SAM"
        " 2.0x). Epoch time: training batches only, each run's mean over all its epochs (a"
        " costlier warm-up counts), median over the seeds."
        " Memory: peak RSS of the run's process on"
        " a CPU (CUDA: max_memory_allocated). Percentages relative to SAM. Selection:"
        " Spearman correlation of the layers' activation frequencies with their mean"
        " first-pass gradient norms, final normalised entropy of the distribution (1.0 ="
        " uniform), layers at the floor p_min at the end (bandit methods).",
        "",
        f"| method | seeds | best {monitor} | final {monitor} | active ratio | epoch time (s) |"
        " peak memory (MB) | Spearman | entropy | at floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for method, row in rows.items():
        best, final = mean_std(*row["best"]), mean_std(*row["final"])
        epoch = row["epoch_time_s"]
        floor = row.get("final_floor")
        lines.append(
            f"| {method} | {row['seeds']} | {best} | {final} | {row['active_ratio']:.3f}x"
            f" | {'-' if epoch is None else f'{epoch:.1f}'}{pct(row['epoch_time_s_vs_sam'])}"
            f" | {row['peak_memory_mb']:.0f}{pct(row['peak_memory_mb_vs_sam'])}"
            f" | {num(row.get('spearman'), '.2f')} | {num(row.get('final_entropy'), '.3f')}"
            f" | {num(floor, '.0f')} |"
        )
    held = [(m, r) for m, r in rows.items() if r.get("report")]
    if held:
        name = held[0][1]["report"]
        lines += [
            "",
            f"`{name}` at the evaluation where `{monitor}` was best (chosen on validation,"
            " read on the held-out split) and at the last, mean ± std over seeds.",
            "",
            f"| method | seeds | {name} at the best {monitor} | final {name} |",
            "|---|---:|---:|---:|",
        ]
        for method, row in held:
            at_best, last = mean_std(*row["report_at_best"]), mean_std(*row["report_final"])
            lines.append(f"| {method} | {row['seeds']} | {at_best} | {last} |")
    return "\n".join(lines) + "\n"


def plot(rows: dict[str, dict[str, Any]], monitor: str, path: str) -> None:
    """The SL-SAM paper's Figure 1: the metric against the active ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5), constrained_layout=True)
    for method, row in rows.items():
        mean, std = row["best"]
        if mean is None:
            continue
        ax.errorbar(row["active_ratio"], mean, yerr=std, fmt="o", capsize=4, label=method)
        ax.annotate(method, (row["active_ratio"], mean), textcoords="offset points",
                    xytext=(5, 5), fontsize=8)  # fmt: skip
    ax.set_xlabel("active ratio (parameter fraction with a gradient, summed over passes)")
    ax.set_ylabel(f"best {monitor}")
    ax.set_title("Accuracy against the gradient work per step")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_selection(records: dict[str, list[dict[str, Any]]], path: str) -> bool:
    """Save :func:`selection_figure` as a PNG at ``path``. Returns False (no file) when no
    method has a learning selection."""
    fig = selection_figure(records)
    if fig is None:
        return False
    fig.savefig(path, dpi=120)
    return True


def selection_figure(records: dict[str, list[dict[str, Any]]]) -> Figure | None:
    """Entropy of the layer distribution and layers at the floor over the steps, per method
    (mean over the seeds); ``None`` when no method has a learning selection. The step axes
    have whole-number ticks and the floor count starts at 0."""
    traced = {m: runs for m, runs in records.items() if any(r.get("floor_layers") for r in runs)}
    if not traced:
        return None
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 4.6), layout="constrained")
    ax_e, ax_f = fig.subplots(1, 2)
    for n, (method, runs) in enumerate(traced.items()):
        # Ten colours, then the same colours dashed: every line stays distinguishable.
        style = {"color": f"C{n % 10}", "ls": "-" if n < 10 else "--", "lw": 1.3}
        for key, ax in (("entropy", ax_e), ("floor_layers", ax_f)):
            series = [r[key] for r in runs if r.get(key)]
            length = min(len(x) for x in series)
            mean = [statistics.mean(x[i] for x in series) for i in range(length)]
            ax.plot(range(1, length + 1), mean, label=method, **style)
    ax_e.set_ylabel("normalised entropy (1.0 = uniform)")
    ax_f.set_ylabel("layers at the floor p_min")
    # A count: from 0, in whole layers, at least up to 1 when no layer reached the floor.
    ax_f.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_f.set_ylim(0, max(ax_f.get_ylim()[1], 1))
    for ax in (ax_e, ax_f):
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    # One legend for both panels, below them, so no line is hidden behind it.
    fig.legend(*ax_e.get_legend_handles_labels(), loc="outside lower center", fontsize=8,
               ncol=min(len(traced), 4), frameon=False)  # fmt: skip
    ax_e.set_title("How far the layer distribution moved from uniform")
    ax_f.set_title("How many layers the bandit pushed to the floor")
    return fig
