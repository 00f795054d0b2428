"""Ready-made tasks for the demo, the examples and the tests.

They need the offline assets of the ``examples`` extra (``pip install
"lightning-slsam[examples]"``); the imports below are cheap, the assets are only
touched when a datamodule or model is built.
"""

from lightning_slsam.tasks.causal_lm import CausalLMFineTuner, RottenTomatoesLMDataModule
from lightning_slsam.tasks.text import RottenTomatoesDataModule, TextClassifier

__all__ = [
    "CausalLMFineTuner",
    "RottenTomatoesDataModule",
    "RottenTomatoesLMDataModule",
    "TextClassifier",
]
