"""What one pass of a SAM step may leave behind besides gradients (:class:`PassIsolation`):
running statistics (:class:`RunningStats`) and dropout masks (:func:`random_state`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

__all__ = ["BN_STATS", "PassIsolation", "RunningStats", "StepIsolation", "evaluating",
           "random_state", "restore_random_state"]  # fmt: skip

#: Which pass's running statistics a SAM step keeps.
BN_STATS = ("first", "second", "both")


class RunningStats:
    """The running-statistics buffers of every norm layer with ``track_running_stats``."""

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
        """Normalise with the running statistics, leaving them untouched (modes restored after)."""
        modes = [layer.training for layer in self.layers]
        for layer in self.layers:
            layer.train(False)
        try:
            yield
        finally:
            for layer, mode in zip(self.layers, modes):
                layer.train(mode)


@contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """``module`` in evaluation mode, every submodule's mode restored afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.train(mode)


def random_state() -> tuple[Tensor, Tensor | None]:
    """The CPU random stream's state and, when CUDA is in use, the current device's."""
    cpu = torch.get_rng_state()
    in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
    return cpu, torch.cuda.get_rng_state() if in_use else None


def restore_random_state(state: tuple[Tensor, Tensor | None]) -> None:
    """Rewind the streams to ``state`` (from :func:`random_state`)."""
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


class PassIsolation:
    """What one pass of a SAM step may leave behind besides gradients.

    Args:
        stats: the model's running statistics (``None`` or empty: nothing to manage).
        bn_stats: which pass's statistics the step keeps: ``"first"``, ``"second"``, ``"both"``.
        replay_dropout: the second pass replays the first pass's random streams.
    """

    def __init__(self, stats: RunningStats | None, bn_stats: str, replay_dropout: bool) -> None:
        self.stats = stats if stats else None
        self.bn_stats = bn_stats
        self.replay_dropout = bool(replay_dropout)

    def begin(self) -> StepIsolation:
        """One SAM step's isolation; snapshots taken before its first pass."""
        stats = self.stats
        return StepIsolation(
            stats,
            before=stats.snapshot() if stats and self.bn_stats == "second" else None,
            rng=random_state() if self.replay_dropout else None,
            keep_first=self.bn_stats == "first",
        )

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """Forwards that use the running statistics and leave them untouched."""
        with self.stats.evaluating() if self.stats else nullcontext():
            yield


@dataclass
class StepIsolation:
    """One SAM step's isolation (:meth:`PassIsolation.begin`): its snapshots and pass hooks."""

    stats: RunningStats | None
    before: list[Tensor] | None
    rng: tuple[Tensor, Tensor | None] | None  # random_state()
    keep_first: bool
    after_first: list[Tensor] | None = None

    def first_pass_done(self) -> None:
        if self.stats and self.keep_first:
            self.after_first = self.stats.snapshot()

    @contextmanager
    def extra_forward(self) -> Iterator[None]:
        """A forward that must leave neither statistics nor random streams changed."""
        if self.rng is not None:
            restore_random_state(self.rng)
        snapshot = self.stats.snapshot() if self.stats else None
        try:
            yield
        finally:
            if snapshot is not None:
                self.stats.restore(snapshot)  # type: ignore[union-attr]

    def second_pass_starts(self) -> None:
        if self.before is not None:
            self.stats.restore(self.before)  # type: ignore[union-attr]  # only the second counts
        if self.rng is not None:
            restore_random_state(self.rng)  # the second pass draws the first pass's dropout masks

    def step_done(self) -> None:
        if self.after_first is not None:
            self.stats.restore(self.after_first)  # type: ignore[union-attr]  # only the first counts
