"""Data access the recipes share: local JSON-lines files and the Hugging Face hub."""

from __future__ import annotations

import json
import os
from typing import Any

from lightning_slsam.methods.options import invalid


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file (one object per line), with a clear error if missing."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No data file {path!r}.")
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def load_hub_dataset(*args: Any, **kwargs: Any) -> Any:
    """``datasets.load_dataset``, with the install hint when the package is missing."""
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            "Downloading this recipe's data needs the `datasets` package: `pip install"
            ' "lightning-slsam[recipes]"`, or pass `data_dir` with local JSON-lines files.'
        ) from err
    return datasets.load_dataset(*args, **kwargs)


def check_path(name: str, path: Any, folder: bool) -> Any:
    """``None`` or an existing folder (``folder=True``) or file."""
    if path is not None and not (os.path.isdir(path) if folder else os.path.isfile(path)):
        raise invalid(name, path, f"None or an existing {'folder' if folder else 'file'}")
    return path
