"""What one pass of a SAM step may leave behind besides gradients: which pass's BatchNorm
statistics count, and dropout replay between the passes (:class:`PassIsolation`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

from torch import Tensor

from lightning_slsam.core.running import RandomState, RunningStats

__all__ = ["PassIsolation"]


class PassIsolation:
    """What one pass of a SAM step may leave behind besides gradients.

    Args:
        stats: the model's running statistics (``None`` or empty: nothing to manage).
        bn_stats: which pass's BatchNorm statistics the step keeps: ``"first"``,
            ``"second"`` or ``"both"``. Extra forwards (ESAM's selection, SSAM-F's Fisher)
            never count.
        replay_dropout: the second pass replays the first pass's random streams (the same
            dropout masks).
    """

    def __init__(self, stats: RunningStats | None, bn_stats: str, replay_dropout: bool) -> None:
        self.stats = stats if stats else None
        self.bn_stats = bn_stats
        self.replay_dropout = bool(replay_dropout)

    @contextmanager
    def sam_step(self) -> Iterator[_Isolated]:
        """Context of one SAM step; snapshots taken before the first pass."""
        stats = self.stats
        yield _Isolated(
            stats,
            before=stats.snapshot() if stats and self.bn_stats == "second" else None,
            rng=RandomState() if self.replay_dropout else None,
            keep_first=self.bn_stats == "first",
        )

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """Forwards that use the running statistics and leave them untouched."""
        with self.stats.evaluating() if self.stats else nullcontext():
            yield


@dataclass
class _Isolated:
    stats: RunningStats | None
    before: list[Tensor] | None
    rng: RandomState | None
    keep_first: bool
    after_first: list[Tensor] | None = None

    def first_pass_done(self) -> None:
        if self.stats and self.keep_first:
            self.after_first = self.stats.snapshot()

    @contextmanager
    def extra_forward(self) -> Iterator[None]:
        """A forward that must leave neither statistics nor random streams changed."""
        if self.rng is not None:
            self.rng.restore()
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
            self.rng.restore()  # the second pass draws the first pass's dropout masks

    def step_done(self) -> None:
        if self.after_first is not None:
            self.stats.restore(self.after_first)  # type: ignore[union-attr]  # only the first counts
