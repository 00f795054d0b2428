"""The command line as a new user meets it: help that needs no run, the options that help
lists, and every mistake reported as one line on stderr with exit code 2."""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import yaml
from helpers import make_data, make_mlp
from torch.utils.data import DataLoader

import lightning_slsam
from lightning_slsam import METHODS, SAMMixin
from lightning_slsam.cli.command import main

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:lightning.pytorch.cli")

ROOT = Path(__file__).resolve().parent.parent
MODULE = Path(__file__).stem  # this file, importable by class path (tests/ is on sys.path)


class ScalarLossModel(SAMMixin, L.LightningModule):
    """Returns the batch's mean loss (a scalar): enough for every method but ESAM."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_mlp()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class LoggedLossModel(ScalarLossModel):
    """Shows its training loss on the progress bar, as most models do."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, prog_bar=True)
        return loss


class Blobs(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(64), batch_size=16)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(make_data(32), batch_size=16)


@pytest.fixture
def run_yaml(tmp_path) -> str:
    """A run config of this file's model and data, with SL-SAM."""
    path = tmp_path / "run.yaml"
    path.write_text(
        f"model: {{class_path: {MODULE}.ScalarLossModel}}\n"
        f"data: {{class_path: {MODULE}.Blobs}}\n"
        "trainer:\n  max_steps: 2\n  logger: false\n  enable_checkpointing: false\n"
        "  enable_progress_bar: false\n  enable_model_summary: false\n"
        "  callbacks:\n    - class_path: lightning_slsam.SparseLayerSAM\n"
    )
    return str(path)


def command(capsys, *args: str) -> tuple[int, str, str]:
    """Run ``lightning-slsam ARGS`` in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as done:
        main(list(args))
        raise SystemExit(0)
    out = capsys.readouterr()
    return int(done.value.code or 0), out.out, out.err


def one_error_line(err: str) -> str:
    """The error line; asserts it is the only one from the command (no traceback, no usage
    dump) -- Lightning's own info lines, when a fit had started, aside."""
    assert "Traceback" not in err and "usage:" not in err, err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("lightning-slsam: error:")]
    assert len(ours) == 1, err[-3000:]
    return ours[0]


# -- help needs no run ------------------------------------------------------------------
def test_one_methods_options_are_listed_without_a_run(capsys):
    code, out, err = command(capsys, "fit", "--trainer.callbacks.help",
                             "lightning_slsam.SparseLayerSAM")  # fmt: skip
    assert code == 0, err
    for option in ("layer_ratio", "preset", "p_min", "gradient_clip_val"):
        assert f"--trainer.callbacks.{option}" in out
    assert "needs a run" not in err


def test_fit_help_ends_with_the_method_classes_and_how_to_see_their_options(capsys):
    from lightning_slsam.lightning.callbacks import class_path

    code, out, _ = command(capsys, "fit", "--help")
    assert code == 0
    epilog = " ".join(out[out.index("SAM methods are callbacks") :].split())
    for cls, _ in METHODS.values():
        if cls is not None:
            assert class_path(cls) in epilog
    assert "--trainer.callbacks.help lightning_slsam.SparseLayerSAM" in epilog
    # The API page says the same: fit --help lists the classes, callbacks.help the options.
    api = " ".join((ROOT / "docs" / "api.md").read_text().split())
    assert "lightning-slsam fit --trainer.callbacks.help lightning_slsam.SparseLayerSAM" in api
    assert "`lightning-slsam fit --help` list all of them" not in api


def test_every_class_path_fit_help_lists_is_importable(capsys):
    from lightning_slsam.cli.checks import resolve_callback

    code, out, _ = command(capsys, "fit", "--help")
    assert code == 0
    epilog = " ".join(out[out.index("SAM methods are callbacks") :].split())
    listed = epilog[epilog.index("Classes: ") + len("Classes: ") : epilog.index(". To list")]
    paths = [path.strip() for path in listed.split(",")]
    assert len(paths) == len({cls for cls, _ in METHODS.values() if cls is not None})
    assert [path for path in paths if resolve_callback(path) is None] == []


def test_compare_help_names_the_methods_and_every_default(capsys):
    from examples.compare import main as compare

    with pytest.raises(SystemExit) as done:
        compare(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    text = " ".join(out[out.index("options:") :].split())  # past the usage lines
    methods = text[text.index("--methods METHODS") : text.index("--variant LABEL")]
    for name in METHODS:
        assert re.search(rf"\b{name}\b", methods), name
    for option, default in (("--seeds SEEDS", "3"), ("--monitor MONITOR", "val_acc"),
                            ("--mode {max,min}", "max"), ("--out OUT", "runs/compare"),
                            ("--methods METHODS", "adamw,sam,slsam_paper,slsam")):  # fmt: skip
        help_text = text[text.index(option) + len(option) :][:200]
        assert f"(default: {default})" in help_text, (option, help_text)


# -- one line, exit code 2 --------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--trainer.gradient_clip_val=1.0"],
         ["trainer.gradient_clip_val=1.0 cannot be used with SparseLayerSAM",
          "`gradient_clip_val: 1.0`", "trainer.callbacks[0] (SparseLayerSAM) init_args",
          "--trainer.callbacks.gradient_clip_val=1.0"]),
        (["--trainer.accumulate_grad_batches=4"],
         ["trainer.accumulate_grad_batches=4 cannot be used with SparseLayerSAM",
          "`accumulate_grad_batches: 4`", "--trainer.callbacks.accumulate_grad_batches=4"]),
        (["--trainer.callbacks+=lightning_slsam.SparseLayerSam"],
         ["class 'lightning_slsam.SparseLayerSam' not found",
          "did you mean 'lightning_slsam.SparseLayerSAM'?"]),
        (["--trainer.max_stpes=3"],
         ["unrecognized argument(s) --trainer.max_stpes=3", "did you mean --trainer.max_steps?"]),
        (["--trainer.max_epochs=abc"], ["trainer.max_epochs: expected int or None, got 'abc'"]),
        (["--trainer.callbacks+=lightning_slsam.SparseLayerSAM"],
         ["2 SAM callbacks ([0] SparseLayerSAM, [1] SparseLayerSAM)", "keep exactly one"]),
        (["--trainer.callbacks+=lightning_slsam.SAM"],
         ["2 SAM callbacks ([0] SparseLayerSAM, [1] SAM)", "keep exactly one"]),
    ],
)  # fmt: skip
def test_mistakes_are_one_line_with_exit_code_2(capsys, run_yaml, args, words):
    code, _, err = command(capsys, "fit", "--config", run_yaml, *args)
    assert code == 2
    line = one_error_line(err)
    for word in words:
        assert word in line, line


def test_esam_without_per_sample_losses_is_one_line_before_any_step(capsys, run_yaml):
    code, _, err = command(capsys, "fit", "--config", run_yaml,
                           "--trainer.callbacks=lightning_slsam.ESAM")  # fmt: skip
    assert code == 2
    line = one_error_line(err)
    assert "needs per-sample losses" in line and "reduction='none'" in line
    assert "data_ratio=1.0" in line


def test_a_debug_run_keeps_the_traceback(capsys, run_yaml, monkeypatch):
    # With JSONARGPARSE_DEBUG=true, a refusal at setup raises as it would in Python.
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    monkeypatch.setenv("JSONARGPARSE_DEBUG", "true")
    with pytest.raises(MisconfigurationException, match="per-sample losses"):
        main(["fit", "--config", run_yaml, "--trainer.callbacks=lightning_slsam.ESAM"])


# -- stacked configs ----------------------------------------------------------------------
def _callbacks_config(tmp_path, name: str, *entries: str) -> str:
    path = tmp_path / name
    path.write_text("trainer:\n  callbacks:\n" + "".join(f"    - {e}\n" for e in entries))
    return str(path)


MONITOR = "lightning.pytorch.callbacks.LearningRateMonitor"


def test_stacked_configs_add_their_callbacks_and_keep_one_method(capsys, run_yaml, tmp_path):
    """A method config stacked on a task config keeps the task's callbacks (jsonargparse
    alone keeps only the last file's list); a later SAM callback replaces the earlier one, and
    a later callback of a listed class replaces it."""
    task = _callbacks_config(tmp_path, "task.yaml", f"{{class_path: {MONITOR}}}")
    method = _callbacks_config(tmp_path, "method.yaml", "{class_path: lightning_slsam.ESAM}")
    step = f"{{class_path: {MONITOR}, init_args: {{logging_interval: step}}}}"
    again = _callbacks_config(tmp_path, "monitor.yaml", step)
    code, out, _ = command(capsys, "fit", "--config", run_yaml, "--config", task, "--config",
                           method, "--config", again, "--print_config")  # fmt: skip
    assert code == 0
    listed = yaml.safe_load(out)["trainer"]["callbacks"]
    assert [c["class_path"] for c in listed] == ["lightning_slsam.ESAM", MONITOR]
    assert listed[1]["init_args"]["logging_interval"] == "step"
    # A flag after the configs still sets the last callback of the combined list.
    code, out, _ = command(capsys, "fit", "--config", task, "--config", method,
                           "--trainer.callbacks.init_args.rho=0.2", "--print_config")  # fmt: skip
    assert code == 0
    assert yaml.safe_load(out)["trainer"]["callbacks"][1]["init_args"]["rho"] == 0.2


def test_an_option_of_another_callback_says_how_to_reach_it(capsys, run_yaml, tmp_path):
    task = _callbacks_config(tmp_path, "task.yaml", f"{{class_path: {MONITOR}}}")
    code, _, err = command(capsys, "fit", "--config", task, "--config", run_yaml,
                           "--trainer.callbacks.init_args.logging_interval=step")  # fmt: skip
    assert code == 2
    line = one_error_line(err)
    for word in ("SparseLayerSAM has no option 'logging_interval'",
                 "sets the last callback of trainer.callbacks",
                 "a later config's callback replaces one of the same class",
                 "Stacked configs"):  # fmt: skip
        assert word in line, line


def test_one_config_with_callbacks_is_passed_on_as_it_is(run_yaml):
    from lightning_slsam.cli.checks import stack_callbacks

    args = ["fit", "--config", run_yaml, "--trainer.max_steps=3"]
    assert stack_callbacks(args) == args


def test_a_config_of_an_earlier_version_names_this_version_and_the_changelog(tmp_path, capsys):
    # 0.2 saved `dense_warmup` into every SparseLayerSAM entry; before 1.0 nothing upgrades it.
    path = tmp_path / "saved.yaml"
    path.write_text(
        f"model: {{class_path: {MODULE}.ScalarLossModel}}\n"
        f"data: {{class_path: {MODULE}.Blobs}}\n"
        "trainer:\n  max_steps: 2\n  logger: false\n  enable_checkpointing: false\n"
        "  callbacks:\n    - class_path: lightning_slsam.SparseLayerSAM\n"
        "      init_args: {rho: 0.05, dense_warmup: 0.0}\n"
    )
    code, _, err = command(capsys, "fit", "--config", str(path))
    line = one_error_line(err)
    assert code == 2
    assert f"{path}: trainer.callbacks[0]: SparseLayerSAM has no option 'dense_warmup'" in line
    assert f"lightning-slsam {lightning_slsam.__version__} does not read its options" in line
    assert line.endswith("docs/changelog.md says what replaced them.")
