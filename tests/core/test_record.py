"""What a SAM callback logs each step (the engine's ``step_metrics``)
and writes at the end of fit (:mod:`lightning_slsam.core.record`): entropy, rank
correlation, the per-layer record."""

from __future__ import annotations

import csv
import itertools
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import LitModel, loader, make_data, make_mlp, trainer
from lightning.pytorch.loggers import CSVLogger
from matplotlib.backends.backend_agg import FigureCanvasAgg

from lightning_slsam import ESAM, RST, SAM, SparseLayerSAM
from lightning_slsam.core.engine import normalized_entropy
from lightning_slsam.core.record import (
    LABEL_WIDTH,
    common_affixes,
    layer_frequency_figure,
    plot_layer_frequency,
    ratio_label,
    short_labels,
    write_layer_frequency_csv,
)


class PerSampleLosses(LitModel):
    """Returns each sample's loss (ESAM ranks them; every other method averages them)."""

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1], reduction="none")


@pytest.mark.parametrize("method", [SAM, RST, ESAM])
def test_methods_updating_every_layer_write_no_per_layer_record(tmp_path, method, caplog):
    # A chart of ones and a count of "sampled layers" say nothing where every layer is
    # updated in every step (ESAM samples the perturbed layers, then updates them all).
    logger = CSVLogger(tmp_path, name="run")
    cb = method(rho=0.3, seed=0)
    t = trainer(callbacks=[cb], max_steps=4, logger=logger)
    with caplog.at_level("INFO"):
        t.fit(PerSampleLosses(make_mlp()), loader(make_data(64), 8))
    assert not cb.engine.sampled() and cb.engine.counts.tolist() == [4] * 8
    assert cb.frequency_csv_path is None and cb.frequency_plot_path is None
    assert not [f for f in os.listdir(logger.log_dir) if f.startswith("slsam_layer")]
    [line] = [r.getMessage() for r in caplog.records if "mean active ratio" in r.getMessage()]
    assert "sampled layers" not in line and "chart" not in line and "0 skipped steps" in line


def test_metrics_logged_every_step_and_frequency_record(tmp_path):
    logger = CSVLogger(tmp_path, name="run")
    cb = SparseLayerSAM(layer_ratio=0.5, seed=0)
    t = trainer(callbacks=[cb], max_epochs=2, logger=logger, log_every_n_steps=1)
    t.fit(LitModel(make_mlp()), loader(make_data(64), 16))

    with open(os.path.join(logger.log_dir, "metrics.csv")) as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("slsam/active_ratio")]
    assert len(rows) == 8
    for row in rows:
        ratio = float(row["slsam/active_ratio"])
        per_pass = float(row["slsam/active_ratio_pass1"])
        assert ratio == pytest.approx(2 * per_pass)
        assert 0 < per_pass <= 1
        assert 1 <= float(row["slsam/active_layers"]) <= 6
        assert 0 < float(row["slsam/entropy"]) <= 1
        assert float(row["slsam/backward_passes"]) == 2
    mean = sum(float(r["slsam/active_ratio"]) for r in rows) / len(rows)
    assert cb.mean_active_ratio == pytest.approx(mean, rel=1e-5)

    assert cb.frequency_csv_path == os.path.join(logger.log_dir, "slsam_layer_frequency.csv")
    with open(cb.frequency_csv_path) as handle:
        table = list(csv.DictReader(handle))
    assert [r["layer"] for r in table] == cb.layer_names
    assert [int(r["activations"]) for r in table] == cb.engine.counts.tolist()
    assert sum(int(r["activations"]) for r in table) == sum(
        float(r["slsam/active_layers"]) for r in rows
    )
    assert os.path.getsize(cb.frequency_plot_path) > 10_000  # a real PNG chart


def test_normalized_entropy_bounds():
    assert normalized_entropy(torch.full((7,), 0.2)) == pytest.approx(1.0)
    concentrated = torch.tensor([1.0, 1e-3, 1e-3, 1e-3])
    assert normalized_entropy(concentrated) < 0.05


def test_engine_records_each_layers_mean_first_pass_norm(tmp_path):
    net = make_mlp()
    engine = SparseLayerSAM(layer_ratio=0.5, seed=0).spec.build_engine(net)
    x, y = make_data(16).tensors
    opt = torch.optim.SGD(net.parameters(), lr=0.0)  # weights fixed: norms are reproducible
    reference = []
    for p in net.parameters():
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
        reference.append(float(p.grad.norm()))
    for _ in range(30):
        engine.train_step(lambda: F.cross_entropy(net(x), y), opt)
    # With lr 0 every measurement of a layer is the same: the dense gradient's norm.
    torch.testing.assert_close(
        engine.mean_norms(), torch.tensor(reference, dtype=torch.float64), rtol=1e-5, atol=1e-7
    )
    assert int(engine.norm_counts.sum()) == int(engine.counts.sum())
    path = write_layer_frequency_csv(
        str(tmp_path / "f.csv"), engine.partition.names, engine.partition.numel,
        engine.counts, engine.num_steps, engine.selection.probs, engine.mean_norms(),
    )  # fmt: skip
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    assert float(rows[0]["mean_grad_norm"]) == pytest.approx(reference[0], rel=1e-5)


# -- the per-layer chart -------------------------------------------------------------------


@pytest.fixture
def saved_figures(monkeypatch):
    """The figures saved while the test runs (the chart functions save and let go of them)."""
    from matplotlib.figure import Figure

    figures, save = [], Figure.savefig

    def savefig(self, *args, **kwargs):
        figures.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def lora_names(blocks: int) -> list[str]:
    """The trainable tensors of PEFT's LoRA on a BERT's query and value projections."""
    return [
        f"base_model.model.bert.encoder.layer.{i}.attention.self.{m}.lora_{ab}.default.weight"
        for i in range(blocks) for m in ("query", "value") for ab in "AB"
    ]  # fmt: skip


def long_names(count: int, length: int = 120) -> list[str]:
    """``count`` tensor names of a deep model, six a block, the longest of ``length``
    characters (at least 90)."""
    module = "attention_" + "x" * (length - 90)  # a long module name that all share
    return [
        f"model.backbone.encoder.stage_{i // 48}.blocks.{i // 6}.{module}.in_projection"
        f".{('query', 'key', 'value')[i // 2 % 3]}_projection.{('weight', 'bias')[i % 2]}"
        for i in range(count)
    ]


def draw_chart(path, names, seed=0, fixed=()):
    gen = torch.Generator().manual_seed(seed)
    n = len(names)
    counts = torch.randint(0, 41, (n,), generator=gen)
    probs = torch.rand(n, generator=gen, dtype=torch.float64) * 0.4
    return plot_layer_frequency(str(path), names, counts, 40, probs, 0.2, fixed=fixed)


def boxes_overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


CHARTS = {
    "10 layers, 120 characters": long_names(10),
    "PEFT LoRA on a 6-block BERT": lora_names(6),
    "60 layers, 110 characters": long_names(60, 110),
    "150 layers": long_names(150),
    "500 layers, 120 characters": long_names(500),
    "500 names differing only in their middle": [
        f"{'x' * 55}{i:04d}{'y' * 61}" for i in range(500)
    ],
}


@pytest.mark.parametrize("names", CHARTS.values(), ids=CHARTS.keys())
def test_layer_chart_lays_out_long_names_without_a_warning(tmp_path, saved_figures, names):
    fixed = [("classifier.modules_to_save.default.weight", 768, "always_active"),
             ("embeddings.word_embeddings.weight", 10, "always_frozen")]  # fmt: skip
    total = len(names) + len(fixed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's layout warnings fail the test
        draw_chart(tmp_path / "chart.png", names, fixed=fixed)
        (fig,) = saved_figures
    # Boxes measured as laid out when saved (in figure fractions: the same at any dpi).
    renderer = FigureCanvasAgg(fig).get_renderer()
    ax_bar, ax_hist = fig.axes
    ticks = [t for t in ax_bar.get_xticklabels() if t.get_text()]
    texts = [t.get_text() for t in ticks]
    # Every layer is named up to 100 layers; past that every k-th, still 60 names or more.
    assert len(ticks) == total if total <= 100 else len(ticks) >= 60
    positions = [round(t.get_position()[0]) for t in ticks]
    assert positions[0] == 0 and len(set(a - b for a, b in zip(positions[1:], positions))) == 1
    assert len(set(texts)) == len(texts) and max(map(len, texts)) <= LABEL_WIDTH
    assert min(t.get_fontsize() for t in ticks) >= 7
    # Nothing leaves the figure; no label covers another; the legend covers no panel.
    inside = fig.bbox.padded(1)
    boxes = [t.get_window_extent(renderer) for t in ticks]
    assert all(inside.contains(b.x0, b.y0) and inside.contains(b.x1, b.y1) for b in boxes)
    assert not any(boxes_overlap(a, b) for a, b in itertools.pairwise(boxes))
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    assert inside.contains(box.x0, box.y0) and inside.contains(box.x1, box.y1)
    panels = [ax.get_tightbbox(renderer) for ax in (ax_bar, ax_hist)]  # with all their text
    assert not any(boxes_overlap(box, panel) for panel in panels)
    assert not boxes_overlap(*panels)
    assert all(inside.contains(p.x0, p.y0) and inside.contains(p.x1, p.y1) for p in panels)
    width, height = fig.get_size_inches()
    assert 10 <= width <= 22 and height <= 9


def test_layer_chart_grows_with_the_layers_up_to_a_cap():
    widths = []
    for count in (10, 60, 150, 500):
        names, probs = long_names(count), torch.full((count,), 0.2, dtype=torch.float64)
        fig = layer_frequency_figure(names, torch.zeros(count), 10, probs, 0.2)
        widths.append(fig.get_size_inches()[0])
    assert widths[0] < widths[1] < widths[2] == widths[3] <= 22


def test_short_labels_are_distinct_and_short():
    cases = [
        long_names(500),
        lora_names(24),
        [f"{'x' * 55}{i:04d}{'y' * 61}" for i in range(500)],  # differing in their middle
        [f"a.{'b' * 40}{i}.c" for i in range(30)] + ["a.b.c", "a.c", "c"],
        ["weight", "bias"],
    ]
    for names in cases:
        for width in (12, 20, LABEL_WIDTH):
            labels = short_labels(names, width)
            assert len(labels) == len(names) == len(set(labels))
            assert max(map(len, labels)) <= width
    # The parts that tell the layers apart stay; those every name shares go.
    assert short_labels(lora_names(12))[4 * 3 + 1] == "layer.3.attention.self.query.lora_B"
    assert short_labels(lora_names(12), 24)[4 * 3 + 1] == "layer.3…query.lora_B"
    assert short_labels(["blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias"]) == [
        "weight", "bias",
    ]  # fmt: skip
    assert common_affixes(lora_names(2)) == ("base_model.model.bert.encoder.", ".default.weight")


def test_short_labels_keep_short_names_and_leave_out_only_the_shared_affixes():
    # (the examples short_labels' docstring held before it was shortened)
    names = [f"base_model.model.bert.encoder.layer.{i}.attention.self.{m}.lora_{ab}.default.weight"
             for i in (0, 1) for m in ("query", "value") for ab in "AB"]  # fmt: skip
    assert short_labels(["0.weight", "0.bias", "2.weight"]) == ["0.weight", "0.bias", "2.weight"]
    head = "base_model.model.classifier.modules_to_save.default.weight"
    assert short_labels([*names[:2], head], shared=names) == [
        "layer.0.attention.self.query.lora_A", "layer.0.attention.self.query.lora_B",
        "\u2026classifier.modules_to_save\u2026weight",
    ]  # fmt: skip
    assert short_labels(["a" * 40 + "x", "a" * 40 + "y"], width=12) == [
        "aaa\u2026aaaaaaax", "aaa\u2026aaaaaaay",
    ]  # fmt: skip


def test_ratio_line_is_labelled_with_the_users_layer_ratio(tmp_path, saved_figures):
    """The default preset budgets parameters: the mean draw probability is not layer_ratio,
    and the legend says so; under preset="paper" the line is layer_ratio itself."""
    lines = {}
    for preset in ("default", "paper"):
        cb = SparseLayerSAM(layer_ratio=0.5, preset=preset, seed=0)
        t = trainer(callbacks=[cb], max_epochs=1, default_root_dir=tmp_path / preset)
        t.fit(LitModel(make_mlp()), loader(make_data(64), 16))
        ax_bar = saved_figures[-1].axes[0]
        (line,) = [h for h in ax_bar.get_lines() if h.get_linestyle() == "--"]
        lines[preset] = (line.get_ydata()[0], line.get_label(), cb.engine.selection.probs)
    mean, label, probs = lines["default"]
    assert mean == pytest.approx(float(probs.mean())) and mean != pytest.approx(0.5, abs=5e-4)
    assert (
        label
        == f"mean draw probability {mean:.3g} (layer_ratio 0.5 is a fraction of the parameters)"
    )
    mean, label, _ = lines["paper"]
    assert mean == pytest.approx(0.5) and label == "layer_ratio 0.5 (= mean draw probability)"


def test_ratio_label_without_a_layer_ratio_or_budget():
    assert ratio_label(torch.ones(4), None) == "mean draw probability 1"
    probs = torch.tensor([0.2, 0.3])
    assert ratio_label(probs, 0.2) == "mean draw probability 0.25 (layer_ratio 0.2)"
    assert ratio_label(probs, 0.25, numel=[10, 10]) == "layer_ratio 0.25 (= mean draw probability)"
