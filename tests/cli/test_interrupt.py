"""A ``lightning-slsam fit`` ended by a signal: it says so in its summary, names its last
checkpoint (whole, loadable) and exits with ``128 + signal`` -- a real signal sent to the
command running in a process of its own."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_the_run_with_its_summary_a_whole_checkpoint_and_exit_128_plus_n(
    tmp_path, signum
):
    checkpoints = tmp_path / "ckpt"
    run = tmp_path / "run.yaml"
    run.write_text(
        "model: {class_path: test_cli_errors.LoggedLossModel}\n"
        "data: {class_path: test_cli_errors.Blobs}\n"
        "trainer:\n  max_steps: 100000\n  logger: false\n  enable_model_summary: false\n"
        f"  default_root_dir: {tmp_path / 'root'}\n"
        "  callbacks:\n    - class_path: lightning_slsam.SparseLayerSAM\n"
        "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        f"      init_args: {{dirpath: {checkpoints}, every_n_train_steps: 20, save_top_k: -1}}\n"
    )
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "lightning_slsam.cli", "fit", "--config", str(run)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, cwd=tmp_path, env=env)  # fmt: skip
    deadline = time.monotonic() + 300
    while len(list(checkpoints.glob("*.ckpt"))) < 2 and time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[0][-3000:]
        time.sleep(0.2)
    process.send_signal(signum)
    shown, _ = process.communicate(timeout=300)
    name = signal.Signals(signum).name
    assert process.returncode == 128 + signum, shown[-3000:]
    said = re.search(rf"\n  interrupted by {name} at step (\d+) of 100000; the metrics", shown)
    assert said is not None, shown[-3000:]
    last = re.search(r"\n  last checkpoint: (\S+)\n", shown)
    assert last is not None, shown[-3000:]
    newest = max(checkpoints.glob("*.ckpt"), key=os.path.getmtime)
    assert last[1] == str(newest)
    # The checkpoint is whole: it loads, with the method's state, at the step it names.
    saved = torch.load(newest, map_location="cpu", weights_only=False)
    step = int(re.search(r"step=(\d+)", newest.name)[1])
    assert saved["global_step"] == step <= int(said[1])
    assert "SparseLayerSAM" in saved["callbacks"]
    assert all(torch.isfinite(v).all() for v in saved["state_dict"].values())
