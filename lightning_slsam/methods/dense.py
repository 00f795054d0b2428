"""Specifications of the methods that train every layer: SAM and the efficient-SAM
baselines the SL-SAM paper compares with (S2-SAM, RST, LookSAM, ESAM, SSAM-F).

Each specification builds an engine for a plain loop; the examples of
:mod:`lightning_slsam.methods.registry` run every method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from lightning_slsam.core.perturbation import FisherMask
from lightning_slsam.core.step_kinds import SAMStep, StepKind
from lightning_slsam.core.step_parts import StepHook
from lightning_slsam.core.validation import check_ratio
from lightning_slsam.methods.esam import SharpestSamples
from lightning_slsam.methods.spec import MethodSpec
from lightning_slsam.methods.ssamf import FisherRefresh
from lightning_slsam.selection.rules import ExpandToAll, LayerSelection, UniformSelection

__all__ = ["ESAMSpec", "LookSAMSpec", "RSTSpec", "S2SAMSpec", "SAMSpec", "SSAMFSpec"]


@dataclass(kw_only=True, eq=False)
class SAMSpec(MethodSpec):
    """Vanilla SAM on every layer (AdaSAM with AdamW as the optimizer)."""


@dataclass(kw_only=True, eq=False)
class S2SAMSpec(MethodSpec):
    """S2-SAM (Algorithm 3): one pass per step at weights perturbed along the previous
    step's gradient."""

    name: ClassVar[str] = "s2sam"
    label: ClassVar[str] = "S2SAM"
    default_schedule: ClassVar[str] = "single"
    schedule_fixed: ClassVar[bool] = True


@dataclass(kw_only=True, eq=False)
class RSTSpec(MethodSpec):
    """RST: each step is a SAM step with probability ``probability``, else a plain one.

    Args:
        probability: chance of a SAM step, in [0, 1]. Paper: 0.5.
    """

    name: ClassVar[str] = "rst"
    label: ClassVar[str] = "RST"
    default_schedule: ClassVar[str] = "random"
    schedule_fixed: ClassVar[bool] = True

    probability: float = 0.5
    sam_probability: float = field(default=0.5, init=False)

    def __post_init__(self) -> None:
        self.sam_probability = self.probability
        super().__post_init__()
        self.probability = self.sam_probability


@dataclass(kw_only=True, eq=False)
class LookSAMSpec(MethodSpec):
    """LookSAM: a SAM step every ``interval`` steps; the steps in between reuse the stored
    orthogonal component with weight ``alpha``.

    Args:
        interval: steps between SAM steps, >= 1. LookSAM: 5.
        alpha: weight of the reused component, >= 0. LookSAM: 0.7.
    """

    name: ClassVar[str] = "looksam"
    label: ClassVar[str] = "LookSAM"
    default_schedule: ClassVar[str] = "interval"
    schedule_fixed: ClassVar[bool] = True

    interval: int = 5
    alpha: float = 0.7
    sam_interval: int = field(default=5, init=False)
    looksam_alpha: float = field(default=0.7, init=False)

    def __post_init__(self) -> None:
        self.sam_interval, self.looksam_alpha = self.interval, self.alpha
        super().__post_init__()
        self.alpha = self.looksam_alpha


@dataclass(kw_only=True, eq=False)
class ESAMSpec(MethodSpec):
    """ESAM: stochastic weight perturbation (a random ``weight_ratio`` of the layers is
    perturbed) and sharpness-sensitive data selection (the second pass runs on the
    ``data_ratio`` of each batch whose loss rose most).

    Args:
        weight_ratio: fraction of layers perturbed, in (0, 1]. Paper: 0.5.
        data_ratio: fraction of each batch in the second pass, in (0, 1]. Paper: 0.5.
    """

    name: ClassVar[str] = "esam"
    label: ClassVar[str] = "ESAM"

    weight_ratio: float = 0.5
    data_ratio: float = 0.5

    def __post_init__(self) -> None:
        self.weight_ratio = check_ratio("weight_ratio", self.weight_ratio)
        self.data_ratio = check_ratio("data_ratio", self.data_ratio)
        super().__post_init__()

    def selection(self, num_layers: int, generator: torch.Generator) -> LayerSelection:
        return ExpandToAll(UniformSelection(num_layers, self.weight_ratio, generator))

    def engine_steps(self) -> tuple[dict[str, StepKind], list[StepHook]]:
        if self.data_ratio == 1:
            return {}, []
        return {"sam": SAMStep(samples=SharpestSamples(self.data_ratio))}, []


@dataclass(kw_only=True, eq=False)
class SSAMFSpec(MethodSpec):
    """SSAM-F: SAM whose ascent is zeroed outside the coordinates of largest empirical
    Fisher information, keeping ``1 - sparsity`` of them.

    Args:
        sparsity: fraction of coordinates not perturbed, in [0, 1). Paper: 0.5.
        fisher_samples: per-sample gradients per refresh (capped at the batch size).
        mask_interval: optimizer steps between refreshes (the first step included).
    """

    name: ClassVar[str] = "ssamf"
    label: ClassVar[str] = "SSAMF"

    sparsity: float = 0.5
    fisher_samples: int = 16
    mask_interval: int = 100

    def __post_init__(self) -> None:
        FisherMask(self.sparsity, self.fisher_samples, self.mask_interval)  # validates now
        self.sparsity = float(self.sparsity)
        super().__post_init__()

    def engine_steps(self) -> tuple[dict[str, StepKind], list[StepHook]]:
        refresh = FisherRefresh(FisherMask(self.sparsity, self.fisher_samples, self.mask_interval))
        return {"sam": SAMStep(ascent_masks=refresh)}, [refresh]
