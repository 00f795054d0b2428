"""State a forward pass changes besides the weights: running statistics and random streams.

SAM runs the model forward twice per step, and ESAM and SSAM-F add forwards of their own.
A BatchNorm layer in training mode updates its running mean and variance on every
forward, so by default only one of them must count; :class:`RunningStats` snapshots those
buffers and puts them back. Dropout draws a new mask on every forward;
:class:`RandomState` captures the random streams so a later pass can replay the first
pass's masks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

__all__ = ["BN_STATS", "RandomState", "RunningStats"]

#: Which pass's running statistics a SAM step keeps.
BN_STATS = ("first", "second", "both")


class RunningStats:
    """The running-statistics buffers of every normalisation layer that tracks them.

    Covers BatchNorm (1d/2d/3d, SyncBatchNorm, lazy ones) and InstanceNorm with
    ``track_running_stats=True``: ``running_mean``, ``running_var`` and
    ``num_batches_tracked``.
    """

    def __init__(self, module: nn.Module) -> None:
        self.buffers: list[Tensor] = []
        self.layers: list[nn.Module] = []
        for layer in module.modules():
            if isinstance(layer, _NormBase) and layer.track_running_stats:
                self.layers.append(layer)
                for name in ("running_mean", "running_var", "num_batches_tracked"):
                    buffer = getattr(layer, name, None)
                    if isinstance(buffer, Tensor):
                        self.buffers.append(buffer)

    def __bool__(self) -> bool:
        return bool(self.buffers)

    @torch.no_grad()
    def snapshot(self) -> list[Tensor]:
        """Copies of the buffers as they are now."""
        return [b.clone() for b in self.buffers]

    @torch.no_grad()
    def restore(self, snapshot: list[Tensor]) -> None:
        """Put the buffers back to ``snapshot`` (exactly)."""
        for buffer, saved in zip(self.buffers, snapshot):
            buffer.copy_(saved)

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """Normalise with the running statistics, leaving them untouched (any batch size,
        one sample included); the layers' training flags are restored afterwards."""
        modes = [layer.training for layer in self.layers]
        for layer in self.layers:
            layer.train(False)
        try:
            yield
        finally:
            for layer, mode in zip(self.layers, modes):
                layer.train(mode)


class RandomState:
    """The CPU random stream and, when CUDA is in use, the current device's."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = (
            torch.cuda.get_rng_state()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )

    def restore(self) -> None:
        """Rewind the streams to where they were at construction."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
