"""Which parameter tensors form each sampled layer (:func:`build_partition`), and the per-step
freezing (:class:`LayerFreezer`): inactive layers get ``requires_grad=False`` before the forward.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lightning_slsam.core.perturbation import group_norms, is_weight_name
from lightning_slsam.parallel.shards import fsdp_modules, reshard

GroupingFn = Callable[[str, nn.Parameter], Hashable | None]
LayerSpec = str | Sequence[str] | GroupingFn

__all__ = ["LayerFreezer", "LayerPartition", "build_partition", "by_position", "describe_change",
           "find_new_head"]  # fmt: skip


@dataclass
class LayerPartition:
    """The result of partitioning a model's trainable parameters.

    Attributes:
        names: one name per sampled layer (bandit arm), in model order.
        params: for each sampled layer, its parameter tensors.
        param_names: for each sampled layer, the names of its tensors.
        always_active, always_active_names: tensors trained every step (not sampled), names.
        always_frozen, always_frozen_names: tensors never trained while in use, names.
        numel: parameter count of each sampled layer.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> partition = build_partition(net, layers="module")
        >>> partition.names, partition.numel, partition.num_layers
        (['0', '1'], [40, 18], 2)
        >>> partition.trainable_numel
        58
    """

    names: list[str]
    params: list[list[nn.Parameter]]
    param_names: list[list[str]]
    always_active: list[nn.Parameter] = field(default_factory=list)
    always_active_names: list[str] = field(default_factory=list)
    always_frozen: list[nn.Parameter] = field(default_factory=list)
    always_frozen_names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.numel = [sum(p.numel() for p in group) for group in self.params]
        self.flat_params: list[nn.Parameter] = [p for group in self.params for p in group]

    @property
    def num_layers(self) -> int:
        """Number of sampled layers (bandit arms)."""
        return len(self.names)

    @property
    def trainable_numel(self) -> int:
        """Parameters that take part in training: sampled plus always-active ones."""
        return sum(self.numel) + sum(p.numel() for p in self.always_active)

    def signature(self) -> list[list[str]]:
        """Names of every layer's tensors: compared on resume to detect a changed model."""
        return [list(group) for group in self.param_names]

    def tensor_names(self) -> list[str]:
        """The names of :meth:`LayerFreezer.tensors`, in its order (always-active first)."""
        return [*self.always_active_names, *(n for group in self.param_names for n in group)]


def _group_key(
    name: str, param: nn.Parameter, layers: LayerSpec, patterns: list[re.Pattern[str]]
) -> Hashable:
    if isinstance(layers, str):
        if layers == "tensor":
            return name
        # "module": the owning module's qualified name; top-level parameters stand alone.
        return name.rsplit(".", 1)[0] if "." in name else name
    if patterns:
        for pattern in patterns:
            match = pattern.search(name)
            if match is not None:
                return match.group(1) if pattern.groups else match.group(0)
        return name
    key = layers(name, param)  # type: ignore[operator]
    return name if key is None else key


def _compile(patterns: Sequence[str], parameter: str) -> list[re.Pattern[str]]:
    if isinstance(patterns, str):
        raise ValueError(
            f"`{parameter}` must be a list of regular expressions, got the string {patterns!r}."
            f" Wrap it in a list: {parameter}=[{patterns!r}]."
        )
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as err:
            raise ValueError(
                f"`{parameter}` has an invalid regular expression {pattern!r}: {err}."
            ) from err
    return compiled


def build_partition(model: nn.Module, layers: LayerSpec = "tensor",
                    always_active: Sequence[str] = (), always_frozen: Sequence[str] = (),
                    regions: Sequence[str] = ()) -> LayerPartition:  # fmt: skip
    """Partition ``model``'s trainable parameters into sampled layers.

    Args:
        model: the module; only parameters with ``requires_grad=True`` take part (tied once).
        layers: ``"tensor"`` (default: one layer per tensor), ``"module"`` (the tensors a
            module owns directly), regular expressions (a match, or its first group, names
            the layer; unmatched tensors stand alone) or ``(name, param) -> key | None``.
        always_active: regexes (``re.search`` on the name) of tensors trained every step.
        always_frozen: regular expressions of tensors never trained while SL-SAM runs.
        regions: submodule names whose tensors form one layer each (compiled regions).

    Returns:
        The :class:`LayerPartition`, layers in ``model.named_parameters()`` order.

    Raises:
        ValueError: for an invalid, unmatched or overlapping pattern, or nothing to sample.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(
        ...     torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> build_partition(net).names  # one layer per tensor (the paper's setting)
        ['0.weight', '0.bias', '2.weight', '2.bias']
        >>> part = build_partition(net, layers="module", always_active=[r"^2\\."])
        >>> part.names, part.always_active_names
        (['0'], ['2.weight', '2.bias'])
        >>> build_partition(net, always_frozen=["head"])
        Traceback (most recent call last):
        ...
        ValueError: `always_frozen` pattern(s) ['head'] match no trainable parameter. ...
    """
    if isinstance(layers, str) and layers not in ("tensor", "module"):
        raise ValueError(
            f"`layers` must be 'tensor', 'module', patterns or a callable, got {layers!r}."
        )
    active_patterns = _compile(always_active, "always_active")
    frozen_patterns = _compile(always_frozen, "always_frozen")
    group_patterns = (
        _compile(layers, "layers") if not isinstance(layers, str) and not callable(layers) else []
    )

    reshard(fsdp_modules(model))  # FSDP2: the sharded parameters, even after an evaluation
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(
            "The model has no trainable parameters (every parameter has requires_grad=False)."
            " SL-SAM trains a subset of the trainable parameters: unfreeze at least one."
        )

    used_active = [False] * len(active_patterns)
    used_frozen = [False] * len(frozen_patterns)
    groups: dict[Hashable, tuple[list[str], list[nn.Parameter]]] = {}
    partition_active: tuple[list[nn.Parameter], list[str]] = ([], [])
    partition_frozen: tuple[list[nn.Parameter], list[str]] = ([], [])
    for name, param in trainable:
        hit_active = [i for i, pat in enumerate(active_patterns) if pat.search(name)]
        hit_frozen = [i for i, pat in enumerate(frozen_patterns) if pat.search(name)]
        for i in hit_active:
            used_active[i] = True
        for i in hit_frozen:
            used_frozen[i] = True
        if hit_active and hit_frozen:
            raise ValueError(
                f"Parameter {name!r} matches both `always_active`"
                f" ({always_active[hit_active[0]]!r}) and `always_frozen`"
                f" ({always_frozen[hit_frozen[0]]!r}); make the patterns disjoint."
            )
        if hit_active:
            partition_active[0].append(param)
            partition_active[1].append(name)
            continue
        if hit_frozen:
            partition_frozen[0].append(param)
            partition_frozen[1].append(name)
            continue
        region = next((r for r in regions if name.startswith(f"{r}.")), None)
        key = region if region is not None else _group_key(name, param, layers, group_patterns)
        names, params = groups.setdefault(key, ([], []))
        names.append(name)
        params.append(param)

    for option, patterns, used in (
        ("always_active", always_active, used_active),
        ("always_frozen", always_frozen, used_frozen),
    ):
        unused = [p for p, u in zip(patterns, used) if not u]
        if unused:
            raise ValueError(
                f"`{option}` pattern(s) {unused} match no trainable parameter. Parameter names"
                f" look like {[n for n, _ in trainable[:3]]}; check the spelling."
            )
    if not groups:
        raise ValueError(
            "Every trainable parameter is excluded by `always_active` / `always_frozen`:"
            " no layer is left to sample. Narrow those patterns."
        )

    return LayerPartition(
        names=[str(key) for key in groups],
        params=[params for _, params in groups.values()],
        param_names=[names for names, _ in groups.values()],
        always_active=partition_active[0],
        always_active_names=partition_active[1],
        always_frozen=partition_frozen[0],
        always_frozen_names=partition_frozen[1],
    )


def describe_change(old: LayerPartition, new: LayerPartition, shown: int = 4) -> str:
    """What changed between two partitions of one model, in a sentence.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> _ = net[0].requires_grad_(False)
        >>> before = build_partition(net)
        >>> _ = net[0].requires_grad_(True)
        >>> print(describe_change(before, build_partition(net)))
        2 tensors became trainable and are sampled as 2 new layers (0.weight, 0.bias); 4 layers
        are sampled now.
    """

    def names(partition: LayerPartition) -> list[str]:
        return [*partition.tensor_names(), *partition.always_frozen_names]

    def listed(items: list[str]) -> str:
        more = f" and {len(items) - shown} more" if len(items) > shown else ""
        return ", ".join(items[:shown]) + more

    before, after = names(old), names(new)
    gained = [n for n in after if n not in set(before)]
    lost = [n for n in before if n not in set(after)]
    added = [n for n in new.names if n not in set(old.names)]
    removed = [n for n in old.names if n not in set(new.names)]
    parts = []
    if gained:
        parts.append(
            f"{len(gained)} tensors became trainable and are sampled as {len(added)} new"
            f" layers ({listed(gained)})"
        )
    if lost:
        parts.append(
            f"{len(lost)} tensors were frozen and {len(removed)} layers left the sampling"
            f" ({listed(lost)})"
        )
    if not parts:
        parts.append("the tensors' grouping into layers changed")
    return "; ".join(parts) + f"; {new.num_layers} layers are sampled now."


def find_new_head(model: nn.Module) -> list[str]:
    """Trainable parameter names of ``model``'s new task head (``[]``: none found): its
    ``sam_head_parameters()``, else a timm classifier with changed ``num_classes`` and a
    Transformers model's parameters outside its base model but the output embeddings.

    Example:
        >>> import timm, torch
        >>> find_new_head(timm.create_model("resnet18", pretrained=False, num_classes=10))
        ['fc.weight', 'fc.bias']
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.body, self.head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)
        ...     def sam_head_parameters(self):
        ...         return ["head.weight", "head.bias"]
        >>> find_new_head(Net()), find_new_head(torch.nn.Linear(4, 2))
        (['head.weight', 'head.bias'], [])
    """
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    hook = getattr(model, "sam_head_parameters", None)
    if callable(hook):
        wanted = set(hook())
        unknown = sorted(wanted - set(names.values()))
        if unknown:
            raise ValueError(
                f"sam_head_parameters() returned names that are not trainable parameters of"
                f" {type(model).__name__}: {unknown[:5]}."
            )
        return [n for n in names.values() if n in wanted]
    found: set[int] = set()
    for module in model.modules():
        if callable(getattr(module, "get_classifier", None)) and hasattr(module, "pretrained_cfg"):
            pretrained = (getattr(module, "pretrained_cfg", None) or {}).get("num_classes")
            current = getattr(module, "num_classes", None)
            if pretrained is not None and current is not None and pretrained != current:
                found.update(id(p) for p in module.get_classifier().parameters())
        elif hasattr(module, "config") and isinstance(
            getattr(module, "base_model", None), nn.Module
        ):
            base = module.base_model
            if base is module:
                continue
            skip = {id(p) for p in base.parameters()}
            output = (
                module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
            )
            if isinstance(output, nn.Module):
                skip.update(id(p) for p in output.parameters())
            found.update(id(p) for p in module.parameters() if id(p) not in skip)
    return [n for i, n in names.items() if i in found]


class LayerFreezer:
    """Freezes ``partition``'s layers, and maps tensors to groups (layers, then always-active).

    Example:
        >>> import torch
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
        self.num_layers = n
        flat_names = [name for group in partition.param_names for name in group]
        named = [*zip(partition.flat_params, flat_names)]
        named += [*zip(partition.always_active, partition.always_active_names)]
        self._weights = {id(p) for p, name in named if is_weight_name(name)}
        self._tracked = {id(p) for p in (*self.tensors(), *partition.always_frozen)}

    def activate(self, mask: Tensor) -> list[Tensor]:
        """Unfreeze only ``mask``'s layers and always-active tensors; return them (those first)."""
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

    def trainable_changed(self, module: torch.nn.Module) -> bool:
        """Whether ``module``'s trainable set differs from the partition's (between steps)."""
        tracked = self._tracked
        return any(p.requires_grad != (id(p) in tracked) for p in module.parameters())

    def check_owned(self, module: torch.nn.Module) -> None:
        """Raise if ``module``'s parameters were replaced after the partition was built."""
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

    def layer_norms(self, norms: Tensor, slots: Tensor) -> Tensor:
        """Per-layer L2 norms (``[num_layers]``; 0 for a layer without gradient)."""
        return group_norms(norms, slots, self.num_groups)[: self.num_layers]

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
