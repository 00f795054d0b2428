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
    ],
)
def test_the_timer_refuses_a_run_without_a_full_summary(output):
    with pytest.raises(ValueError):
        demo_time.parse(output)
