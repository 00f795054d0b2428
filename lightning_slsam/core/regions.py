"""Compiled regions: the parts of a model that ``torch.compile`` traces as one graph.

``torch.compile`` guards each graph on the ``requires_grad`` of the tensors it was traced
with. Freezing a different set of tensors inside a compiled graph every step makes a new
graph every step, until torch._dynamo's recompile limit, after which the code runs
uncompiled. Layer sampling therefore freezes a compiled region all at once or not at all:
every compiled submodule is one layer of the partition, so each region's graph is traced
in a bounded number of variants (its parameters trainable or frozen, times whether its
input needs a gradient, times grad mode) however the layers are drawn.

Found here: submodules compiled in place (``block.compile()``, the regional compilation
recipe) and compiled submodules placed in the model (``model.blocks[i] =
torch.compile(block)``). A model compiled whole (``torch.compile(model)``, or the
Trainer's compiled module) is one region: see :func:`compiled_whole`.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MIN_TORCH", "compiled_regions", "compiled_whole", "torch_guards_requires_grad"]

#: The first torch whose compiled graphs are reliably re-guarded when a parameter's
#: ``requires_grad`` changes (pytorch#139476: earlier versions may reuse a stale graph).
MIN_TORCH = (2, 12)


def _is_optimized(module: nn.Module) -> bool:
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def _compiled_in_place(module: nn.Module) -> bool:
    # nn.Module.compile() stores the compiled call here (torch 2.2 and later).
    return getattr(module, "_compiled_call_impl", None) is not None


def compiled_whole(model: nn.Module) -> bool:
    """Whether ``model`` itself is compiled (``torch.compile(model)``, ``model.compile()``,
    or the Trainer's compiled module, which Lightning marks with ``_compiler_ctx``)."""
    return (
        _is_optimized(model)
        or _compiled_in_place(model)
        or bool(getattr(model, "_compiler_ctx", None))
    )


def compiled_regions(model: nn.Module) -> list[str]:
    """The qualified names of ``model``'s compiled submodules, outermost only (a region's
    own compiled children are part of it), in model order.

    Example:
        >>> blocks = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> model = torch.nn.Sequential(blocks, torch.nn.Linear(4, 2))
        >>> blocks[1].compile()
        >>> compiled_regions(model)
        ['0.1']
    """
    found: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(f"{outer}.") for outer in found):
            continue
        if _is_optimized(module) or _compiled_in_place(module):
            found.append(name)
    return found


def torch_guards_requires_grad(version: str | None = None) -> bool:
    """Whether this torch (or ``version``) is at least :data:`MIN_TORCH`.

    Example:
        >>> torch_guards_requires_grad("2.11.0+cu128"), torch_guards_requires_grad("2.14.1")
        (False, True)
    """
    release = (version or torch.__version__).split("+")[0].split(".")
    major, minor = (int("".join(ch for ch in part if ch.isdigit()) or 0) for part in release[:2])
    return (major, minor) >= MIN_TORCH
