"""What ``lightning-slsam fit`` prints, as a user's terminal shows it (stdout and stderr
of the command run in a process of its own)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def _fit(
    tmp_path: Path,
    *extra: str,
    terminal: bool = False,
    method: str = "SparseLayerSAM",
    model: str = "ScalarLossModel",
) -> subprocess.CompletedProcess:
    """``lightning-slsam fit`` of a 3-step run of ``method``, stdout and stderr in one
    stream, unbuffered, as a terminal shows them (``terminal``: written to a pseudo-terminal,
    where the progress bar redraws itself)."""
    run = tmp_path / "run.yaml"
    run.write_text(
        f"model: {{class_path: test_cli_errors.{model}}}\n"
        "data: {class_path: test_cli_errors.Blobs}\n"
        "trainer:\n  max_steps: 3\n  logger: false\n  enable_checkpointing: false\n"
        "  enable_model_summary: false\n"
        f"  default_root_dir: {tmp_path / 'root'}\n"
        f"  callbacks:\n    - class_path: lightning_slsam.{method}\n"
    )
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "lightning_slsam.cli", "fit", "--config", str(run), *extra]
    if terminal:
        return _on_a_terminal(command, tmp_path, env)
    return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          cwd=tmp_path, env=env, timeout=600)  # fmt: skip


def _on_a_terminal(command: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """Run ``command`` with a pseudo-terminal as its stdout and stderr; what it shows."""
    pty = pytest.importorskip("pty")
    controller, terminal = pty.openpty()
    process = subprocess.Popen(command, stdout=terminal, stderr=terminal, cwd=cwd, env=env)
    os.close(terminal)
    shown = []
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        shown.append(chunk)
    os.close(controller)
    code = process.wait(timeout=600)
    return subprocess.CompletedProcess(command, code, b"".join(shown).decode(errors="replace"))


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
def test_the_coverage_warning_precedes_the_progress_bar_and_ends_the_summary(tmp_path, terminal):
    done = _fit(tmp_path, terminal=terminal)
    assert done.returncode == 0, done.stdout[-3000:]
    said = "SparseLayerSAM: each sampled layer can expect about"
    pieces = [p for line in done.stdout.split("\n") for p in line.split("\r")]
    warned = [p for p in pieces if said in p]
    # Once as the warning, on a line of its own (no progress bar on it); once in the summary.
    assert len(warned) == 2, done.stdout[-3000:]
    assert not any(word in warned[0] for word in ("Epoch", "it/s", "%|")), warned[0]
    assert re.fullmatch(rf"\S*callback\.py:\d+: {said}.*", warned[0]), warned[0]
    assert warned[1].startswith(f"  warning: {said}"), warned[1]
    progress = re.search(r"Epoch" if terminal else r"\nstep 1/3", done.stdout)
    assert progress is not None and done.stdout.index(said) < progress.start()


def test_the_summary_gives_a_forgetting_monitors_first_and_last_measurement():
    import types

    import torch

    from lightning_slsam import ForgettingMonitor
    from lightning_slsam.cli.command import _forgetting_lines

    monitor = ForgettingMonitor([torch.zeros(2, 8, dtype=torch.long)], every_n_steps=2)
    start = {"loss": 4.78, "accuracy": 0.130, "kl": 0.0, "tokens": 14}
    end = {"loss": 5.33, "accuracy": 0.101, "kl": 2.68, "tokens": 14}
    monitor.history = [(0, start), (454, end)]
    lines = _forgetting_lines(types.SimpleNamespace(callbacks=[monitor]))
    assert lines == ["  forgetting (ForgettingMonitor, reference text): loss 4.780 -> 5.330"
                     " (+0.550 nats), accuracy 0.130 -> 0.101, KL from the start 2.680 at step"
                     " 454"]  # fmt: skip


def test_the_summary_says_which_limit_cut_a_run_short(tmp_path):
    # Lightning closes a run stopped by max_time with "`max_epochs` reached"; the summary
    # says which limit ended it and at which step of the planned ones.
    done = _fit(tmp_path, "--trainer.max_steps=10", "--trainer.max_time=00:00:00:00")
    assert done.returncode == 0, done.stdout[-3000:]
    # A zero limit stops it before the first step (Lightning checks at the start too).
    summary = done.stdout[done.stdout.index("Run summary (SparseLayerSAM, 0 steps)") :]
    assert "mean active ratio: n/a (no step ran) (SAM" in summary, summary
    said = r"stopped at step 0 of 10: max_time ran out \(\d+ s of training\); the metrics"
    assert re.search(rf"\n  {said} below are those of a shortened run\n", summary), summary


def test_a_run_of_its_planned_length_says_nothing_about_stopping(tmp_path):
    done = _fit(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "Run summary (SparseLayerSAM, 3 steps)" in done.stdout
    assert "stopped at step" not in done.stdout


@pytest.mark.parametrize("method", ["SAM", "RST"])
def test_a_method_updating_every_layer_reports_no_sampled_layers_and_no_chart(tmp_path, method):
    done = _fit(tmp_path, method=method)
    assert done.returncode == 0, done.stdout[-3000:]
    summary = done.stdout[done.stdout.index(f"Run summary ({method}, 3 steps)") :]
    assert "mean active ratio: 2.000x" in summary or method == "RST", summary
    assert "sampled layers" not in summary and "per-layer chart" not in summary, summary
    assert "  0 skipped steps\n" in summary, summary
    assert not list((tmp_path / "root").rglob("slsam_layer_frequency*"))


#: A plain progress line: the step of the planned ones, the epoch, the time, the rate, the
#: time left, the progress bar's metrics.
PROGRESS_LINE = re.compile(
    r"step (\d+)/40 \((\d+)%\), epoch \d+, \d+:\d\d elapsed, [\d.]+ (steps/s|s/step),"
    r" \d+:\d\d left, train_loss [\d.]+, sl_layers \d+, sl_ratio [\d.]+, sl_entropy [\d.]+"
)


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
def test_output_that_is_not_a_terminal_gets_progress_lines(tmp_path, terminal):
    # Piped (a log file, nohup, CI), Rich's bar drew nothing until the end: a line every 10%
    # of the run and after each validation instead. On a terminal the bar stays.
    done = _fit(tmp_path, "--trainer.max_steps=40", terminal=terminal, model="LoggedLossModel")
    assert done.returncode == 0, done.stdout[-3000:]
    shown = done.stdout.replace("\r", "\n").split("\n")
    lines = [m for m in map(PROGRESS_LINE.fullmatch, shown) if m]
    validations = [t for t in shown if re.fullmatch(r"validation at step \d+: val_loss [\d.]+", t)]
    if terminal:
        assert lines == [] and validations == [] and "Epoch 9/" in done.stdout, done.stdout[-2000:]
        return
    steps = [int(m[1]) for m in lines]
    assert steps == list(range(4, 41, 4)), shown  # every 10%, the last at the end
    assert [int(m[2]) for m in lines] == list(range(10, 101, 10))
    assert len(validations) == 10  # Blobs: an epoch of 4 steps, validated at its end
    assert "Epoch" not in done.stdout and "\r" not in done.stdout


def test_a_line_comes_after_30_seconds_when_the_next_10_percent_is_further(monkeypatch):
    from helpers import LitModel, loader, make_data, make_mlp, trainer

    from lightning_slsam.cli import progress

    now = iter(range(0, 10_000, 10))  # 10 s a step on the monotonic clock
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(now))
    printed = []
    bar = progress.LineProgress(every=1.0, seconds=30.0)  # no 10% marks before the end
    monkeypatch.setattr(bar, "_print", printed.append)
    fit = trainer([bar], max_steps=10, enable_progress_bar=True)
    fit.fit(LitModel(make_mlp()), loader(make_data(64), 8))
    steps = [int(re.match(r"step (\d+)/10", line)[1]) for line in printed]
    assert steps == [3, 6, 9, 10], printed  # 30 s after the start, then after each line
    assert "0:30 elapsed, 0.1 steps/s" in printed[0] or "10 s/step" in printed[0], printed[0]
