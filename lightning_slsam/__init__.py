"""lightning-slsam: Sparse Layer Sharpness-Aware Minimization for PyTorch Lightning.

Add :class:`SAMMixin` to a LightningModule's bases and a method callback to the Trainer:
:class:`SparseLayerSAM` (SL-SAM), or any baseline of the SL-SAM paper's comparison
(:class:`SAM`, :class:`RandomSLSAM`, :class:`TopSLSAM`, :class:`S2SAM`, :class:`SLS2SAM`,
:class:`RST`, :class:`ESAM`, :class:`SSAMF`, :class:`LookSAM`; :func:`make_callback` by
name). The pure-PyTorch parts (:class:`LayerBandit`, :class:`SparseSAMEngine`,
:func:`build_partition`) also work in a plain training loop.
"""

from lightning_slsam.bandit import LayerBandit, kl_projection
from lightning_slsam.callback import SAMCallback, estimated_stepping_batches
from lightning_slsam.engine import PassOutput, SparseSAMEngine, StepResult
from lightning_slsam.layers import LayerPartition, build_partition, find_new_head
from lightning_slsam.methods import (
    ESAM,
    METHODS,
    PRESETS,
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
from lightning_slsam.mixin import SAMMixin
from lightning_slsam.perturbation import FisherMask, SAMPerturbation
from lightning_slsam.schedules import (
    EveryStep,
    IntervalSchedule,
    RandomSchedule,
    SingleStepSchedule,
)
from lightning_slsam.selection import (
    AllLayers,
    DenseWarmup,
    DepthCut,
    ExpandToAll,
    LayerSelection,
    TopKSelection,
    UniformSelection,
)

__version__ = "0.1.0"

__all__ = [
    "ESAM",
    "METHODS",
    "PRESETS",
    "RST",
    "S2SAM",
    "SAM",
    "SLS2SAM",
    "SSAMF",
    "AllLayers",
    "DenseWarmup",
    "DepthCut",
    "EveryStep",
    "ExpandToAll",
    "FisherMask",
    "IntervalSchedule",
    "LayerBandit",
    "LayerPartition",
    "LayerSelection",
    "LookSAM",
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
    "__version__",
    "build_partition",
    "estimated_stepping_batches",
    "find_new_head",
    "kl_projection",
    "make_callback",
    "make_callbacks",
]
