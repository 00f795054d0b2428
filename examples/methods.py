"""Method combinations the measurements run that the package does not ship, each with its
callback class for a YAML config (``class_path: examples.methods.SLSAMSAF``); known by name
inside :func:`registered` (``python -m examples.compare`` runs inside it), so that importing
this module leaves the package's registry as it is. A combination that earns its place moves
into the package.

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

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

from lightning_slsam.lightning.callbacks import SparseLayerSAM, register_callback
from lightning_slsam.lightning.signatures import options_class
from lightning_slsam.methods.registry import SPECS, register_method
from lightning_slsam.methods.saf import SAFOptions, SAFSpec
from lightning_slsam.methods.slsam import SLSAMSpec

__all__ = ["SLSAMSAF", "SLSAMSAFSpec", "registered"]


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


#: The combinations, each with its callback class.
COMBINATIONS = ((SLSAMSAFSpec, SLSAMSAF),)


@contextmanager
def registered() -> Iterator[None]:
    """The combinations known by name (``make_callback``, ``--methods``) inside the block.

    >>> from lightning_slsam import METHODS
    >>> with registered():
    ...     METHODS["slsam_saf"][0] is SLSAMSAF
    True
    >>> "slsam_saf" in METHODS
    False
    """
    added = [spec for spec, _ in COMBINATIONS if spec.name not in SPECS]
    for spec in added:
        register_method(spec)
    try:
        yield
    finally:
        for spec in added:
            del SPECS[spec.name]
