"""lightning-slsam: Sparse Layer Sharpness-Aware Minimization for PyTorch Lightning.

Add :class:`SAMMixin` to a LightningModule's bases and a method callback to the Trainer:
:class:`SparseLayerSAM` (SL-SAM), or any method of the SL-SAM paper's comparison (:class:`SAM`,
:class:`RandomSLSAM`, :class:`TopSLSAM`, :class:`S2SAM`, :class:`SLS2SAM`, :class:`RST`,
:class:`ESAM`, :class:`SSAMF`, :class:`LookSAM`), the one-gradient methods (:class:`MomentumSAM`,
:class:`ARWP`, :class:`MESA`, :class:`SAF`) and the combinations beyond the paper
(:class:`SLSAMRST`, :class:`SLSAMLookSAM`, :class:`CostAwareSLSAM`); :func:`make_callback` by name.
In a Lightning Fabric loop, :class:`FabricSAM` runs any of them over the model and optimizer that
``fabric.setup`` returned; in a plain PyTorch loop, :func:`make_engine`. :class:`ForgettingMonitor`
logs how much a language model forgets while it is fine-tuned.

A method of one's own is a :class:`MethodSpec` (or :class:`LayerSubsetSpec`) subclass,
often with a :class:`LayerSelection` rule, added by :func:`register_method` and shelled by a
:class:`SAMCallback` subclass. Everything else is imported from its module
(``lightning_slsam.core``, ``.selection``, ``.methods``, ``.parallel``, ``.lightning``).

``import lightning_slsam`` loads only the pure-PyTorch part (and torch); the Lightning layer
loads when one of its names is first used.
"""

from typing import TYPE_CHECKING, Any

from lightning_slsam.methods.registry import make_engine, register_method
from lightning_slsam.methods.spec import LayerSubsetSpec, MethodSpec
from lightning_slsam.selection.rules import LayerSelection

# The Lightning layer, imported on first use: Lightning pulls in torchmetrics, and with it
# transformers and matplotlib when they are installed.
_LIGHTNING_MODULES = (
    "lightning_slsam.lightning.callbacks",
    "lightning_slsam.lightning.callback",
    "lightning_slsam.lightning.mixin",
    "lightning_slsam.lightning.fabric",
    "lightning_slsam.lightning.forgetting",
)

if TYPE_CHECKING:
    from lightning_slsam.lightning.callback import SAMCallback
    from lightning_slsam.lightning.callbacks import (
        ARWP,
        ESAM,
        MESA,
        METHODS,
        RST,
        S2SAM,
        SAF,
        SAM,
        SLS2SAM,
        SLSAMRST,
        SSAMF,
        CostAwareSLSAM,
        LookSAM,
        MomentumSAM,
        RandomSLSAM,
        SLSAMLookSAM,
        SparseLayerSAM,
        TopSLSAM,
        make_callback,
    )
    from lightning_slsam.lightning.fabric import FabricSAM
    from lightning_slsam.lightning.forgetting import ForgettingMonitor
    from lightning_slsam.lightning.mixin import SAMMixin


def __getattr__(name: str) -> Any:
    # A public name not imported above is one of the Lightning layer's: load its module.
    if name in __all__:
        import importlib

        for module in map(importlib.import_module, _LIGHTNING_MODULES):
            if name in module.__all__:
                globals()[name] = value = getattr(module, name)
                return value
    raise AttributeError(f"module 'lightning_slsam' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__version__ = "0.3.0.dev0"

#: The user API (the module mixin, the method callbacks, the front-ends) and the documented
#: extension points (a method's specification, its selection rule, its callback shell).
__all__ = [
    "ARWP",
    "ESAM",
    "MESA",
    "METHODS",
    "RST",
    "S2SAM",
    "SAF",
    "SAM",
    "SLS2SAM",
    "SLSAMRST",
    "SSAMF",
    "CostAwareSLSAM",
    "FabricSAM",
    "ForgettingMonitor",
    "LayerSelection",
    "LayerSubsetSpec",
    "LookSAM",
    "MethodSpec",
    "MomentumSAM",
    "RandomSLSAM",
    "SAMCallback",
    "SAMMixin",
    "SLSAMLookSAM",
    "SparseLayerSAM",
    "TopSLSAM",
    "__version__",
    "make_callback",
    "make_engine",
    "register_method",
]
