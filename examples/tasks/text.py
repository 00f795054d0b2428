"""The demo's text task with a held-out test split and label noise: the label-noise study's
MiniLM task (``examples/configs/tasks/minilm_rotten_tomatoes_noisy.yaml``). The classes are
those of :mod:`lightning_slsam.demo.text`, with the demo's arguments, plus the test split
(``test_fraction``, logged as ``test_*`` beside ``val_*``) and ``label_noise``::

    data = RottenTomatoesDataModule(num_train=1000, test_fraction=0.1, label_noise=0.6)
    L.Trainer(max_epochs=8).fit(TextClassifier(learning_rate=1e-5, dropout=0.0), data)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader
from torchmetrics.classification import Accuracy

from examples.tasks.held_out import check_held_out, log_held_out, noisy_labels
from lightning_slsam.demo import text as demo
from lightning_slsam.demo.common import split_rows

__all__ = ["RottenTomatoesDataModule", "TextClassifier"]


class RottenTomatoesDataModule(demo.RottenTomatoesDataModule):
    """The demo's :class:`~lightning_slsam.demo.text.RottenTomatoesDataModule` (its
    arguments, its validation rows) with a test split and noisy training labels.

    Args:
        test_fraction: fraction held out as a test split, logged as ``test_acc`` at every
            validation, in [0, 1) (with ``val_fraction`` under 1); default 0: none. Its rows
            come after the validation rows of the split's permutation (so the validation
            rows stay those of the demo) and are capped by ``num_val`` too.
        label_noise: fraction of the *training* labels replaced by a uniformly drawn class,
            in [0, 1), drawn from ``seed`` plus one; default 0. The held-out splits keep
            their true labels.
    """

    def __init__(
        self, *args: Any, test_fraction: float = 0.0, label_noise: float = 0.0, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        check_held_out(self.val_fraction, test_fraction, label_noise)
        self.test_fraction, self.label_noise = float(test_fraction), float(label_noise)
        self.test_dataset: list[dict[str, Any]] | None = None

    def split_indices(self, num_rows: int) -> tuple[list[int], list[int]]:
        """Train and validation row indices: the test rows are not training rows."""
        train, val, _ = self.split_with_test(num_rows)
        return train, val

    def split_with_test(self, num_rows: int) -> tuple[list[int], list[int], list[int]]:
        """Train, validation and test row indices, capped by ``num_train``/``num_val``."""
        train, val, test = split_rows(num_rows, self.seed, self.val_fraction, self.test_fraction)
        return train[: self.num_train], val[: self.num_val], test[: self.num_val]

    def make_datasets(
        self, encode: Callable[[list[int]], list[dict[str, Any]]], num_rows: int
    ) -> None:
        """The demo's datasets, the training labels made noisy, and ``test_dataset``."""
        super().make_datasets(encode, num_rows)
        assert self.train_dataset is not None
        true = torch.tensor([ex["labels"] for ex in self.train_dataset])
        noisy = noisy_labels(true, self.label_noise, 2, self.seed).tolist()
        for ex, label in zip(self.train_dataset, noisy):  # the training rows' labels only
            ex["labels"] = label
        test_idx = self.split_with_test(num_rows)[2]
        if test_idx:
            self.test_dataset = sorted(encode(test_idx), key=lambda ex: len(ex["input_ids"]))

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """The validation split, and the test split after it when there is one."""
        val = super().val_dataloader()
        if self.test_dataset is None:
            return val
        return [val, self._loader(self.test_dataset, 2 * self.batch_size, None, shuffle=False)]


class TextClassifier(demo.TextClassifier):
    """The demo's :class:`~lightning_slsam.demo.text.TextClassifier` (its arguments), which
    also logs ``test_loss`` / ``test_acc`` on the data module's test split (the second
    validation loader)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.test_acc = Accuracy(task="multiclass", num_classes=self.hparams.num_labels)

    def validation_step(
        self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """``val_loss`` / ``val_acc``, or ``test_*`` on the data module's test split."""
        out = self(batch)
        log_held_out(self, dataloader_idx, out.logits, batch["labels"], out.loss)
