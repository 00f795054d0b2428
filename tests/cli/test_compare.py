"""`python -m examples.compare`: runs each method and seed, then tabulates and plots them."""

from __future__ import annotations

import json
import os

import pytest

from examples.compare import main as compare_main
from lightning_slsam.cli.command import main

TASK = os.path.join(
    os.path.dirname(__file__),
    os.pardir,
    os.pardir,
    "examples",
    "configs",
    "tasks",
    "minilm_rotten_tomatoes.yaml",
)
TINY = [
    "--model.init_args.pretrained=false", "--data.init_args.num_train=128",
    "--data.init_args.num_val=32", "--trainer.max_steps=4", "--trainer.val_check_interval=2",
    "--trainer.max_epochs=1",
]  # fmt: skip


def test_compare_runs_every_method_and_seed_interleaved_resumes_and_writes_the_table(
    tmp_path, capsys
):
    # One comparison (6 runs, each a process of its own): AdamW, SL-SAM and a variant of it
    # (the paper's preset; the variant of the ablation class: the next test).
    out = tmp_path / "cmp"
    args = ["--config", TASK, "--methods", "adamw,slsam,paper", "--seeds", "2",
            "--variant", "paper=slsam", "--option", "paper.preset=paper",
            "--option", "paper.layer_ratio=0.5", "--out", str(out), "--", *TINY]  # fmt: skip
    compare_main(args)
    printed = capsys.readouterr().out
    assert "comparison.md" in printed and "(kept)" not in printed
    # Seed by seed, every method within a seed, with the run count.
    order = [line.split(": ", 1)[1] for line in printed.splitlines() if line.startswith("== run")]
    assert order[0] == "adamw, seed 42" and order[1].startswith("slsam, seed 42")
    assert order[2].startswith("paper, seed 42") and order[3].startswith("adamw, seed 43")
    assert "== run 6/6" in printed
    # From the second run on, the time left is estimated.
    assert "min left" not in order[0] and all("min left" in o for o in order[1:])
    result = json.loads((out / "comparison.json").read_text())
    rows, runs = result["rows"], result["runs"]
    assert set(rows) == {"adamw", "slsam", "paper"}
    assert [len(runs[m]) for m in ("adamw", "slsam", "paper")] == [2, 2, 2]
    for method in ("adamw", "slsam"):
        for run in runs[method]:
            assert run["global_step"] == 4 and len(run["values"]) == 2
            assert 0 <= run["best"] <= 1 and run["peak_memory_mb"] > 0
    assert rows["adamw"]["active_ratio"] == 1.0
    assert 0 < rows["slsam"]["active_ratio"] < 2.0
    assert rows["slsam"]["seeds"] == 2
    # The variant: its own options, and the selection's statistics.
    paper = runs["paper"][0]
    config = (out / "configs" / "paper_seed42.yaml").read_text()
    assert "preset: paper" in config and "lightning_slsam.SparseLayerSAM" in config
    assert len(paper["entropy"]) == 4 and len(paper["floor_layers"]) == 4
    assert -1 <= paper["spearman_frequency_norm"] <= 1
    assert rows["paper"]["final_entropy"] == sum(r["entropy"][-1] for r in runs["paper"]) / 2
    table = (out / "comparison.md").read_text()
    assert "| adamw | 2 |" in table and "| slsam | 2 |" in table and "| paper | 2 |" in table
    assert "| Spearman | entropy | at floor |" in table
    assert (out / "accuracy_vs_active_ratio.png").stat().st_size > 5000
    assert (out / "selection_over_steps.png").stat().st_size > 5000
    assert (out / "layer_frequency.png").is_file()
    assert (out / "layer_frequency_paper.png").is_file()
    # --render re-tabulates the saved runs without training: the same table.
    (out / "comparison.md").unlink()

    again = compare_main(["--render", str(out)])
    assert (out / "comparison.md").read_text() == table
    assert json.loads(json.dumps(again["rows"])) == rows
    # --resume keeps every finished run with an unchanged configuration.
    compare_main([*args[: -len(TINY) - 1], "--resume", "--", *TINY])
    assert capsys.readouterr().out.count("(kept)") == 6
    # A run that fails (here: fit refuses an argument) leaves its finished run's
    # configuration as it was, so --resume still keeps all six.
    saved = (out / "configs" / "adamw_seed42.yaml").read_text()
    with pytest.raises(SystemExit, match="the adamw run with seed 42 failed"):
        compare_main([*args[: -len(TINY) - 1], "--", *TINY, "--trainer.no_such_option=1"])
    assert (out / "configs" / "adamw_seed42.yaml").read_text() == saved
    compare_main([*args[: -len(TINY) - 1], "--resume", "--", *TINY])
    assert capsys.readouterr().out.count("(kept)") == 6
    # compare's own option after `--` is refused before anything runs or is written.
    with pytest.raises(SystemExit) as refused:
        compare_main([*args[: -len(TINY) - 1], "--", *TINY, "--resume"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "--resume is an option of compare" in err and "put it before `--`" in err
    assert (out / "configs" / "adamw_seed42.yaml").read_text() == saved


def test_compare_runs_a_variant_of_the_ablation_class(tmp_path, capsys, example_methods):
    # A variant with SL-SAM's settings given alone (the results scripts' variants).
    from examples.compare import _method_config
    from lightning_slsam.cli.checks import resolve_callback

    ablation = {"preset": "paper", "bandit_loss": "rank", "alpha_p": 0.5}
    written = _method_config("ranked", 42, str(tmp_path), "val_acc", "max", ablation,
                             "slsam_ablation")["trainer"]["callbacks"][0]  # fmt: skip
    assert resolve_callback(written["class_path"]) is not None, written["class_path"]
    out = tmp_path / "cmp"
    compare_main(["--config", TASK, "--methods", "ranked", "--seeds", "1",
          "--variant", "ranked=slsam_ablation", "--option", "ranked.preset=paper",
          "--option", "ranked.bandit_loss=rank", "--option", "ranked.alpha_p=0.5",
          "--out", str(out), "--", *TINY])  # fmt: skip
    result = json.loads((out / "comparison.json").read_text())
    ranked = result["runs"]["ranked"][0]
    config = (out / "configs" / "ranked_seed42.yaml").read_text()
    assert "bandit_loss: rank" in config and "SLSAMAblation" in config
    assert len(ranked["entropy"]) == 4 and len(ranked["floor_layers"]) == 4
    assert ranked["entropy"][-1] < 1.0  # alpha 0.5: the distribution moved
    assert -1 <= ranked["spearman_frequency_norm"] <= 1
    assert "| ranked | 1 |" in (out / "comparison.md").read_text()
    assert (out / "layer_frequency_ranked.png").is_file()


def test_a_single_seed_shows_its_value_without_a_spread():
    from examples.report import render, summarize

    def record(best):
        return {"best": best, "final": best, "epoch_times": [1.0], "active_ratio": 2.0,
                "peak_memory_mb": 100.0}  # fmt: skip

    rows = summarize({"sam": [record(0.28125)], "slsam": [record(0.5), record(0.7)]})
    assert rows["sam"]["best"] == (0.28125, None)
    table = render(rows, "val_acc", "task.yaml")
    assert "| sam | 1 | 0.2812 | 0.2812 |" in table
    assert "| slsam | 2 | 0.6000 ± 0.1414 | 0.6000 ± 0.1414 |" in table


def test_compare_rejects_unknown_methods(tmp_path):
    with pytest.raises(SystemExit):
        compare_main(["--config", TASK, "--methods", "adamw,sgd", "--out", str(tmp_path)])


def test_compare_options_override_a_method_and_are_checked(tmp_path):
    from examples.compare import _method_config, _parse_options

    parser = __import__("argparse").ArgumentParser()
    # slsam_paper: the paper's SL-SAM, SparseLayerSAM with the preset its name implies.
    given = ["slsam_paper.layer_ratio=0.25", "slsam_paper.rho=0.05"]
    options = _parse_options(parser, given, ["slsam_paper"])
    assert options == {"slsam_paper": {"layer_ratio": 0.25, "rho": 0.05}}
    config = _method_config(
        "slsam_paper", 7, str(tmp_path), "val_score", "max", options["slsam_paper"]
    )
    callback = config["trainer"]["callbacks"][0]
    assert callback == {
        "class_path": "lightning_slsam.SparseLayerSAM",
        "init_args": {"preset": "paper", "layer_ratio": 0.25, "rho": 0.05},
    }
    assert config["seed_everything"] == 7
    for bad in ("slsam_paper.layer_ratio=3", "sam.rho=0.1", "slsam_paper=0.2",
                "slsam_paper.no_such=1"):  # fmt: skip
        with pytest.raises(SystemExit):
            _parse_options(parser, [bad], ["slsam_paper"])


def test_an_exponent_without_a_dot_is_the_number_it_reads():
    # YAML 1.1 reads "1e-8" as a string; the command line reads it as LightningCLI does.
    from examples.compare import _parse_options
    from lightning_slsam.cli.checks import command_line_value

    parser = __import__("argparse").ArgumentParser()
    options = _parse_options(parser, ["slsam.rho=1e-8", "slsam.preset=paper"], ["slsam"])
    assert options == {"slsam": {"rho": 1e-8, "preset": "paper"}}
    assert command_line_value("3E5") == 300000.0 and command_line_value("0.5") == 0.5
    assert command_line_value("1e-8x") == "1e-8x" and command_line_value("inf") == "inf"


def test_compare_rejects_bad_variants(tmp_path):
    for variant in ("slsam=sam", "x=nosuch", "=slsam", "a.b=slsam"):
        with pytest.raises(SystemExit):
            compare_main(["--config", TASK, "--methods", "slsam", "--variant", variant,
                  "--out", str(tmp_path)])  # fmt: skip


def test_the_default_methods_are_adamw_sam_and_both_sl_sam_configurations(capsys):
    # "slsam" is what SparseLayerSAM() runs; "slsam_paper" the paper's method.
    from lightning_slsam import METHODS, SparseLayerSAM

    with pytest.raises(SystemExit):
        compare_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    default = text[text.index("(default: ") + len("(default: ") :].split(")")[0].split(",")
    assert set(default) == {"adamw", "sam", "slsam_paper", "slsam"}
    assert METHODS["slsam"] == (SparseLayerSAM, {})
    assert METHODS["slsam_paper"] == (SparseLayerSAM, {"preset": "paper"})


@pytest.fixture
def task_with_sam(tmp_path):
    """A config stacked on the task that holds a SAM callback and another callback."""
    path = tmp_path / "with_sam.yaml"
    path.write_text(
        "trainer:\n  callbacks:\n"
        "    - class_path: lightning.pytorch.callbacks.LearningRateMonitor\n"
        "    - class_path: lightning_slsam.SparseLayerSAM\n      init_args: {layer_ratio: 0.5}\n"
    )
    return str(path)


def test_compare_says_what_each_method_does_with_the_configs_sam_callback(
    tmp_path, capsys, monkeypatch, task_with_sam
):
    import subprocess

    import examples.compare as compare

    started = []

    def no_training(command, *args, **kwargs):
        started.append(command)
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(compare.subprocess, "run", no_training)
    with pytest.raises(SystemExit, match="the adamw run with seed 42 failed"):
        compare_main(["--config", TASK, "--config", task_with_sam, "--seeds", "1",
              "--option", "sam.rho=0.05", "--out", str(tmp_path / "cmp")])  # fmt: skip
    printed = capsys.readouterr().out.splitlines()
    given = f"the config's SparseLayerSAM(layer_ratio=0.5) ({task_with_sam}: trainer.callbacks[1])"
    lines = [line for line in printed if line.startswith("== ") and "config's" in line]
    assert lines == [
        f"== adamw: drops {given}: plain AdamW, no SAM callback",
        f"== sam: replaces {given} with its own callback SAM(rho=0.05)",
        f"== slsam_paper: replaces {given} with its own callback SparseLayerSAM(preset='paper')",
        f"== slsam: keeps {given}, a configuration of slsam, with its options:"
        " runs SparseLayerSAM(layer_ratio=0.5)",
    ]
    # Printed before the first run started.
    assert len(started) == 1 and printed.index(lines[-1]) < printed.index(
        next(line for line in printed if line.startswith("== run 1/4"))
    )


def test_each_methods_config_keeps_the_other_callbacks_and_its_sam_callback(
    tmp_path, capsys, task_with_sam
):
    import argparse

    import yaml

    from examples.compare import _method_config, _task_callbacks

    task = _task_callbacks(argparse.ArgumentParser(), [TASK, task_with_sam])
    monitor = {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"}
    expected = {
        "adamw": None,
        "sam": {"class_path": "lightning_slsam.SAM", "init_args": {}},
        "slsam_paper": {"class_path": "lightning_slsam.SparseLayerSAM",
                        "init_args": {"preset": "paper"}},
        "slsam": {"class_path": "lightning_slsam.SparseLayerSAM",
                  "init_args": {"layer_ratio": 0.5}},
    }  # fmt: skip
    for method, sam in expected.items():
        config = _method_config(method, 42, str(tmp_path), "val_acc", "max", {}, None, task)
        callbacks = config["trainer"]["callbacks"]
        assert callbacks[0] == monitor and callbacks[-1]["class_path"].endswith("RunRecorder")
        assert callbacks[1:-1] == ([sam] if sam else []), method
    # As the fit command reads them: this config, stacked on the task's, is the run's.
    path = tmp_path / "slsam.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", TASK, "--config", task_with_sam, "--config", str(path),
              "--print_config"])  # fmt: skip
    assert done.value.code in (0, None)
    run = yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]
    assert [c["class_path"] for c in run] == [
        "lightning.pytorch.callbacks.LearningRateMonitor",
        "lightning_slsam.SparseLayerSAM",
        "examples.compare.RunRecorder",
    ]
    assert run[1]["init_args"]["layer_ratio"] == 0.5


def test_compare_refuses_two_sam_callbacks_or_bad_options_in_the_config(tmp_path, monkeypatch):
    import subprocess

    import examples.compare as compare

    started = []

    def no_training(command, *args, **kwargs):
        started.append(command)
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(compare.subprocess, "run", no_training)
    two = tmp_path / "two.yaml"
    two.write_text("trainer:\n  callbacks: [lightning_slsam.SAM, lightning_slsam.RST]\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning_slsam.SparseLayerSAM\n"
        "      init_args: {layer_ratio: 3}\n"
    )
    for config in (two, bad):
        with pytest.raises(SystemExit) as done:
            compare_main(["--config", TASK, "--config", str(config), "--out", str(tmp_path)])
        assert done.value.code == 2 and started == [], config  # before any run


def test_compare_as_a_module_command_runs_from_the_repository(tmp_path):
    # `python -m examples.compare`, as the plans run it: this module is then `__main__`, and
    # each run's config must still name the recorder by its importable path.
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "cmp"
    args = ["--config", TASK, "--methods", "adamw", "--seeds", "1", "--out", str(out), "--",
            *TINY]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "examples.compare", *args], cwd=root,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run,) = json.loads((out / "comparison.json").read_text())["runs"]["adamw"]
    assert run["global_step"] == 4 and len(run["values"]) == 2
