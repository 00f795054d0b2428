"""Where ``lightning-slsam compare`` lived before the package had subpackages.

Configs and run records written by earlier versions name the class path
``lightning_slsam.compare.RunRecorder``; it keeps resolving here. The command itself is
:mod:`lightning_slsam.cli.compare`.
"""

from lightning_slsam.cli.compare import RunRecorder

__all__ = ["RunRecorder"]
