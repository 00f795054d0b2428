"""The wheel carries what an installed package needs: the demo's configuration (``fit --demo``),
the typing markers (``py.typed``, the callbacks' stub) and the Apache-2.0 license, declared in
its metadata (PEP 639) and shipped in its ``dist-info``.

The wheel is built offline from a copy of the checkout (the build writes ``build/`` and an
``*.egg-info`` next to the sources) with the environment's setuptools: no build isolation.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What the build reads: the project table, the readme and license it names, the package.
SOURCES = ["pyproject.toml", "README.md", "LICENSE"]
PACKAGE = "lightning_slsam"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("packaging")
    src, out = tmp / "src", tmp / "wheelhouse"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).exists():  # a missing one fails the build or the checks below
            shutil.copy2(ROOT / name, src / name)
    shutil.copytree(
        ROOT / PACKAGE, src / PACKAGE, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip_wheel = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation"]
    build = subprocess.run(
        [*pip_wheel, "-v", "-w", str(out)],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = build.stdout + build.stderr
    assert build.returncode == 0, log[-4000:]
    # The backend's warnings (e.g. a deprecated form of `license`) come through with -v.
    warned = [line for line in log.splitlines() if re.search(r"warn", line, re.I)]
    assert not [line for line in warned if re.search(r"licen[cs]e", line, re.I)], warned
    (built,) = out.glob("lightning_slsam-*.whl")
    return built


def _dist_info(names: list[str]) -> str:
    (folder,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    return folder


def test_wheel_holds_the_demo_config_and_the_typing_markers(wheel: Path):
    import lightning_slsam
    from lightning_slsam.cli.command import demo_config_path

    installed = Path(lightning_slsam.__file__).resolve().parent.parent
    demo = Path(demo_config_path()).resolve().relative_to(installed).as_posix()  # `fit --demo`
    assert demo == f"{PACKAGE}/configs/demo.yaml"
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        for path in [demo, f"{PACKAGE}/py.typed"]:
            assert path in names, f"{path} is not in {wheel.name}"
        assert whl.read(demo) == (ROOT / demo).read_bytes()


def test_wheel_ships_the_license_and_declares_it(wheel: Path):
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        info = _dist_info(names)
        licenses = [n for n in names if re.fullmatch(rf"{info}/(licenses/)?LICENSE", n)]
        assert licenses, f"no LICENSE in {info}: {[n for n in names if n.startswith(info)]}"
        text = whl.read(licenses[0]).decode()
        metadata = Parser().parsestr(whl.read(f"{info}/METADATA").decode())
    assert "Apache License" in text
    assert "Version 2.0" in text
    assert text == (ROOT / "LICENSE").read_text()
    # PEP 639 (setuptools >= 77): an SPDX expression, not the deprecated free-text `License`.
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["License"] is None
    assert metadata.get_all("License-File") == ["LICENSE"]


def _release(version: str) -> tuple[int, ...]:
    """The release part of a PEP 440 version: ``0.3.0.dev0`` -> (0, 3, 0)."""
    return tuple(int(p) for p in re.match(r"\d+(\.\d+)*", version).group(0).split("."))


def test_the_version_agrees_with_the_project_table_and_the_changelog():
    """One version everywhere: the package's ``__version__`` is the project table's, its
    release is the changelog's newest heading."""
    import lightning_slsam

    version = lightning_slsam.__version__
    table = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert table and table.group(1) == version
    heading = re.search(r"^## (\d+\.\d+\.\d+)", (ROOT / "docs" / "changelog.md").read_text(), re.M)
    assert heading and _release(heading.group(1)) == _release(version)
