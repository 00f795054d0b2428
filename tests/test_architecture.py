"""The package's shape: the core imports no Lightning, ``import lightning_slsam`` stays
light, modules import each other without cycles, and modules and classes stay small."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_slsam"

#: The pure-PyTorch core: usable in a plain training loop, without Lightning.
CORE = [
    "bandit", "checks", "counters", "dense_specs", "distributed", "engine", "extras",
    "freezing", "layers", "passes", "perturbation", "projection", "registry", "running",
    "schedules", "seeding", "selection", "selection_wrappers", "sharding", "shells", "specs",
    "steps", "subset_specs",
]  # fmt: skip

#: Heavy libraries that only the surfaces need (tasks, recipes, charts).
HEAVY = ("timm", "transformers", "matplotlib", "lightning", "torchmetrics")


def _imported_after(statement: str) -> list[str]:
    code = f"import sys\n{statement}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_importing_the_package_loads_no_heavy_library():
    assert _imported_after("import lightning_slsam") == []


def test_core_modules_import_no_lightning():
    imports = "; ".join(f"import lightning_slsam.{name}" for name in CORE)
    assert _imported_after(imports) == []


def test_lightning_names_load_on_first_use():
    loaded = _imported_after("from lightning_slsam import SparseLayerSAM, SAMMixin")
    assert "lightning" in loaded


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The package modules ``path`` imports anywhere (functions included), except under
    ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
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
