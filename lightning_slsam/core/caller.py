"""Warnings attributed to the user's line of code, not to a framework frame (:func:`warn`)."""

from __future__ import annotations

import os
import sys
import sysconfig
import warnings

__all__ = ["FRAMEWORKS", "warn"]

#: The packages whose frames stand between a user's call and this package's warning.
FRAMEWORKS = (
    "lightning_slsam", "lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities",
    "transformers", "accelerate", "trl", "peft", "torch",
)  # fmt: skip


def _library_folders() -> tuple[str, ...]:
    folders = [sysconfig.get_paths()["stdlib"]]
    for name in FRAMEWORKS:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            folders.append(os.path.dirname(path))
    return tuple(os.path.join(f, "") for f in folders)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the innermost frame outside :data:`FRAMEWORKS`/stdlib."""
    folders = _library_folders()
    own = os.path.join(os.path.dirname(os.path.dirname(__file__)), "")
    frame, level, ours = sys._getframe(1), 2, None
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<frozen") and not name.startswith(folders):
            break
        if ours is None and name.startswith(own):
            ours = level
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else ours or 2)
