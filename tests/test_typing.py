"""The method callbacks as a type checker and an IDE see them.

Each callback's ``__init__`` is built at run time from its method's specification and the
Lightning options; the stub ``lightning_slsam/lightning/callbacks.pyi`` declares the same
signatures for static tools. These tests keep the stub equal to the classes, and run mypy
on a user's file against the package as installed in this environment (``make install``
installs it where type checkers find it: ``editable_mode=compat``), not through a path
set for the test.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_slsam.lightning import callbacks
from lightning_slsam.lightning.callback import SAMCallback
from lightning_slsam.lightning.signatures import stub_init

STUB = Path(callbacks.__file__).with_suffix(".pyi")
CLASSES = [
    obj
    for obj in map(callbacks.__dict__.get, callbacks.__all__)
    if isinstance(obj, type) and issubclass(obj, SAMCallback)
]


def _stub() -> ast.Module:
    return ast.parse(STUB.read_text())


def _init(node: ast.ClassDef) -> ast.FunctionDef:
    return next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")


def test_the_stub_declares_every_method_class_with_its_runtime_signature():
    classes = {node.name: node for node in _stub().body if isinstance(node, ast.ClassDef)}
    assert sorted(classes) == sorted(cls.__name__ for cls in CLASSES)
    for cls in CLASSES:
        node = classes[cls.__name__]
        assert [ast.unparse(base) for base in node.bases] == [cls.__bases__[0].__name__]
        expected = ast.parse(f"class {cls.__name__}:\n{stub_init(cls)}").body[0]
        assert ast.unparse(_init(node)) == ast.unparse(_init(expected)), (
            f"{STUB.name} is out of date for {cls.__name__}: its __init__ is"
            f" lightning_slsam.lightning.signatures.stub_init({cls.__name__}):\n"
            f"{stub_init(cls)}"
        )


def test_the_stub_exports_what_the_module_exports():
    tree = _stub()
    exported = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__"
    )
    assert sorted(ast.literal_eval(exported)) == sorted(callbacks.__all__)


MYPY_CONFIG = "[mypy]\nfollow_imports = skip\n\n[mypy-lightning_slsam.*]\nfollow_imports = normal\n"


def _mypy(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    """mypy on ``source`` as a user's file outside the checkout, with the interpreter of
    this environment and no search path of the test's own."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (`make install` installs it: the dev extra)")
    (tmp_path / "user.py").write_text(source)
    # The package's own modules only: following torch and Lightning (6000 modules, ~45 s)
    # would check nothing more about its signatures.
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
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
