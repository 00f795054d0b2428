"""A method's checkpoint state for every front-end: :func:`method_state` saves it,
:func:`apply_method_state` restores it once checked (else :class:`CheckpointMismatch`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_slsam.core.engine import SAMEngine
from lightning_slsam.core.partition import LayerPartition

__all__ = ["CheckpointMismatch", "apply_method_state", "check_saved_layers", "differs_by_trainable",
           "method_state"]  # fmt: skip


class CheckpointMismatch(ValueError):
    """A checkpoint's method state was saved for other layers than the model's."""


def method_state(method: str, spec: Any, engine: SAMEngine) -> dict[str, Any]:
    """A checkpoint's SAM state: ``method``, ``spec``'s options, ``engine``'s state and layers."""
    partition = engine.partition
    return {
        "method": method,
        "engine": engine.state_dict(),
        "layer_names": partition.names,
        "layer_tensors": partition.signature(),
        "tensor_names": partition.tensor_names(),
        "config": spec.hyperparameters(),
    }


def apply_method_state(state: dict[str, Any], engine: SAMEngine, *, owner: str,
                       spec: Any, warn: Callable[[str], Any],
                       preset: str | None = None) -> None:  # fmt: skip
    """Restore :func:`method_state`'s output into ``engine`` once checked to fit its layers."""
    partition = engine.partition
    saved, current = state.get("layer_tensors"), partition.signature()
    engine_state = dict(state["engine"])
    if differs_by_trainable(state, partition):
        engine_state = engine.carry_state(engine_state, state["layer_names"],
                                          state["tensor_names"])  # fmt: skip
        old = [n for group in saved for n in group]
        new = [n for group in current for n in group]
        warn(
            f"The checkpoint's {owner} state was saved with"
            f" {len(saved)} sampled layers and the model now has {len(current)}:"
            f" {_changed_tensors(old, new)}. The layers on both sides resume their state;"
            " a new one starts afresh. (Lightning's BackboneFinetuning resumed after its"
            " unfreeze epoch leaves the backbone frozen: unfreeze it again to train it.)"
        )
    else:
        saved_preset = (state.get("config") or {}).get("preset")
        check_saved_layers(owner, saved, current, preset=preset, saved_preset=saved_preset)
    engine_state["selection"] = spec.adopt_selection_state(
        engine_state["selection"], engine.selection.state_dict(), warn
    )
    engine.load_state_dict(engine_state)


def differs_by_trainable(state: dict[str, Any], partition: LayerPartition) -> bool:
    """Whether a checkpoint's layers differ from ``partition``'s by trainable tensors only."""
    saved = state.get("layer_tensors")
    if saved is None or saved == partition.signature():
        return False
    if "tensor_names" not in state or "layer_names" not in state:
        return False
    saved = {n: layer for layer, group in zip(state["layer_names"], saved) for n in group}
    now = {n: layer for layer, group in zip(partition.names, partition.signature())
           for n in group}  # fmt: skip
    saved_active = set(state["tensor_names"]) - set(saved)
    now_active = set(partition.always_active_names)
    shared = saved.keys() & now.keys()
    return (
        bool(shared)
        and all(saved[n] == now[n] for n in shared)
        and not (saved_active & now.keys())
        and not (now_active & saved.keys())
    )


def check_saved_layers(owner: str, saved: Any, current: list[list[str]], *,
                       preset: str | None = None,
                       saved_preset: str | None = None) -> None:  # fmt: skip
    """Raise a :class:`CheckpointMismatch` if ``saved`` layers differ from ``current``."""
    if saved is not None and saved != current:
        hint = ""
        if saved_preset is not None and preset is not None and saved_preset != preset:
            hint = (
                f" The checkpoint was trained with preset={saved_preset!r} and this callback"
                f" has preset={preset!r}, whose head rule places other tensors out of"
                f" sampling: resume with {owner}(preset={saved_preset!r})."
            )
        raise CheckpointMismatch(
            f"The checkpoint's {owner} state does not match this model's"
            f" layers: {_describe_mismatch(saved, current)}.{hint} Resume with the same model"
            " and `layers` / `always_active` / `always_frozen` options, or start the SAM"
            " state afresh by resuming without it."
        )


def _changed_tensors(old: list[str], new: list[str], shown: int = 4) -> str:
    gained = [n for n in new if n not in set(old)]
    lost = [n for n in old if n not in set(new)]
    parts = []
    for names, what in ((gained, "trainable now"), (lost, "frozen now")):
        if names:
            more = " and more" if len(names) > shown else ""
            parts.append(f"{len(names)} tensors {what} ({', '.join(names[:shown])}{more})")
    return "; ".join(parts)


def _describe_mismatch(saved: list[list[str]], current: list[list[str]]) -> str:
    saved_set = {name for group in saved for name in group}
    current_set = {name for group in current for name in group}
    missing = sorted(saved_set - current_set)
    added = sorted(current_set - saved_set)
    parts = [f"checkpoint has {len(saved)} layers, model has {len(current)}"]
    if missing:
        parts.append(f"missing from the model: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if added:
        parts.append(f"new in the model: {added[:5]}{' ...' if len(added) > 5 else ''}")
    if not missing and not added:
        parts.append("the same tensors are grouped into layers differently")
    return "; ".join(parts)
