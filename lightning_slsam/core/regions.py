"""Compiled regions: each compiled submodule is one sampled layer, frozen whole, since its
graph is guarded on ``requires_grad`` (docs/training-features.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["MIN_TORCH", "compile_blocks", "compile_blocks_instead", "compiled_regions",
           "compiled_whole", "repeated_blocks", "torch_guards_requires_grad"]  # fmt: skip

#: The first torch whose compiled graphs are re-guarded when a ``requires_grad`` changes.
MIN_TORCH = (2, 12)


def _is_optimized(module: nn.Module) -> bool:
    """A ``torch.compile(module)`` wrapper still running compiled."""
    from torch._dynamo.eval_frame import OptimizedModule

    if not isinstance(module, OptimizedModule):
        return False
    return module.__dict__.get("forward") != module._orig_mod.__call__


def _compiled_in_place(module: nn.Module) -> bool:
    # nn.Module.compile() stores the compiled call here (torch 2.2 and later).
    return getattr(module, "_compiled_call_impl", None) is not None


def compiled_whole(model: nn.Module) -> bool:
    """Whether ``model`` itself is compiled (``torch.compile``, ``.compile()``, Lightning's)."""
    return (
        _is_optimized(model)
        or _compiled_in_place(model)
        or bool(getattr(model, "_compiler_ctx", None))
    )


def compiled_regions(model: nn.Module) -> list[str]:
    """The qualified names of ``model``'s compiled submodules, outermost only, in model order.

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


def repeated_blocks(module: nn.Module) -> list[str]:
    """The qualified names of ``module``'s repeated blocks: the children of its largest
    ``ModuleList``/``Sequential`` whose 2+ children are of one class and hold parameters.

    Example:
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed = torch.nn.Linear(4, 8)
        ...         self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        >>> repeated_blocks(Net())
        ['layers.0', 'layers.1', 'layers.2']
    """
    best: list[str] = []
    best_size = 0
    for name, container in module.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) < 2:
            continue
        children = list(container.named_children())
        if len({type(child) for _, child in children}) != 1:
            continue
        if any(next(child.parameters(), None) is None for _, child in children):
            continue
        size = sum(p.numel() for p in container.parameters())
        if size > best_size:
            best = [f"{name}.{key}" if name else key for key, _ in children]
            best_size = size
    return best


def compile_blocks(module: nn.Module, context: Any = None, **options: Any) -> list[str]:
    """Compile ``module``'s :func:`repeated_blocks` in place (or with ``context``); their names."""
    blocks = repeated_blocks(module)
    for name in blocks:
        _compile(module.get_submodule(name), context, options)
    return blocks


def _compile(block: nn.Module, context: Any, options: dict[str, Any]) -> None:
    if _is_optimized(block) or _compiled_in_place(block):
        return
    if context is None:
        block.compile(**options)
    else:  # what nn.Module.compile does, with the given context
        block._compiled_call_impl = context(block._call_impl)


def _context_of(compiled_call: Any) -> Any:
    """The ``torch.compile`` context that made ``compiled_call``, or ``None``."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    for cell in getattr(compiled_call, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, _TorchDynamoContext):
            return value
    return None


def compile_blocks_instead(model: nn.Module, context: Any = None) -> dict[str, list[str]]:
    """Compiled regions of ``model`` holding repeated blocks run eagerly, their blocks compiled
    with the region's settings instead; other regions stay compiled, as one layer.

    Args:
        model: the model.
        context: ``model``'s ``torch.compile`` context if already made eager (default ``None``).

    Returns:
        Each region handed back to eager (``""`` for ``model``) -> its blocks, now compiled.
    """
    done: dict[str, list[str]] = {}
    blocks = repeated_blocks(model)
    scopes = [("", model)] if context is not None or compiled_whole(model) else []
    scopes += [(name, model.get_submodule(name)) for name in compiled_regions(model)]
    for name, region in scopes:
        inside = [b for b in blocks if not name or b.startswith(f"{name}.")]
        wrapped = _is_optimized(region)
        ctx = context if not name else None
        if ctx is None:
            ctx = region.dynamo_ctx if wrapped else _context_of(region._compiled_call_impl)
        if ctx is None or len(inside) < 2:
            continue  # a region without the model's blocks stays compiled, as one layer
        if wrapped:
            region.forward = region._orig_mod.__call__
        else:
            region._compiled_call_impl = None
        for block in inside:
            _compile(model.get_submodule(block), ctx, {})
        done[name] = inside
    return done
