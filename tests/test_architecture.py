"""The package's shape: the core imports no Lightning, ``import lightning_slsam`` stays
light, modules import each other without cycles, and modules and classes stay small."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_slsam"

#: The subpackages that may import Lightning: the Lightning layer, the command line, and
#: the packaged tasks and recipes (LightningModules and DataModules themselves).
LIGHTNING_ALLOWED = ("lightning", "cli", "tasks", "recipes")

#: At most this many modules at the package's top level; the rest live in subpackages.
TOP_LEVEL_MODULES = 8


def _pure_modules() -> list[str]:
    """Every module outside the Lightning-allowed subpackages (the pure-PyTorch part)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) > 1 and parts[0] in LIGHTNING_ALLOWED:
            continue
        names.append(_module_name(path))
    return names


#: Heavy libraries that only the surfaces need (tasks, recipes, charts).
HEAVY = ("timm", "transformers", "matplotlib", "lightning", "torchmetrics")


def _imported_after(statement: str) -> list[str]:
    code = f"import sys\n{statement}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_importing_the_package_loads_no_heavy_library():
    assert _imported_after("import lightning_slsam") == []


def test_no_module_outside_the_lightning_subpackages_imports_lightning():
    # At run time: importing every pure module loads no heavy library ...
    pure = [m for m in _pure_modules() if m != "lightning_slsam.compare"]
    assert _imported_after("; ".join(f"import {name}" for name in pure)) == []
    # ... and in the source, at any level (functions and TYPE_CHECKING blocks included).
    offenders = {}
    for name in _pure_modules():
        path = _module_path(name)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            found = []
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found = [node.module]
            bad = [m for m in found if m.split(".")[0] in ("lightning", "pytorch_lightning")]
            if bad or any(
                m.startswith(tuple(f"lightning_slsam.{sub}" for sub in LIGHTNING_ALLOWED))
                for m in found
            ):
                offenders.setdefault(name, []).extend(found)
    # The package root names the Lightning layer for static tools (loaded on first use),
    # and the top-level compare module keeps an old class path of the command line.
    offenders.pop("lightning_slsam", None)
    offenders.pop("lightning_slsam.compare", None)
    assert offenders == {}


def test_the_top_level_holds_few_modules_and_the_rest_is_in_subpackages():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_MODULES, top
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert {"core", "selection", "methods", "parallel", "lightning", "cli"} <= subpackages


def _module_path(name: str) -> Path:
    rel = Path(*name.split(".")[1:])
    return PACKAGE / rel / "__init__.py" if (PACKAGE / rel).is_dir() else PACKAGE / f"{rel}.py"


def test_lightning_names_load_on_first_use():
    loaded = _imported_after("from lightning_slsam import SparseLayerSAM, SAMMixin")
    assert "lightning" in loaded


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The package modules ``path`` imports anywhere: functions and ``if TYPE_CHECKING:``
    blocks included (a circle of type-only imports is a circle of the design too)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("lightning_slsam.")}


def test_no_import_cycles():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: {m for m in _imports(path) if m in modules} for name, path in modules.items()}
    # ``lightning_slsam`` itself only re-exports: a module importing a sibling loads it first.
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycles.append([*trail[trail.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*trail, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: p.name)
def test_modules_and_classes_stay_small(path):
    source = path.read_text()
    assert len(source.splitlines()) <= 400, f"{path.name} is over 400 lines"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1
            assert size <= 250, f"class {node.name} in {path.name} is {size} lines"


#: Public names without an example of their own: records that a step returns (shown in
#: the engine's example) and a helper that needs a running Trainer (shown in the tasks).
NO_EXAMPLE = {"PassOutput", "StepResult", "estimated_stepping_batches"}


def test_public_classes_and_functions_have_runnable_examples():
    # The examples themselves run as doctests (pytest --doctest-modules, pyproject.toml).
    import inspect

    import lightning_slsam

    missing = []
    for name in sorted(set(lightning_slsam.__all__) - NO_EXAMPLE):
        obj = getattr(lightning_slsam, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        module = sys.modules[obj.__module__]
        if ">>>" not in (obj.__doc__ or "") + (module.__doc__ or ""):
            missing.append(name)
    assert missing == []
