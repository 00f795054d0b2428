"""What ``lightning-slsam fit`` prints, as a user's terminal shows it (stdout and stderr
of the command run in a process of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_fit_prints_the_run_summary_once(tmp_path):
    # The method's end-of-fit line and the command's run summary said the same (the mean
    # active ratio, the chart) one after the other: the command prints its summary only.
    run = tmp_path / "run.yaml"
    run.write_text(
        "model: {class_path: test_cli_errors.ScalarLossModel}\n"
        "data: {class_path: test_cli_errors.Blobs}\n"
        "trainer:\n  max_steps: 3\n  logger: false\n  enable_checkpointing: false\n"
        "  enable_model_summary: false\n"
        f"  default_root_dir: {tmp_path / 'root'}\n"
        "  callbacks:\n    - class_path: lightning_slsam.SparseLayerSAM\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "lightning_slsam.cli", "fit", "--config", str(run)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    shown = done.stdout + done.stderr
    assert done.returncode == 0, shown[-3000:]
    assert shown.count("Run summary (SparseLayerSAM, 3 steps)") == 1, shown[-3000:]
    assert shown.count("mean active ratio") == 1, shown[-3000:]
    assert shown.count("slsam_layer_frequency.png") == 1, shown[-3000:]
    # What only the method's line said is in the summary.
    assert "  8 sampled layers, " in done.stdout and " skipped steps" in done.stdout
