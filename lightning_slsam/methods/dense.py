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
from lightning_slsam.core.validation import RATIO, number
from lightning_slsam.methods.esam import SharpestSamples
from lightning_slsam.methods.spec import MethodSpec, option
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

    schedule: str = field(default="single", init=False)


@dataclass(kw_only=True, eq=False)
class RSTSpec(MethodSpec):
    """RST: each step is a SAM step with probability ``probability``, else a plain one.

    Args:
        probability: chance of a SAM step, in [0, 1]. Paper: 0.5.
    """

    name: ClassVar[str] = "rst"
    label: ClassVar[str] = "RST"
    renamed: ClassVar[dict[str, str]] = {"sam_probability": "probability"}

    probability: float = option(0.5, number(0, 1))
    schedule: str = field(default="random", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sam_probability = self.probability  # what the "random" schedule reads


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
    renamed: ClassVar[dict[str, str]] = {"sam_interval": "interval", "looksam_alpha": "alpha"}

    interval: int = option(5, number(1, integer=True))
    alpha: float = option(0.7, number(0))
    schedule: str = field(default="interval", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        # What the "interval" schedule and the reuse step read.
        self.sam_interval, self.looksam_alpha = self.interval, self.alpha


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
    samples_layers: ClassVar[bool] = True

    weight_ratio: float = option(0.5, RATIO)
    data_ratio: float = option(0.5, RATIO)

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

    sparsity: float = option(0.5, number(0, 1, high_open=True))
    fisher_samples: int = option(16, number(1, integer=True))
    mask_interval: int = option(100, number(1, integer=True))

    def engine_steps(self) -> tuple[dict[str, StepKind], list[StepHook]]:
        refresh = FisherRefresh(FisherMask(self.sparsity, self.fisher_samples, self.mask_interval))
        return {"sam": SAMStep(ascent_masks=refresh)}, [refresh]
