"""What ``lightning-slsam --help`` and its subcommands' help say: the command, its
subcommands in one complete line each, ``--demo``, and every SAM option's real default."""

from __future__ import annotations

import inspect
import re

import pytest

from lightning_slsam import METHODS
from lightning_slsam.cli.checks import resolve_callback
from lightning_slsam.cli.command import main
from lightning_slsam.lightning.callbacks import class_path

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:lightning.pytorch.cli")

CLASSES = list(dict.fromkeys(class_path(cls) for cls, _ in METHODS.values() if cls is not None))
#: Options whose ``None`` is a value that runs: the run's seed, no clipping.
NONE_RUNS = {"seed", "gradient_clip_val"}


def shown(capsys, *args: str) -> str:
    """The help ``lightning-slsam ARGS`` prints (it exits with code 0)."""
    with pytest.raises(SystemExit) as done:
        main(list(args))
    assert done.value.code in (0, None)
    return capsys.readouterr().out


def words(text: str) -> str:
    return " ".join(text.split())


def shown_defaults(text: str) -> dict[str, str]:
    """``{option: the default its help shows}`` for each ``--trainer.callbacks.OPTION``."""
    blocks: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        start = re.match(r"^  (--\S+)", line)
        if start:
            blocks.append((start.group(1).rstrip(","), []))
        if blocks:
            blocks[-1][1].append(line)
    defaults = {}
    for flag, lines in blocks:
        name = flag.removeprefix("--trainer.callbacks.")
        if flag.startswith("--trainer.callbacks.") and "." not in name:
            # jsonargparse appends the subclasses of a Sequence type that some imported
            # module declares (more_itertools' numeric_range, once imported): not a default
            text = re.sub(r", known subclasses: [^,)]*", "", words(" ".join(lines)))
            found = re.search(r".*, default: (.*)\)$", text)
            assert found, (flag, lines)
            defaults[name] = found.group(1)
    return defaults


@pytest.mark.parametrize("path", CLASSES)
def test_each_methods_help_shows_the_defaults_that_run(capsys, path):
    cls = resolve_callback(path)
    text = shown(capsys, "fit", "--trainer.callbacks.help", path)
    defaults = shown_defaults(text)
    options = inspect.signature(cls).parameters
    assert set(defaults) == set(options), path
    built = cls()
    for name, parameter in options.items():
        value, default = getattr(built, name), parameter.default
        assert value == default or list(value) == list(default), name  # the value that runs
        assert defaults[name] == ("null" if default is None else str(default)), (path, name)
    # `null` is shown only where None runs as such.
    nulls = {name for name, shown_value in defaults.items() if shown_value == "null"}
    assert nulls <= NONE_RUNS, path


def test_fit_help_says_what_demo_does(capsys):
    text = shown(capsys, "fit", "--help")
    top = words(text[: text.index("options:")])  # the description, under the usage lines
    assert "--demo trains the packaged demo" in top
    for fact in ("MiniLM-L6", "Rotten Tomatoes", "SparseLayerSAM()", "offline",
                 "lightning_slsam/configs/demo.yaml", "--demo --print_config"):  # fmt: skip
        assert fact in top, fact


def test_top_level_help_describes_the_command_and_every_subcommand_in_one_line(capsys):
    text = shown(capsys, "--help")
    assert "Lightning Trainer command line tool" not in text
    top = words(text[: text.index("options:")])
    for fact in ("Sparse-Layer SAM (SL-SAM)", "SAM", "Lightning", "lightning-slsam fit --demo"):
        assert fact in top, fact
    # Each subcommand's line (with its wrapped continuation) is a whole sentence.
    listing = text[text.index("Available subcommands:") :].splitlines()[1:]
    lines: dict[str, str] = {}
    for line in listing:
        named = re.match(r"^    (\w+)\s+(\S.*)$", line)
        if named:
            lines[named.group(1)] = named.group(2)
        elif lines and line.strip() and line.startswith(" " * 20):
            last = list(lines)[-1]
            lines[last] += " " + line.strip()
    assert list(lines) == ["fit", "validate", "test", "predict"]
    for name, description in lines.items():
        assert description[0].isupper() and description.endswith("."), (name, description)
    assert "separated from fit" not in text
    assert "--demo" in lines["fit"]
