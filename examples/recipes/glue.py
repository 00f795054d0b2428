"""RoBERTa-base on the eight GLUE tasks (the SL-SAM paper's Table 3).

The paper trains 30 epochs at batch 16 with weight decay 0.01, rho 0.01 and each task's
learning rate from the GaLore paper's RoBERTa-base fine-tuning table (:data:`GLUE_TASKS`),
layer_ratio 0.2 (0.25 on RTE). Each task is scored with its own metric: Matthews
correlation (CoLA), Pearson correlation (STS-B), F1 (MRPC), accuracy otherwise; the metric
is logged as ``val_<metric>`` and as ``val_score``. Configs:
``examples/configs/recipes/roberta_glue.yaml`` plus one file per task in
``examples/configs/recipes/glue/``.

    python -m lightning_slsam.cli fit --config examples/configs/recipes/roberta_glue.yaml \\
        --config examples/configs/recipes/glue/cola.yaml \\
        --config examples/configs/methods/slsam.yaml

Data: ``nyu-mll/glue`` from the Hugging Face hub (needs ``pip install datasets``), or
``data_dir`` holding ``train.jsonl`` and ``validation.jsonl`` (``validation_matched.jsonl``
for MNLI) with GLUE's field names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader
from torchmetrics import Metric
from torchmetrics.classification import Accuracy, BinaryF1Score, BinaryMatthewsCorrCoef
from torchmetrics.regression import PearsonCorrCoef

from examples.recipes.common import check_path, load_hub_dataset, read_jsonl
from lightning_slsam.demo.common import (
    PaddingCollator,
    check_training,
    require,
    with_schedule,
)
from lightning_slsam.lightning.mixin import SAMMixin
from lightning_slsam.methods.options import check_choice, check_int, check_number

__all__ = ["GLUE_TASKS", "GLUEClassifier", "GLUEDataModule", "GLUETask"]


@dataclass(frozen=True)
class GLUETask:
    """One GLUE task: its text fields, label count (1 = regression), metric and the
    learning rate the paper takes from GaLore."""

    fields: tuple[str, ...]
    num_labels: int
    metric: str
    learning_rate: float
    validation_split: str = "validation"


GLUE_TASKS: dict[str, GLUETask] = {
    "cola": GLUETask(("sentence",), 2, "matthews", 3e-5),
    "sst2": GLUETask(("sentence",), 2, "accuracy", 1e-5),
    "mrpc": GLUETask(("sentence1", "sentence2"), 2, "f1", 3e-5),
    "qqp": GLUETask(("question1", "question2"), 2, "accuracy", 1e-5),
    "stsb": GLUETask(("sentence1", "sentence2"), 1, "pearson", 1e-5),
    "mnli": GLUETask(("premise", "hypothesis"), 3, "accuracy", 1e-5, "validation_matched"),
    "qnli": GLUETask(("question", "sentence"), 2, "accuracy", 1e-5),
    "rte": GLUETask(("sentence1", "sentence2"), 2, "accuracy", 1e-5),
}


def _task(task: str) -> GLUETask:
    check_choice("task", task, list(GLUE_TASKS))
    return GLUE_TASKS[task]


class GLUEDataModule(L.LightningDataModule):
    """A GLUE task's training and validation sets, tokenised, padded per batch.

    Args:
        task: one of :data:`GLUE_TASKS` (``cola``, ``sst2``, ``mrpc``, ``qqp``, ``stsb``,
            ``mnli``, ``qnli``, ``rte``).
        tokenizer: tokenizer folder or hub name; default ``FacebookAI/roberta-base``.
        batch_size: training batch size (>= 1); paper: 16.
        max_length: tokens kept per example (>= 8); default 512.
        data_dir: folder of local ``<split>.jsonl`` files; ``None``: the hub's
            ``nyu-mll/glue``.
        num_workers: DataLoader workers (>= 0); default 0.
    """

    def __init__(
        self,
        task: str = "cola",
        tokenizer: str = "FacebookAI/roberta-base",
        batch_size: int = 16,
        max_length: int = 512,
        data_dir: str | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        require("transformers", "GLUEDataModule")
        _task(task)
        check_int("batch_size", batch_size, 1)
        check_int("max_length", max_length, 8)
        check_int("num_workers", num_workers, 0)
        check_path("data_dir", data_dir, folder=True)
        self.save_hyperparameters()
        self.splits: dict[str, list[dict[str, Any]]] = {}

    def rows(self, split: str) -> list[dict[str, Any]]:
        """The raw rows of ``split`` (``train`` or the task's validation split)."""
        hp = self.hparams
        if hp.data_dir is not None:
            return read_jsonl(os.path.join(hp.data_dir, f"{split}.jsonl"))
        return [dict(row) for row in load_hub_dataset("nyu-mll/glue", hp.task, split=split)]

    def setup(self, stage: str) -> None:
        if self.splits:
            return
        from transformers import AutoTokenizer

        hp, task = self.hparams, _task(self.hparams.task)
        self.tokenizer = AutoTokenizer.from_pretrained(hp.tokenizer)
        for name, split in (("train", "train"), ("val", task.validation_split)):
            rows = self.rows(split)
            missing = [f for f in (*task.fields, "label") if rows and f not in rows[0]]
            if missing:
                raise ValueError(f"GLUE {hp.task} rows of split {split!r} lack fields {missing}.")
            texts = [[row[f] for row in rows] for f in task.fields]
            encoded = self.tokenizer(*texts, truncation=True, max_length=hp.max_length)
            self.splits[name] = [
                {**{k: encoded[k][i] for k in encoded}, "labels": row["label"]}
                for i, row in enumerate(rows)
            ]

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", 2 * self.hparams.batch_size, shuffle=False)

    def _loader(self, name: str, size: int, shuffle: bool) -> DataLoader:
        assert self.splits, "call setup() first"
        regression = GLUE_TASKS[self.hparams.task].num_labels == 1
        dtype = torch.float32 if regression else torch.long
        collate = PaddingCollator(self.tokenizer.pad_token_id or 0, dtype)
        return DataLoader(self.splits[name], batch_size=size, shuffle=shuffle,
                          collate_fn=collate, num_workers=self.hparams.num_workers)  # fmt: skip


def _metric(task: GLUETask) -> Metric:
    if task.metric == "matthews":
        return BinaryMatthewsCorrCoef()
    if task.metric == "pearson":
        return PearsonCorrCoef()
    if task.metric == "f1":
        return BinaryF1Score()
    return Accuracy(task="multiclass", num_classes=task.num_labels)


class GLUEClassifier(SAMMixin, L.LightningModule):
    """A Hugging Face sequence classifier (or regressor, STS-B) for one GLUE task.

    Args:
        task: the GLUE task (sets the label count and the metric).
        model_name_or_path: model folder or hub name; default ``FacebookAI/roberta-base``.
        pretrained: load the pretrained weights (default); ``False``: same architecture,
            random init.
        learning_rate: AdamW peak learning rate (> 0); ``None``: the task's rate in
            :data:`GLUE_TASKS`.
        weight_decay: AdamW decoupled weight decay (>= 0); paper: 0.01.
        schedule: ``"linear"`` (default: decay to 0), ``"cosine"`` or ``"constant"``.
        warmup_ratio: fraction of the steps with a linear warm-up, in [0, 1); default 0.06.
    """

    def __init__(
        self,
        task: str = "cola",
        model_name_or_path: str = "FacebookAI/roberta-base",
        pretrained: bool = True,
        learning_rate: float | None = None,
        weight_decay: float = 0.01,
        schedule: str = "linear",
        warmup_ratio: float = 0.06,
    ) -> None:
        super().__init__()
        require("transformers", "GLUEClassifier")
        spec = _task(task)
        if learning_rate is not None:
            check_number("learning_rate", learning_rate, "> 0 or null", lambda v: v > 0)
        check_training(learning_rate, weight_decay, warmup_ratio, schedule)
        self.save_hyperparameters()
        from transformers import AutoConfig, AutoModelForSequenceClassification

        config = AutoConfig.from_pretrained(model_name_or_path, num_labels=spec.num_labels)
        if pretrained:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                model_name_or_path, config=config
            )
        else:
            self.model = AutoModelForSequenceClassification.from_config(config)
        self.model.train()
        self.spec = spec
        self.val_metric = _metric(spec)

    def _outputs(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        return logits.squeeze(-1) if self.spec.num_labels == 1 else logits

    def _losses(self, outputs: Tensor, labels: Tensor) -> Tensor:
        if self.spec.num_labels == 1:
            return F.mse_loss(outputs, labels, reduction="none")
        return F.cross_entropy(outputs, labels, reduction="none")

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Per-sample losses (averaged by SAMMixin; ranked by ESAM)."""
        losses = self._losses(self._outputs(batch), batch["labels"])
        self.log("train_loss", losses.mean(), prog_bar=True, batch_size=len(losses))
        return losses

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        outputs, labels = self._outputs(batch), batch["labels"]
        size = len(labels)
        self.log("val_loss", self._losses(outputs, labels).mean(), prog_bar=True, batch_size=size)
        predictions = outputs if self.spec.num_labels == 1 else outputs.argmax(-1)
        self.val_metric.update(predictions, labels)
        self.log(f"val_{self.spec.metric}", self.val_metric, prog_bar=True, batch_size=size)
        self.log("val_score", self.val_metric, batch_size=size)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        lr = hp.learning_rate if hp.learning_rate is not None else self.spec.learning_rate
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=hp.weight_decay)
        return with_schedule(self.trainer, optimizer, hp.schedule, hp.warmup_ratio)
