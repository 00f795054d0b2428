"""The packaged demo (``lightning-slsam fit --demo``): all-MiniLM-L6-v2 fine-tuned on the
Rotten Tomatoes sentences, offline, from the ``examples`` extra's assets."""

from lightning_slsam.demo.text import RottenTomatoesDataModule, TextClassifier

__all__ = ["RottenTomatoesDataModule", "TextClassifier"]
