"""Which tensors take part in a step: per-step freezing over a :class:`LayerPartition`.

Layers outside the active set get ``requires_grad=False`` before each forward, so autograd
builds no weight-gradient work for them, their ``.grad`` stays ``None`` and the optimizer
leaves them (and their state) untouched.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_slsam.core.partition import LayerPartition
from lightning_slsam.core.perturbation import group_norms, is_weight_name
from lightning_slsam.parallel.fsdp2 import shard_layout

__all__ = ["LayerFreezer"]


class LayerFreezer:
    """Freezes and unfreezes the layers of ``partition``, and maps tensors to their layer.

    Normalisation groups (the perturbation's ``"layer"`` norm, the per-layer gradient
    norms): one per layer, then one per always-active tensor.

    Example:
        >>> import torch
        >>> from lightning_slsam.core.partition import build_partition
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> freezer = LayerFreezer(build_partition(net))
        >>> active = freezer.activate(torch.tensor([True, False, False, False]))
        >>> [p.requires_grad for p in net.parameters()]
        [True, False, False, False]
        >>> freezer.release(); all(p.requires_grad for p in net.parameters())
        True
    """

    def __init__(self, partition: LayerPartition) -> None:
        self.partition = partition
        n = partition.num_layers
        self.all = torch.ones(n, dtype=torch.bool)
        self._layer_numel = torch.tensor(partition.numel, dtype=torch.int64)
        self._always_numel = sum(p.numel() for p in partition.always_active)
        self._slot = {id(p): i for i, group in enumerate(partition.params) for p in group}
        self._slot.update({id(p): n + j for j, p in enumerate(partition.always_active)})
        self.num_groups = n + len(partition.always_active)
        #: Whether the tensors are FSDP2 shards (their gradients arrive averaged).
        self.sharded = shard_layout(partition.flat_params) is not None
        # ASAM scales weight tensors only (biases are perturbed unscaled).
        flat_names = [name for group in partition.param_names for name in group]
        named = [*zip(partition.flat_params, flat_names)]
        named += [*zip(partition.always_active, partition.always_active_names)]
        self._weights = {id(p) for p, name in named if is_weight_name(name)}

    def activate(self, mask: Tensor) -> list[Tensor]:
        """Make exactly the layers in ``mask`` (plus always-active tensors) trainable.

        Returns the active tensors, always-active ones first.
        """
        partition = self.partition
        active: list[Tensor] = list(partition.always_active)
        for param in partition.always_active:
            param.requires_grad_(True)
        for param in partition.always_frozen:
            param.requires_grad_(False)
        for on, group in zip(mask.tolist(), partition.params):
            for param in group:
                if param.requires_grad != on:
                    param.requires_grad_(on)
            if on:
                active.extend(group)
        return active

    def release(self) -> None:
        """Make every partition tensor trainable again (the state outside a step)."""
        for param in self.partition.flat_params:
            if not param.requires_grad:
                param.requires_grad_(True)
        for param in self.partition.always_frozen:
            param.requires_grad_(True)

    def check_owned(self, module: torch.nn.Module) -> None:
        """Raise if ``module`` no longer owns the partition's tensors: its parameters were
        replaced after the partition was built (``fully_shard`` applied afterwards)."""
        owned = {id(p) for p in module.parameters()}
        if any(id(p) not in owned for p in self.partition.flat_params):
            raise RuntimeError(
                "The model's parameters were replaced after the SAM engine was built (for"
                " example by fully_shard or a reload): build the engine after sharding."
            )

    def numel(self, mask: Tensor) -> int:
        """Parameters trained with the layers in ``mask`` (always-active ones included)."""
        return int(self._layer_numel[mask].sum()) + self._always_numel

    def slots(self, params: list[Tensor]) -> Tensor:
        """Each tensor's normalisation group."""
        return torch.tensor([self._slot[id(p)] for p in params], dtype=torch.long)

    def with_grad(self, active: list[Tensor]) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Active tensors that received a gradient, their grads and group slots.

        A sampled tensor the forward did not use has ``grad=None``: it counts as norm 0.
        """
        params = [p for p in active if p.grad is not None]
        return params, [p.grad for p in params], self.slots(params)  # type: ignore[misc]

    def layer_norms(self, norms: Tensor, slots: Tensor) -> Tensor:
        """Per-layer L2 norms (``[num_layers]``; 0 for a layer without gradient)."""
        return group_norms(norms, slots, self.num_groups)[: self.partition.num_layers]

    def weight_flags(self, params: list[Tensor]) -> list[bool]:
        """Which of ``params`` are weights (ASAM scales those, not biases)."""
        return [id(p) in self._weights for p in params]

    def tensors(self) -> list[Tensor]:
        """Every partition tensor in a fixed order: the index checkpoints store state by."""
        return list(self.partition.always_active) + list(self.partition.flat_params)

    def tensor_index(self) -> dict[int, int]:
        return {id(t): i for i, t in enumerate(self.tensors())}


def by_position(saved: dict[int, Tensor], tensors: list[Tensor]) -> dict[int, Tensor]:
    """Per-tensor state saved by position, keyed again by the tensors' ids."""
    return {id(tensors[i]): v.to(tensors[i].device) for i, v in saved.items()}
