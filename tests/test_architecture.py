"""The package's shape: the core imports no Lightning, ``import lightning_slsam`` stays
light, modules import each other without cycles, the subpackages are layered (each imports
only those below it), and the top-level namespace holds the user API and the extension
points only. (Files split where concepts split: there is no cap on a module's length.)"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_slsam"

#: The subpackages that may import Lightning: the Lightning layer, the command line, the
#: packaged demo (a LightningModule and DataModule itself), and the Hugging Face Trainer
#: front-end (Transformers, and the Lightning layer's metrics).
LIGHTNING_ALLOWED = ("lightning", "cli", "demo", "hf")

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
    pure = _pure_modules()
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
    # The package root names the Lightning layer for static tools (loaded on first use).
    offenders.pop("lightning_slsam", None)
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


#: The subpackages from the bottom up: each may import those of lower levels only. The
#: pure-PyTorch part (parallel, selection, core, methods) under the Lightning layer; the
#: command line, the packaged demo and the Hugging Face front-end above it.
LEVELS = (("parallel", "monitor"), ("selection",), ("core",), ("methods",), ("lightning",),
          ("cli", "demo", "hf"))  # fmt: skip
#: The subpackages that import nothing else of the package.
SELF_CONTAINED = ("parallel", "selection", "monitor")


def _subpackage(module: str) -> str | None:
    """The subpackage of a ``lightning_slsam.*`` module name (``None``: the top level)."""
    parts = module.split(".")
    if len(parts) > 1 and (PACKAGE / parts[1] / "__init__.py").is_file():
        return parts[1]
    return None


def _module_level_imports(source: str) -> set[str]:
    """The package modules a module's ``source`` imports at module level, wherever in the
    file: inside ``if TYPE_CHECKING:``, ``try`` and other blocks too, but not inside
    functions (which run later, on demand)."""
    found: set[str] = set()
    todo: list[ast.stmt] = list(ast.parse(source).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                todo.append(child)
            elif isinstance(child, ast.excepthandler):
                todo.extend(child.body)
    return {name for name in found if name.startswith("lightning_slsam")}


def _subpackage_imports() -> dict[str, dict[str, set[str]]]:
    """Subpackage -> {subpackage or top-level module it imports -> the files importing it}."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = _subpackage(_module_name(path))
        if source is None:
            continue
        graph.setdefault(source, {})
        for name in _module_level_imports(path.read_text()):
            target = _subpackage(name) or name  # the top level: the module itself
            if target != source:
                graph[source].setdefault(target, set()).add(path.name)
    return graph


def test_the_subpackages_form_a_layered_dag():
    level = {name: k for k, names in enumerate(LEVELS) for name in names}
    graph = _subpackage_imports()
    assert set(graph) == set(level), "give every subpackage a place in LEVELS"
    upward = {
        (source, target): sorted(files)
        for source, targets in graph.items()
        for target, files in targets.items()
        if target not in level or level[target] > level[source]
    }
    assert upward == {}, "a subpackage imports one above it (or the top level)"
    for name in SELF_CONTAINED:
        assert graph[name] == {}, f"{name} imports {sorted(graph[name])}"
    # No cycle between subpackages, those of one level included.
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph.get(name, {})):
            assert state.get(dep) != 1, f"cycle: {' -> '.join([*trail, dep])}"
            if dep not in state:
                visit(dep, [*trail, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_hugging_face_front_end_and_the_core_import_nothing_of_the_lightning_layer():
    # What the front-ends share (the method's checkpoint state, step metrics, loss-scale
    # reading, batch handling, the DDP averager, a spec from a name) lives below the
    # Lightning layer; no Lightning exception type can reach a Hugging Face or plain-loop user.
    for name in ("hf", "core"):
        used = {
            (path.name, module)
            for path in (PACKAGE / name).rglob("*.py")
            for module in _imports(path)
            if module.startswith("lightning_slsam.lightning")
        }
        assert used == set(), f"{name}/ imports the Lightning layer: {sorted(used)}"
        text = "".join(p.read_text() for p in (PACKAGE / name).rglob("*.py"))
        assert "MisconfigurationException" not in text


def test_the_layering_check_counts_type_only_imports_not_those_in_functions():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from lightning_slsam.core.engine import SAMEngine\n"
        "try:\n    import torch\nexcept ImportError:\n    import lightning_slsam.parallel\n"
        "def later():\n    import lightning_slsam.cli.command\n"
    )
    assert _module_level_imports(source) == {
        "lightning_slsam.core.engine",
        "lightning_slsam.core.engine.SAMEngine",
        "lightning_slsam.parallel",
    }


#: At most this many names in ``lightning_slsam.__all__`` besides the method callbacks (one
#: name per method: the callback a user adds to the Trainer).
MAX_TOP_LEVEL_NAMES = 12
#: The documented extension points (docs/extending.md): what a method of one's own builds on.
EXTENSION_POINTS = {"MethodSpec", "LayerSubsetSpec", "LayerSelection", "SAMCallback",
                    "register_method"}  # fmt: skip
#: The user API besides the method callbacks: the module mixin, the front-ends, the
#: registry by name, the version.
USER_API = {"SAMMixin", "FabricSAM", "make_callback", "make_engine", "METHODS", "__version__",
            "ForgettingMonitor"}  # fmt: skip


def test_the_top_level_exports_the_user_api_and_the_extension_points_only():
    import lightning_slsam
    from lightning_slsam.lightning.callback import SAMCallback
    from lightning_slsam.lightning.callbacks import METHODS

    names = lightning_slsam.__all__
    methods = {cls for cls, _ in METHODS.values() if cls is not None}
    assert len(names) == len(set(names))
    besides = sorted(set(names) - {cls.__name__ for cls in methods})
    assert len(besides) <= MAX_TOP_LEVEL_NAMES, besides
    others = []
    for name in names:
        namespace: dict = {}
        exec(f"from lightning_slsam import {name}", namespace)  # importable as written
        obj = namespace[name]
        assert obj is getattr(lightning_slsam, name)
        is_method = isinstance(obj, type) and issubclass(obj, SAMCallback) and obj in methods
        if not (is_method or name in USER_API or name in EXTENSION_POINTS):
            others.append(name)
    assert others == [], "neither a method, the user API nor a documented extension point"
    assert set(names) >= EXTENSION_POINTS | USER_API
    extending = (PACKAGE.parent / "docs" / "extending.md").read_text()
    assert [name for name in sorted(EXTENSION_POINTS) if name not in extending] == []


#: Public names without an example of their own (the records and helpers that had none are
#: imported from their modules since 0.3).
NO_EXAMPLE: set[str] = set()


def _public_classes_and_functions() -> list:
    import inspect

    import lightning_slsam

    names = []
    for name in sorted(set(lightning_slsam.__all__) - NO_EXAMPLE):
        obj = getattr(lightning_slsam, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        names.append(pytest.param(name, id=name))
    return names


@pytest.mark.parametrize("name", _public_classes_and_functions())
def test_public_classes_and_functions_have_runnable_examples(name):
    # The examples themselves run as doctests (pytest --doctest-modules, pyproject.toml).
    import lightning_slsam

    obj = getattr(lightning_slsam, name)
    module = sys.modules[obj.__module__]
    assert ">>>" in (obj.__doc__ or "") + (module.__doc__ or ""), name


#: The most of the package's files and functions one SparseLayerSAM() training step through a
#: Trainer may run (benchmarks/step_path.py; docs/architecture.md draws the path).
MAX_STEP_FILES, MAX_STEP_FUNCTIONS = 12, 52


def test_one_step_runs_few_of_the_packages_files_and_functions():
    import importlib.util

    script = PACKAGE.parent / "benchmarks" / "step_path.py"
    spec = importlib.util.spec_from_file_location("step_path", script)
    step_path = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_path)  # type: ignore[union-attr]
    path = step_path.step_path()
    assert path["files"] <= MAX_STEP_FILES and path["functions"] <= MAX_STEP_FUNCTIONS, path
    # The step reads top-down in the core: the step functions, the pass loop, the engine.
    names = {f"{f}:{n}" for f, functions in path["by_file"].items() for n in functions}
    assert {"core/step.py:sam_step", "core/step.py:commit", "core/passes.py:PassRunner.__call__",
            "core/engine.py:SAMEngine.step"} <= names  # fmt: skip
    # No front-end copy of the pass loop, no FSDP2 arithmetic on one device.
    assert not any(f.startswith("lightning/fabric") for f in path["by_file"])
    assert path["by_file"]["parallel/shards.py"] == [
        "Shards.local",
        "Shards.norms",
        "Shards.reshard",
    ]
