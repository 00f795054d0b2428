"""The short-fine-tune comparison script's variant table (examples/scripts/compare_short_runs.sh),
which the step-time benchmark reads too: every label builds the configuration it names."""

from __future__ import annotations

import os
import sys

import pytest

from lightning_slsam import make_callback
from lightning_slsam.lightning.callbacks import PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import short_runs_time  # noqa: E402

VARIANTS = short_runs_time.script_variants()


def test_the_table_has_every_remedy_alone_and_combined_beside_uniform_sampling():
    labels = set(VARIANTS)
    for remedy in ("rank", "warmup", "head", "scale"):
        assert f"slsam_{remedy}" in labels
    for combined in ("rank_warmup_head_scale", "rank_head_scale", "rank_warmup_head"):
        assert f"slsam_{combined}" in labels
        # The same remedies on uniform sampling: the rank loss is the bandit's, so it goes.
        control = f"random_{combined.removeprefix('rank_')}"
        assert VARIANTS[control][0] == "random_slsam"
        options = dict(VARIANTS[f"slsam_{combined}"][1])
        options.pop("bandit_loss")
        assert VARIANTS[control][1] == options


@pytest.mark.parametrize("label", sorted(VARIANTS))
def test_each_label_builds_its_options(label):
    method, options = VARIANTS[label]
    callback = make_callback(method, **options)
    for name, value in options.items():
        assert getattr(callback, name) == value, (label, name)


def test_the_robust_preset_is_the_row_the_docs_name():
    method, options = VARIANTS["slsam_rank_head_scale"]
    robust = {k: v for k, v in PRESETS["robust"].items() if PRESETS["paper"][k] != v}
    assert method == "slsam" and options == robust
