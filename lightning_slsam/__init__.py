"""lightning-slsam: Sparse Layer Sharpness-Aware Minimization for PyTorch Lightning.

Add :class:`SAMMixin` to a LightningModule's bases and a method callback to the Trainer:
:class:`SparseLayerSAM` (SL-SAM), or any baseline of the SL-SAM paper's comparison
(:class:`SAM`, :class:`RandomSLSAM`, :class:`TopSLSAM`, :class:`S2SAM`, :class:`SLS2SAM`,
:class:`RST`, :class:`ESAM`, :class:`SSAMF`, :class:`LookSAM`; :func:`make_callback` by
name). In a Lightning Fabric loop, :class:`FabricSAM` runs any of them over the model and
optimizer that ``fabric.setup`` returned. The pure-PyTorch parts (:class:`LayerBandit`,
:class:`SparseSAMEngine`, :func:`build_partition`, the method specifications of
:mod:`lightning_slsam.methods.spec`) also work in a plain training loop:
``import lightning_slsam`` loads only them (and torch); the Lightning layer loads when one
of its names is first used.
"""

from typing import TYPE_CHECKING, Any

from lightning_slsam.core.engine import PassOutput, SparseSAMEngine, StepResult
from lightning_slsam.core.partition import LayerPartition, build_partition, find_new_head
from lightning_slsam.core.perturbation import FisherMask, SAMPerturbation
from lightning_slsam.core.schedules import (
    EveryStep,
    IntervalSchedule,
    RandomSchedule,
    SingleStepSchedule,
)
from lightning_slsam.methods.registry import SPECS, make_engine, method_spec, register_method
from lightning_slsam.methods.spec import MethodSpec
from lightning_slsam.methods.subset import PRESETS
from lightning_slsam.parallel.ddp import release_process_group

# The pure-PyTorch core, imported with the package (torch only).
from lightning_slsam.selection.bandit import LayerBandit, kl_projection
from lightning_slsam.selection.rules import (
    AllLayers,
    ExpandToAll,
    LayerSelection,
    TopKSelection,
    UniformSelection,
    WrappedSelection,
)
from lightning_slsam.selection.wrappers import DenseWarmup, DepthCut

# The Lightning layer, imported on first use: importing Lightning pulls in torchmetrics, and
# with it transformers and matplotlib when they are installed. ``import lightning_slsam``
# stays light for plain-PyTorch users; ``from lightning_slsam import SparseLayerSAM`` (or a
# CLI class path) loads it.
_LIGHTNING_MODULES = (
    "lightning_slsam.lightning.callbacks",
    "lightning_slsam.lightning.callback",
    "lightning_slsam.lightning.mixin",
    "lightning_slsam.lightning.fabric",
)

if TYPE_CHECKING:
    from lightning_slsam.lightning.callback import SAMCallback, estimated_stepping_batches
    from lightning_slsam.lightning.callbacks import (
        ESAM,
        METHODS,
        RST,
        S2SAM,
        SAM,
        SLS2SAM,
        SSAMF,
        LookSAM,
        RandomSLSAM,
        SparseLayerSAM,
        TopSLSAM,
        make_callback,
        make_callbacks,
    )
    from lightning_slsam.lightning.fabric import FabricSAM
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


__version__ = "0.2.0"

__all__ = [
    "ESAM",
    "METHODS",
    "PRESETS",
    "RST",
    "S2SAM",
    "SAM",
    "SLS2SAM",
    "SPECS",
    "SSAMF",
    "AllLayers",
    "DenseWarmup",
    "DepthCut",
    "EveryStep",
    "ExpandToAll",
    "FabricSAM",
    "FisherMask",
    "IntervalSchedule",
    "LayerBandit",
    "LayerPartition",
    "LayerSelection",
    "LookSAM",
    "MethodSpec",
    "PassOutput",
    "RandomSLSAM",
    "RandomSchedule",
    "SAMCallback",
    "SAMMixin",
    "SAMPerturbation",
    "SingleStepSchedule",
    "SparseLayerSAM",
    "SparseSAMEngine",
    "StepResult",
    "TopKSelection",
    "TopSLSAM",
    "UniformSelection",
    "WrappedSelection",
    "__version__",
    "build_partition",
    "estimated_stepping_batches",
    "find_new_head",
    "kl_projection",
    "make_callback",
    "make_callbacks",
    "make_engine",
    "method_spec",
    "register_method",
    "release_process_group",
]
