"""Monitors of what fine-tuning does beyond its task: :class:`~lightning_slsam.monitor.
forgetting.ForgettingProbe` (pure PyTorch; the Lightning callback is
:class:`~lightning_slsam.ForgettingMonitor`)."""

from lightning_slsam.monitor.forgetting import ForgettingProbe, reference_windows

__all__ = ["ForgettingProbe", "reference_windows"]
