"""examples/hf_trainer.py: MiniLM through SAMTrainer, full fine-tuning and LoRA, with its
checkpoints resumable."""

from __future__ import annotations

import importlib.util
import math
import os

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples",
                       "hf_trainer.py")  # fmt: skip


def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_trains_minilm_in_full_and_with_lora_and_resumes(tmp_path):
    example = _example()
    common = ["--steps", "4", "--num-train", "64", "--num-val", "32", "--batch-size", "8",
              "--save-steps", "2"]  # fmt: skip
    full = example.main([*common, "--out", str(tmp_path / "full")])
    lora = example.main([*common, "--lora", "--out", str(tmp_path / "lora")])
    assert full["steps"] == lora["steps"] == 4
    assert 0 <= full["val_accuracy"] <= 1 and 0 <= lora["val_accuracy"] <= 1
    assert 0 < full["mean_active_ratio"] < 2 and 0 < lora["mean_active_ratio"] < 2
    # LoRA r=8 on the query and value projections, plus the classification head.
    assert lora["trainable_parameters"] < 0.01 * full["trainable_parameters"]
    for run in ("full", "lora"):
        assert (tmp_path / run / "checkpoint-2" / "slsam_state.pt").is_file()
    resumed = example.main([*common, "--steps", "6", "--out", str(tmp_path / "full"),
                            "--resume", str(tmp_path / "full" / "checkpoint-4")])  # fmt: skip
    assert resumed["steps"] == 6


def test_the_example_logs_the_mean_loss_of_an_accumulated_step(tmp_path):
    """Under --accumulate 2 the logged loss is a mean over the step's micro-batches, near
    ln 2 for two classes at the start, not the sum of their means (2 ln 2)."""
    run = _example().main(["--steps", "10", "--accumulate", "2", "--num-train", "160",
                           "--num-val", "32", "--batch-size", "8", "--save-steps", "100",
                           "--out", str(tmp_path)])  # fmt: skip
    assert run["steps"] == 10
    assert run["logged_loss"][10] < math.log(2) + 0.05, run["logged_loss"]
