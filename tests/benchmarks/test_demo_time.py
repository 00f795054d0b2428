"""The demo timer (benchmarks/demo_time.py) reads the run summary the demo prints, and
refuses a run that a limit cut short."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import demo_time  # noqa: E402

SUMMARY = """Epoch 1: 100%|##########| 227/227 [02:31<00:00]

Run summary (SparseLayerSAM, 454 steps)
  final val_acc: 0.8133 (validated at step 453)
  final val_loss: 0.4301 (validated at step 453)
  SparseLayerSAM mean active ratio: 0.654x over the passes (SAM: 2.0x, AdamW: 1.0x)
"""


def test_the_timer_reads_the_demos_summary():
    assert demo_time.parse(SUMMARY) == {
        "method": "SparseLayerSAM", "steps": 454, "val_acc": 0.8133, "validated_at": 453,
    }  # fmt: skip


@pytest.mark.parametrize(
    "output",
    [
        "Epoch 0: 10%",
        SUMMARY.replace(
            "454 steps)\n",
            "350 steps)\n  stopped at step 350 of 454: max_time ran out (420 s of training);"
            " the metrics below are those of a shortened run\n",
        ),
        SUMMARY.replace(
            "454 steps)\n", "350 steps)\n  interrupted by SIGTERM at step 350 of 454\n"
        ),
    ],
)
def test_the_timer_refuses_a_run_without_a_full_summary(output):
    with pytest.raises(ValueError):
        demo_time.parse(output)


def test_the_table_has_a_row_per_setting_and_each_profiles_phases():
    setting = {"processor": "cpu", "kernels": "avx2", "torch_threads": 1}
    run = {**setting, "cpus": 2, "steps": 227, "val_acc": 0.81, "validated_at": 226,
           "seconds": 262.0, "date": "2026-12-01"}  # fmt: skip
    profile = {**setting, "startup_s": 4.9, "step_s": 1.09, "validation_s": 8.9,
               "operators": [["aten::addmm", 0.495]]}  # fmt: skip
    text = demo_time.table({"runs": [run], "profiles": [profile]})
    assert "| cpu | 2 | avx2 | 1 | 227 | 0.8100 (226) | 262 s (4.4 min) | 2026-12-01 |" in text
    assert "a training step: 1.09 s" in text and "| `aten::addmm` | 49.5% |" in text
    assert demo_time.environment("avx2", 1) == {
        "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1",
    }  # fmt: skip
