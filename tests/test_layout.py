"""The tests mirror the package: a folder of tests per subpackage of ``lightning_slsam``, and
module basenames unique across the folders (pytest imports each file by its basename: the
folders have no ``__init__.py``, pytest's default "prepend" import mode)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "lightning_slsam"


def test_every_subpackage_has_a_folder_of_tests():
    subpackages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert {"core", "selection", "methods", "lightning", "cli"} <= set(subpackages)
    missing = [name for name in subpackages if not list((TESTS / name).glob("test_*.py"))]
    assert not missing, f"subpackages without tests/<name>/test_*.py: {missing}"


def test_module_basenames_are_unique_and_no_folder_is_a_package():
    # --doctest-modules imports every .py file under tests/ too, helpers and workers included.
    modules = [p for p in TESTS.rglob("*.py") if p.name != "conftest.py"]
    counts = Counter(p.name for p in modules)
    clashes = sorted(str(p.relative_to(TESTS)) for p in modules if counts[p.name] > 1)
    assert not clashes, f"rename one of each: {clashes}"
    assert not list(TESTS.rglob("__init__.py"))  # a package would shadow e.g. `lightning`
