"""lightning-slsam: Sparse Layer Sharpness-Aware Minimization for PyTorch Lightning.

Add :class:`SAMMixin` to a LightningModule's bases and :class:`SparseLayerSAM` to the
Trainer's callbacks; the pure-PyTorch parts (:class:`LayerBandit`,
:class:`SparseSAMEngine`, :func:`build_partition`) also work in a plain training loop.
"""

from lightning_slsam.bandit import LayerBandit, kl_projection
from lightning_slsam.callback import SparseLayerSAM, estimated_stepping_batches
from lightning_slsam.engine import SparseSAMEngine, StepResult
from lightning_slsam.layers import LayerPartition, build_partition
from lightning_slsam.mixin import SAMMixin
from lightning_slsam.perturbation import SAMPerturbation

__version__ = "0.1.0"

__all__ = [
    "LayerBandit",
    "LayerPartition",
    "SAMMixin",
    "SAMPerturbation",
    "SparseLayerSAM",
    "SparseSAMEngine",
    "StepResult",
    "__version__",
    "build_partition",
    "estimated_stepping_batches",
    "kl_projection",
]
