"""The step contract: what a step kind and a step hook work with, instead of the engine.

The engine builds one :class:`StepParts` per step and hands it to the step's kind
(:class:`~lightning_slsam.core.step_kinds.StepKind`) and to the method's hooks
(:class:`StepHook`, run before the kind). Through it they freeze and unfreeze layers
(``freezer``, :meth:`StepParts.activate`), read and refine the draw (``selection``),
perturb and restore (``perturbation``), isolate the passes from each other
(``isolation``) and end the step with :meth:`StepParts.commit`, which steps the optimizer
or skips. None of them sees the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_slsam.core.commit import finish_step
from lightning_slsam.core.contract import StepCall
from lightning_slsam.core.freezing import LayerFreezer
from lightning_slsam.core.isolation import PassIsolation
from lightning_slsam.core.perturbation import SAMPerturbation
from lightning_slsam.core.update_scaling import UpdateScaling
from lightning_slsam.selection.rules import LayerSelection

__all__ = ["StatefulPart", "StepHook", "StepParts"]


@dataclass
class StepParts:
    """One step's view of the method's parts.

    Attributes:
        freezer: which tensors take part (per-step freezing over the partition).
        selection: the layer-selection rule (already sampled this step's draw).
        perturbation: SAM's ascent and its exact undo.
        isolation: what one pass may leave behind besides gradients (BatchNorm
            statistics, dropout replay).
        step: the index of this step (the engine's ``num_steps`` before it).
        sync_first_pass: average the first pass's gradients across processes before the
            ascent.
        scaling: inverse-inclusion update scaling (``None``: off).
        record_norms: feeds a committed step's per-layer norms to the counters.
    """

    freezer: LayerFreezer
    selection: LayerSelection
    perturbation: SAMPerturbation
    isolation: PassIsolation
    step: int
    sync_first_pass: bool
    scaling: UpdateScaling | None
    record_norms: Callable[[Tensor, Tensor], None]

    def activate(self, mask: Tensor) -> list[Tensor]:
        """Make exactly the layers in ``mask`` (plus always-active tensors) trainable;
        the active tensors, always-active ones first."""
        return self.freezer.activate(mask)

    def weight_flags(self, params: list[Tensor]) -> list[bool] | None:
        """ASAM's per-tensor scaling flags (``None`` unless the perturbation is adaptive)."""
        return self.freezer.weight_flags(params) if self.perturbation.adaptive else None

    def commit(
        self,
        call: StepCall,
        first: list[Tensor],
        second: list[Tensor],
        layer_norms: Tensor,
        update_mask: Tensor,
    ) -> bool:
        """End the step: one host transfer, then the update or a skip (whether the update
        was made). See :func:`~lightning_slsam.core.commit.finish_step`."""
        return finish_step(
            call, first, second, layer_norms, update_mask, step=self.step,
            selection=self.selection, scaling=self.scaling, partition=self.freezer.partition,
            pool=self.perturbation.pool, record_norms=self.record_norms,
        )  # fmt: skip


class StatefulPart:
    """A part of a step that owns state the engine saves and loads with its own.

    Per-tensor stores are saved by the tensor's position in the partition: ``index`` maps
    ``id(tensor)`` to its position and ``tensors`` lists them by position. A value of the
    returned dict that is itself a dict with integer keys is such a store (the engine
    gathers its tensors whole under FSDP2 and shards them again on load); any other value
    is saved as it is.
    """

    def state_dict(self, index: dict[int, int]) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], tensors: list[Tensor]) -> None:
        pass


class StepHook(StatefulPart):
    """Runs before every step's kind (SSAM-F's Fisher refresh is one)."""

    def before_step(self, parts: StepParts, call: StepCall) -> None:
        raise NotImplementedError
