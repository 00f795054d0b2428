"""The short-fine-tune comparison script's variant table (examples/scripts/compare_short_runs.sh),
which the step-time benchmark reads too: every label builds the configuration it names."""

from __future__ import annotations

import os
import sys

import pytest

from lightning_slsam import make_callback
from lightning_slsam.lightning.callbacks import METHODS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import short_runs_time  # noqa: E402

VARIANTS = short_runs_time.script_variants()
#: The script's SL-SAM variants are examples/methods.py's slsam_ablation.
pytestmark = pytest.mark.usefixtures("example_methods")
#: What a configuration trains: the preset settings of SL-SAM and Random-SL-SAM.
SETTINGS = ("budget", "bandit_loss", "alpha_p", "head_always_active")


def trains(callback) -> dict:
    """The settings ``callback`` trains with (whatever option or preset chose them)."""
    spec = callback.spec
    found = {"update_scale": spec.update_scale}
    for name in SETTINGS:
        try:
            found[name] = spec.setting(name)
        except (KeyError, AttributeError):
            continue
    return found


def test_the_table_has_every_remedy_alone_and_combined_beside_uniform_sampling():
    labels = set(VARIANTS)
    for remedy in ("rank", "head", "scale"):
        assert f"slsam_{remedy}" in labels
    assert "slsam_rank_head_scale" in labels
    # The same remedies on uniform sampling: the head rule and the update cap, without the
    # bandit's budget and loss.
    (method, options), (bandit, bandit_options) = (VARIANTS["random_head_cap3"],
                                                   VARIANTS["slsam_compute_cap3"])  # fmt: skip
    assert method == "random_slsam"
    control, bandit = make_callback(method, **options), make_callback(bandit, **bandit_options)
    for name in ("head_always_active", "update_scale"):
        assert trains(control)[name] == trains(bandit)[name], name


@pytest.mark.parametrize("label", sorted(VARIANTS))
def test_each_label_builds_its_options(label):
    method, options = VARIANTS[label]
    callback = make_callback(method, **options)
    for name, value in options.items():
        assert getattr(callback, name) == value, (label, name)


def test_the_robust_preset_is_the_row_the_docs_name():
    # The former "robust" preset trains as this entry, which is this row.
    method, options = VARIANTS["slsam_rank_head_scale"]
    upgraded = {"class_path": "examples.methods.SLSAMAblation", "init_args": {
        "preset": "paper", "bandit_loss": "rank", "alpha_p": 0.03, "head_always_active": True,
        "max_update_scale": 5.0}}  # fmt: skip
    name = upgraded["class_path"].rpartition(".")[2]
    (cls,) = {c for c, _ in METHODS.values() if c is not None and c.__name__ == name}
    assert method == "slsam_ablation" and METHODS[method][0] is cls
    assert trains(make_callback(method, **options)) == trains(cls(**upgraded["init_args"]))


def test_a_task_run_reports_step_time_and_memory_against_adamw_and_sam():
    # 6 steps of the MLP benefit task, interleaved; each configuration's memory in a process
    # of its own (memory.py --task): SAF's steps read the logits and the samples' indices.
    results = short_runs_time.measure(["mlp_noisy"], ["adamw", "sam", "saf"], limit=6)
    short_runs_time.add_memory(results, steps=2)
    (result,) = results
    rows = result["configs"]
    assert rows["adamw"]["ratio_to_adamw"] == 1.0 and rows["sam"]["ratio_to_sam"] == 1.0
    for row in rows.values():
        assert row["ratio_to_adamw"] == pytest.approx(
            row["ratio_to_sam"] * rows["sam"]["mean_step_s"] / rows["adamw"]["mean_step_s"]
        )
        assert row["training_mb"] > 0
    assert rows["sam"]["active_ratio"] == 2.0 and rows["saf"]["active_ratio"] == 1.0
    text = short_runs_time.render(results)
    header = "| configuration | mean step (s) | time / SAM | time / AdamW | active ratio"
    assert header + " | peak memory (MB) | memory / AdamW |" in text
    assert "| adamw | " in text and " | 1.000 | 1.000 | " in text.split("| adamw | ")[1][:40]
