"""FSDP2 for the recipes' models: ``fully_shard`` per block, and the whole weights back.

Lightning's ``ModelParallelStrategy`` calls the module's ``configure_model`` with a device
mesh; a recipe model shards itself there with :func:`fully_shard_blocks`, which is also
what a user's own ``configure_model`` can call. The SAM callbacks build their engine after
``configure_model``, on the sharded parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["full_state_dict", "fully_shard_blocks"]


def _block_types(model: nn.Module) -> set[str]:
    """Class names of the repeated blocks: Hugging Face's ``_no_split_modules``."""
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return names


def fully_shard_blocks(
    model: nn.Module, mesh: Any, block_types: set[str] | None = None, **fsdp_kwargs: Any
) -> int:
    """Apply FSDP2's ``fully_shard`` to every block of ``model`` and then to the model.

    Each block's parameters are gathered for its own forward and backward and freed after,
    so a process holds one block's whole weights at a time. Returns the number of blocks.

    Args:
        model: the module to shard in place.
        mesh: the data-parallel device mesh (``self.device_mesh["data_parallel"]`` in
            ``configure_model``).
        block_types: class names of the blocks; default: the model's
            ``_no_split_modules`` (Hugging Face models name their decoder layers there).
        fsdp_kwargs: passed to ``fully_shard`` (``mp_policy``, ``reshard_after_forward``).

    Raises:
        ValueError: when no block of those types is found (nothing would be sharded
            per block, and the whole model would be gathered at once).
    """
    from torch.distributed.fsdp import fully_shard

    types = _block_types(model) if block_types is None else set(block_types)
    blocks = [m for m in model.modules() if type(m).__name__ in types]
    if not blocks:
        raise ValueError(
            f"fully_shard_blocks found no block of the types {sorted(types)} in"
            f" {type(model).__name__}: pass `block_types` with the class names of its"
            " repeated layers (for example {'LlamaDecoderLayer'})."
        )
    for block in blocks:
        fully_shard(block, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return len(blocks)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole (unsharded) weights of ``model`` on the CPU. With sharded parameters this
    is a collective: every process must call it, and process 0 alone gets the weights (the
    others an empty dict), so no other process holds a whole copy."""
    if not any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)
