"""Which of the package's files and functions one training step runs.

One ``SparseLayerSAM()`` step through a Lightning Trainer, after warm-up, is watched with
``sys.setprofile``: every call into a function defined in ``lightning_slsam`` is recorded,
from Lightning's call of the module's ``training_step`` (the mixin's) to the end of the SAM
callback's ``on_train_batch_end`` (its per-step logging). A function is a named code object
(methods, properties, nested functions and lambdas); comprehensions are parts of the
expression that holds them (Python 3.12 inlines them) and are not counted.

    python benchmarks/step_path.py             # the table (markdown)
    python benchmarks/step_path.py --json      # the same as JSON

The model is the README's: a LightningModule with ``SAMMixin`` whose ``training_step``
returns the loss and whose optimizer is AdamW, no LR scheduler, one device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from collections import Counter
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

import lightning_slsam
from lightning_slsam import SAMMixin, SparseLayerSAM

PACKAGE = os.path.dirname(lightning_slsam.__file__)
#: The step that is watched (0-based batch index); the ones before it warm up.
WATCHED = 5
_COMPREHENSIONS = ("<listcomp>", "<setcomp>", "<dictcomp>", "<genexpr>")


class Classifier(SAMMixin, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _Watch(L.Callback):
    """Profiles the package's calls from the start of batch ``WATCHED`` (first callback) to
    the end of its ``on_train_batch_end`` hooks (``_Stop``, the last callback)."""

    def __init__(self, calls: Counter) -> None:
        self.calls = calls

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            code = frame.f_code
            path = os.path.relpath(code.co_filename, PACKAGE)
            self.calls[(path, code.co_qualname, code.co_firstlineno)] += 1

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, i: int) -> None:
        if i == WATCHED:
            sys.setprofile(self._profile)


class _Stop(L.Callback):
    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if args[-1] == WATCHED:
            sys.setprofile(None)


def step_path() -> dict[str, Any]:
    """The files and functions of the package one step runs, with their call counts."""
    calls: Counter = Counter()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(80, 8), torch.randint(0, 4, (80,)))
    trainer = L.Trainer(
        max_steps=WATCHED + 2, callbacks=[_Watch(calls), SparseLayerSAM(seed=0, plot=False),
                                          _Stop()],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tempfile.mkdtemp(), accelerator="cpu",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Classifier(), torch.utils.data.DataLoader(data, batch_size=8))
    functions = {k: n for k, n in calls.items() if not k[1].endswith(_COMPREHENSIONS)}
    files: dict[str, list[str]] = {}
    for (path, name, _), _count in sorted(functions.items()):
        files.setdefault(path, []).append(name)
    return {
        "files": len(files),
        "functions": len(functions),
        "calls": sum(functions.values()),
        "by_file": files,
    }


def table(path: dict[str, Any]) -> str:
    lines = [
        f"One `SparseLayerSAM()` step: **{path['files']} files, {path['functions']}"
        f" functions** of the package ({path['calls']} calls).",
        "",
        "| file | functions |",
        "|---|---|",
    ]
    lines += [f"| `{f}` | {', '.join(f'`{n}`' for n in names)} |"
              for f, names in path["by_file"].items()]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = parser.parse_args(argv)
    path = step_path()
    print(json.dumps(path, indent=2) if args.json else table(path))
    return path


if __name__ == "__main__":
    main()
