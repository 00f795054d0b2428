"""Fine-tuning a timm image model on CIFAR-10 / CIFAR-100 (the SL-SAM paper's Table 1).

The paper fine-tunes ImageNet-pretrained DeiT-Small at 224 px: batch 128, AdamW at 1e-4
with a cosine decay, weight decay 5e-5, 20 epochs, rho 0.01, layer_ratio 0.2, reporting the
best test accuracy over the epochs (CIFAR has no validation split: the test set is the
validation set here too). Configs: ``examples/configs/recipes/deit_cifar10.yaml`` and
``deit_cifar100.yaml``.

    python -m lightning_slsam.cli fit --config examples/configs/recipes/deit_cifar10.yaml \\
                        --config examples/configs/methods/slsam.yaml

The data is read from the "python version" archives of
https://www.cs.toronto.edu/~kriz/cifar.html, downloaded (and checksummed) by torchvision
into ``root`` on first use.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import Accuracy

from lightning_slsam.demo.common import check_training, require, with_schedule
from lightning_slsam.lightning.mixin import SAMMixin
from lightning_slsam.methods.options import check_int, check_number

__all__ = ["CIFARDataModule", "TimmClassifier", "read_cifar"]

_FOLDERS = {10: "cifar-10-batches-py", 100: "cifar-100-python"}
_FILES = {
    10: ([f"data_batch_{i}" for i in range(1, 6)], ["test_batch"]),
    100: (["train"], ["test"]),
}
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


def read_cifar(root: str, num_classes: int, train: bool) -> tuple[Tensor, Tensor]:
    """Images (N, 3, 32, 32, uint8) and labels of a CIFAR split from the python archives."""
    folder = os.path.join(root, _FOLDERS[num_classes])
    images, labels = [], []
    for name in _FILES[num_classes][0 if train else 1]:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"CIFAR-{num_classes} file {path!r} is missing: set `download: true` or point"
                " `root` at the folder holding the extracted archive."
            )
        with open(path, "rb") as handle:
            entry = pickle.load(handle, encoding="latin1")
        images.append(torch.as_tensor(entry["data"], dtype=torch.uint8).view(-1, 3, 32, 32))
        labels.append(torch.as_tensor(entry["labels" if num_classes == 10 else "fine_labels"]))
    return torch.cat(images), torch.cat(labels).long()


class _Images(Dataset):
    """uint8 images -> normalised float images at ``size`` px, augmented when training (and
    then with each image's index, SAF's)."""

    def __init__(
        self, images: Tensor, labels: Tensor, size: int, train: bool, mean: Any, std: Any
    ) -> None:
        self.images, self.labels, self.size, self.train = images, labels, size, train
        self.mean = torch.tensor(mean).view(3, 1, 1)
        self.std = torch.tensor(std).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, ...]:
        image = self.images[index].float().div_(255)
        if self.train:  # random crop with 4 px padding and a horizontal flip, at 32 px
            image = F.pad(image, (4, 4, 4, 4), mode="reflect")
            top, left = torch.randint(0, 9, (2,)).tolist()
            image = image[:, top : top + 32, left : left + 32]
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
        if self.size != 32:
            image = F.interpolate(image[None], size=self.size, mode="bicubic", align_corners=False)
            image = image[0]
        image = (image - self.mean) / self.std
        return (image, self.labels[index], index) if self.train else (image, self.labels[index])


class CIFARDataModule(L.LightningDataModule):
    """CIFAR-10 or CIFAR-100: the training set, and the test set for validation.

    Args:
        root: folder of the extracted archives (``cifar-10-batches-py`` /
            ``cifar-100-python``); default ``data/cifar``.
        num_classes: 10 or 100.
        batch_size: images per training batch (>= 1); paper: 128.
        image_size: side the 32 px images are resized to (>= 32); 224 for DeiT-Small.
        download: download the archive into ``root`` when it is missing (default).
        num_workers: DataLoader workers (>= 0); default 4.
        mean: per-channel normalisation mean; default ImageNet's, which timm's ImageNet
            models expect.
        std: per-channel normalisation standard deviation; default ImageNet's.
        num_train: keep only this many training images (``None``: all).
    """

    def __init__(
        self,
        root: str = "data/cifar",
        num_classes: int = 10,
        batch_size: int = 128,
        image_size: int = 224,
        download: bool = True,
        num_workers: int = 4,
        mean: tuple[float, float, float] = _IMAGENET_MEAN,
        std: tuple[float, float, float] = _IMAGENET_STD,
        num_train: int | None = None,
    ) -> None:
        super().__init__()
        if num_classes not in _FOLDERS:
            raise ValueError(f"`num_classes` must be 10 or 100, got {num_classes!r}.")
        check_int("batch_size", batch_size, 1)
        check_int("image_size", image_size, 32)
        check_int("num_workers", num_workers, 0)
        self.save_hyperparameters()
        self.train_set: _Images | None = None
        self.val_set: _Images | None = None

    def prepare_data(self) -> None:
        hp = self.hparams
        if os.path.isdir(os.path.join(hp.root, _FOLDERS[hp.num_classes])) or not hp.download:
            return
        import torchvision

        datasets = torchvision.datasets
        dataset = datasets.CIFAR10 if hp.num_classes == 10 else datasets.CIFAR100
        dataset(hp.root, download=True)

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        images, labels = read_cifar(hp.root, hp.num_classes, train=True)
        images, labels = images[: hp.num_train], labels[: hp.num_train]
        self.train_set = _Images(images, labels, hp.image_size, True, hp.mean, hp.std)
        images, labels = read_cifar(hp.root, hp.num_classes, train=False)
        self.val_set = _Images(images, labels, hp.image_size, False, hp.mean, hp.std)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "call setup() first"
        return self._loader(self.val_set, shuffle=False)

    def _loader(self, data: Dataset, shuffle: bool) -> DataLoader:
        workers = self.hparams.num_workers
        return DataLoader(data, batch_size=self.hparams.batch_size, shuffle=shuffle,
                          num_workers=workers, persistent_workers=workers > 0,
                          pin_memory=torch.cuda.is_available())  # fmt: skip


class TimmClassifier(SAMMixin, L.LightningModule):
    """A timm image classifier fine-tuned with AdamW (any SAM method when a callback is on).

    Args:
        model_name: a timm model name; default ``deit_small_patch16_224``.
        num_classes: classes of the new head (>= 2).
        pretrained: start from timm's ImageNet weights (downloaded from the Hugging Face
            hub on first use); ``False``: random init.
        learning_rate: AdamW peak learning rate (> 0); paper: 1e-4.
        weight_decay: AdamW decoupled weight decay (>= 0); paper: 5e-5.
        schedule: ``"cosine"`` (paper), ``"linear"`` or ``"constant"``, stepped every
            optimizer step.
        warmup_ratio: fraction of the steps with a linear warm-up, in [0, 1); default 0.
        model_kwargs: extra arguments of ``timm.create_model`` (e.g. ``img_size``,
            ``drop_path_rate``).
    """

    def __init__(
        self,
        model_name: str = "deit_small_patch16_224",
        num_classes: int = 10,
        pretrained: bool = True,
        learning_rate: float = 1e-4,
        weight_decay: float = 5e-5,
        schedule: str = "cosine",
        warmup_ratio: float = 0.0,
        model_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        require("timm", "TimmClassifier")
        check_int("num_classes", num_classes, 2)
        check_number("learning_rate", learning_rate, "> 0", lambda v: v > 0)
        check_training(learning_rate, weight_decay, warmup_ratio, schedule)
        self.save_hyperparameters()
        import timm

        if model_name not in timm.list_models():
            raise ValueError(
                f"`model_name` {model_name!r} is not a timm model; see `timm.list_models()`."
            )
        self.model: nn.Module = timm.create_model(
            model_name, pretrained=pretrained, num_classes=num_classes, **(model_kwargs or {})
        )
        self.val_acc = Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> dict[str, Tensor]:
        """Per-sample losses (averaged by SAMMixin; ranked by ESAM), the logits (MESA, SAF)
        and the images' indices (SAF)."""
        images, labels, index = batch
        logits = self(images).float()
        losses = F.cross_entropy(logits, labels, reduction="none")
        self.log("train_loss", losses.mean(), prog_bar=True, batch_size=len(labels))
        return {"loss": losses, "logits": logits, "index": index}

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images).float()
        self.val_acc.update(logits.argmax(-1), labels)
        self.log("val_loss", F.cross_entropy(logits, labels), prog_bar=True, batch_size=len(labels))
        self.log("val_acc", self.val_acc, prog_bar=True, batch_size=len(labels))

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=hp.learning_rate, weight_decay=hp.weight_decay
        )
        return with_schedule(self.trainer, optimizer, hp.schedule, hp.warmup_ratio)
