"""Progress as plain lines, which ``lightning-slsam`` uses instead of Lightning's bar when
its standard output is not a terminal (a log file, a cluster job, CI).

Example (a line every 10% of the run, or 30 s after the last one):

.. code-block:: text

    step 46/454 (10%), epoch 1/2, 0:21 elapsed, 2.2 steps/s, 3:06 left, train_loss 0.61
    validation at step 113: val_acc 0.7781, val_loss 0.4655
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from lightning.pytorch.callbacks import ProgressBar

from lightning_slsam.lightning.callback import estimated_stepping_batches

__all__ = ["LineProgress", "clock"]


def clock(seconds: float) -> str:
    """``seconds`` as ``m:ss`` or ``h:mm:ss``.

    >>> clock(75.4), clock(3725)
    ('1:15', '1:02:05')
    """
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class LineProgress(ProgressBar):
    """A progress bar that prints lines: step, epoch, time elapsed, rate, time left and the
    progress bar's metrics; after each validation, its metrics.

    Args:
        every: a line each time the run passes another ``every`` of its planned steps (default 0.1).
        seconds: and a line ``seconds`` after the last one, if that comes first (default 30).
    """

    def __init__(self, every: float = 0.1, seconds: float = 30.0) -> None:
        super().__init__()
        self.every, self.seconds = every, seconds
        self._enabled = True
        self._start = self._last = 0.0
        self._planned = math.inf
        self._first_step = 0
        self._mark = 0  # how many `every` of the run the last line had passed
        self._shown: int | None = None  # the step of the last line

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._start = self._last = time.monotonic()
        self._planned = estimated_stepping_batches(trainer)
        self._first_step = trainer.global_step
        self._mark = self._marks(trainer.global_step)

    def _marks(self, step: int) -> int:
        if not math.isfinite(self._planned):
            return 0
        return math.floor(round(step / self._planned / self.every, 9))  # 12 / 40 is 3 tenths

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now, step = time.monotonic(), trainer.global_step
        mark = self._marks(step)
        due = mark > self._mark or now - self._last >= self.seconds or step >= self._planned
        if not self._enabled or not due or step == self._shown:
            return
        self._mark, self._last, self._shown = mark, now, step
        self._print(self._line(trainer, step, now - self._start))

    def _line(self, trainer: Any, step: int, elapsed: float) -> str:
        done = step - self._first_step
        if math.isfinite(self._planned):
            parts = [f"step {step}/{int(self._planned)} ({100 * step / self._planned:.0f}%)"]
        else:
            parts = [f"step {step}"]
        epochs = trainer.max_epochs
        last = f"/{epochs}" if epochs is not None and epochs > 0 else ""
        parts.append(f"epoch {trainer.current_epoch + 1}{last}")
        parts.append(f"{clock(elapsed)} elapsed")
        if done > 0 and elapsed > 0:
            rate = done / elapsed
            parts.append(f"{rate:.3g} steps/s" if rate >= 1 else f"{1 / rate:.3g} s/step")
            if math.isfinite(self._planned):
                parts.append(f"{clock((self._planned - step) / rate)} left")
        metrics = self.get_metrics(trainer, trainer.lightning_module)
        metrics.pop("v_num", None)
        shown = [f"{k} {_number(v)}" for k, v in metrics.items() if not k.startswith("val")]
        return ", ".join(parts + shown)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not self._enabled or trainer.sanity_checking:
            return
        found = trainer.callback_metrics
        shown = [f"{k} {_number(v)}" for k, v in sorted(found.items()) if k.startswith("val")]
        if shown:
            self._print(f"validation at step {trainer.global_step}: {', '.join(shown)}")

    def _print(self, line: str) -> None:
        print(line, file=sys.stdout, flush=True)


def _number(value: Any) -> str:
    """A metric as the line shows it: 4 significant digits, an integer as it is."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)
