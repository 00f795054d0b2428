"""Methods the measurements run that the package does not ship, each with its callback class
for a YAML config (``class_path: examples.methods.SLSAMSAF``); known by name inside
:func:`registered` (``python -m examples.compare`` runs inside it), so that importing this
module leaves the package's registry as it is. A method that earns its place moves into the
package.

* ``slsam_ablation`` (:class:`SLSAMAblation`): SL-SAM with each setting of its presets given
  alone (``--option x.budget=count``), for measuring each part of a preset; users choose a
  ``preset`` of :class:`~lightning_slsam.SparseLayerSAM`.

* ``slsam_saf`` (:class:`SLSAMSAF`): SAF's consistency term on the layers SL-SAM's bandit
  draws, one pass per step on the drawn layers only: below AdamW's price when the drawn
  layers are few. Its control is SL-SAM at a vanishing radius (the sparse updates alone).

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
>>> engine = SLSAMSAFSpec(layer_ratio=0.5, delay=1, start_epoch=0).build_engine(net, seed=0)
>>> opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
>>> x, y, index = torch.randn(8, 4), torch.randint(0, 3, (8,)), torch.arange(8)
>>> def loss():
...     logits = net(x)
...     losses = torch.nn.functional.cross_entropy(logits, y, reduction="none")
...     return {"loss": losses, "logits": logits, "index": index}
>>> r = engine.train_step(loss, opt)
>>> r.kind, len(r.pass_numel), r.pass_numel[0] < sum(p.numel() for p in net.parameters())
('plain', 1, True)
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lightning_slsam.core.partition import LayerPartition, find_new_head
from lightning_slsam.lightning.callbacks import SparseLayerSAM, register_callback
from lightning_slsam.lightning.signatures import options_class
from lightning_slsam.methods.options import FLAG, number, one_of
from lightning_slsam.methods.registry import SPECS, register_method
from lightning_slsam.methods.saf import SAFOptions, SAFSpec
from lightning_slsam.methods.slsam import SLSAMOptions, SLSAMSpec
from lightning_slsam.methods.spec import Setting, Warn, option
from lightning_slsam.selection.bandit import DEFAULT_ALPHA

__all__ = [
    "SLSAMSAF",
    "SLSAMAblation",
    "SLSAMAblationSpec",
    "SLSAMSAFSpec",
    "registered",
]


@dataclass(kw_only=True, eq=False)
class SLSAMSAFSpec(SLSAMSpec, SAFSpec):
    """SL-SAM's draw with SAF's step: one pass on the drawn layers, the loss plus SAF's term.

    Args:
        weight: SAF's term's weight (default 0.3). The other options: SL-SAM's and SAF's.
    """

    name: ClassVar[str] = "slsam_saf"
    label: ClassVar[str] = "SLSAMSAF"


@register_callback
@options_class
class SLSAMSAF(SparseLayerSAM, SAFOptions):
    """:class:`SLSAMSAFSpec` as a Lightning callback (``examples.methods.SLSAMSAF``)."""

    spec_class = SLSAMSAFSpec


@dataclass(kw_only=True, eq=False)
class SLSAMAblationOptions(SLSAMOptions):
    """SLSAMAblation's options.

    Args:
        budget: ``"count"`` (drawn layers, the paper's) or ``"compute"`` (their parameters).
        bandit_loss: ``"shifted"`` (released code), ``"paper"`` (Algorithm 2) or ``"rank"``.
        alpha_p: the bandit's step size (>= 0); ``None`` with a loss given: that loss's
            own (1e-3 for ``"shifted"`` and ``"paper"``, 0.03 for ``"rank"``).
        head_always_active: train the fresh task head every step.
        max_update_scale: the cap on each drawn layer's update factor ``1 / q`` (>= 1; 1
            disables the scaling).
    """

    budget: str | None = option(None, one_of(("count", "compute")).or_none(" (the preset's)"))
    bandit_loss: str | None = option(
        None, one_of(("shifted", "paper", "rank")).or_none(" (the preset's)")
    )
    alpha_p: float | None = option(None, number(0).or_none(" (the preset's or the loss's)"))
    head_always_active: bool | None = option(None, FLAG.or_none(" (the preset's)"))
    max_update_scale: float | None = option(None, number(1).or_none(" (the preset's)"))


@dataclass(kw_only=True, eq=False)
class SLSAMAblationSpec(SLSAMAblationOptions, SLSAMSpec):
    """SL-SAM with its preset's settings overridable one by one (``None``: the preset's)."""

    name: ClassVar[str] = "slsam_ablation"
    label: ClassVar[str] = "SLSAMAblation"

    def setting(self, name: Setting) -> Any:
        given = getattr(self, name)
        if given is not None:
            return given
        if name == "alpha_p" and self.bandit_loss is not None:
            return DEFAULT_ALPHA[self.bandit_loss]
        return super().setting(name)

    def partition(self, module: torch.nn.Module, warn: Warn = warnings.warn) -> LayerPartition:
        if self.head_always_active and not find_new_head(module):
            warn(
                f"{self.label}(head_always_active=True) found no freshly initialised head"
                f" in {type(module).__name__}; every layer is sampled. Name the head with"
                " `always_active` or a `sam_head_parameters()` method."
            )
        return super().partition(module, warn)


@register_callback
@options_class
class SLSAMAblation(SparseLayerSAM, SLSAMAblationOptions):
    """:class:`SLSAMAblationSpec` as a Lightning callback (``examples.methods.SLSAMAblation``).

    Example:
        >>> SLSAMAblation(preset="paper", bandit_loss="rank").spec.setting("alpha_p")
        0.03
    """

    spec_class = SLSAMAblationSpec


#: The methods of this module.
SPEC_CLASSES = (SLSAMSAFSpec, SLSAMAblationSpec)


@contextmanager
def registered() -> Iterator[None]:
    """The methods of this module known by name (``make_callback``, ``--methods``) inside the block.

    >>> from lightning_slsam import METHODS
    >>> with registered():
    ...     METHODS["slsam_saf"][0] is SLSAMSAF
    True
    >>> "slsam_saf" in METHODS
    False
    """
    added = [spec.name for spec in SPEC_CLASSES if spec.name not in SPECS]
    for spec in SPEC_CLASSES:
        if spec.name in added:
            register_method(spec)
    try:
        yield
    finally:
        for name in added:
            del SPECS[name]
