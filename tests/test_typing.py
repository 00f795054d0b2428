"""The method callbacks as a type checker and an IDE see them.

Each callback is a keyword-only dataclass whose fields are its options, inherited from its
method's option dataclass and the Lightning options: type checkers read its ``__init__``
as they read any dataclass's. These tests run mypy
on a user's file against the package as installed in this environment (``make install``
installs it where type checkers find it: ``editable_mode=compat``), not through a path
set for the test.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_slsam.lightning import callbacks
from lightning_slsam.lightning.callback import SAMCallback

CLASSES = [
    obj
    for obj in map(callbacks.__dict__.get, callbacks.__all__)
    if isinstance(obj, type) and issubclass(obj, SAMCallback)
]


def test_every_method_class_declares_its_options_by_inheritance():
    # What type checkers see: each class is decorated with options_class, and every option
    # of its spec is declared by a base class (an option dataclass) or on the class itself.
    for cls in CLASSES:
        declared = {n for b in cls.__mro__ for n in vars(b).get("__annotations__", {})}
        missing = set(cls.spec_class.option_names()) - declared
        assert not missing, (cls.__name__, missing)
        assert "__init__" in vars(cls), cls.__name__  # its own dataclass __init__


MYPY_CONFIG = (
    "[mypy]\nfollow_imports = skip\n\n[mypy-lightning_slsam.*]\nfollow_imports = normal\n"
    # Lightning's Callback as a class, not Any: a dataclass with an Any base takes any keyword
    "\n[mypy-lightning.pytorch.callbacks,lightning.pytorch.callbacks.callback]\n"
    "follow_imports = normal\n"
)


def _mypy(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    """mypy on ``source`` as a user's file outside the checkout, with the interpreter of
    this environment and no search path of the test's own."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (`make install` installs it: the dev extra)")
    (tmp_path / "user.py").write_text(source)
    # The package's own modules only: following torch and Lightning (6000 modules, ~45 s)
    # would check nothing more about its signatures.
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG)
    # PROTOTYPE: PYTHONPATH kept, so that mypy reads the clone.
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH",)}
    command = [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--no-incremental"]
    return subprocess.run(
        [*command, "--cache-dir", os.devnull, "--no-error-summary", "user.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _resolved(done: subprocess.CompletedProcess[str]) -> None:
    assert "import-not-found" not in done.stdout and "import-untyped" not in done.stdout, (
        "mypy cannot find lightning_slsam as installed: install it with `make install`, or"
        " `pip install -e . --config-settings editable_mode=compat`.\n" + done.stdout
    )


def test_mypy_reports_a_typo_in_an_option(tmp_path):
    done = _mypy(
        tmp_path,
        "from lightning_slsam import SparseLayerSAM\n\n"
        "callback = SparseLayerSAM(rho=0.05, layer_ration=0.2)\n",
    )
    _resolved(done)
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        'user.py:3: error: Unexpected keyword argument "layer_ration" for "SparseLayerSAM";'
        ' did you mean "layer_ratio"?' in done.stdout
    ), done.stdout


def test_mypy_reports_options_a_method_does_not_take_and_wrong_types(tmp_path):
    done = _mypy(
        tmp_path,
        "from lightning_slsam import SAM, RST\n\n"
        "a = SAM(schedule='random')\n"
        "b = RST(probability='half')\n",
    )
    _resolved(done)
    assert 'user.py:3: error: Unexpected keyword argument "schedule" for "SAM"' in done.stdout
    assert 'user.py:4: error: Argument "probability" to "RST" has incompatible type' in (
        done.stdout
    )


def test_correct_calls_type_check_clean(tmp_path):
    done = _mypy(
        tmp_path,
        "from lightning_slsam import RST, SAM, SLSAMRST, LookSAM, SparseLayerSAM, make_callback\n\n"
        "callbacks = [\n"
        "    SparseLayerSAM(rho=0.05, layer_ratio=0.2, preset='paper', seed=0),\n"
        "    SLSAMRST(rho=0.05, layer_ratio=0.2, probability=0.5, seed=0),\n"
        "    SAM(adaptive=True, gradient_clip_val=1.0),\n"
        "    RST(probability=0.3),\n"
        "    LookSAM(interval=2, alpha=0.0, layers=['^blocks\\\\.(\\\\d+)\\\\.']),\n"
        "    make_callback('esam', weight_ratio=0.5),\n"
        "]\n"
        "budget: float = SparseLayerSAM().bandit.budget\n",
    )
    _resolved(done)
    assert done.returncode == 0, done.stdout + done.stderr
