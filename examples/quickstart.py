"""SL-SAM in a LightningModule of your own, end to end, offline (about a minute on a CPU).

An MLP classifies scikit-learn's 8x8 digits. The module is a plain LightningModule plus
``SAMMixin``; SL-SAM is the ``SparseLayerSAM`` callback. Run it with and without the callback
to compare::

    python examples/quickstart.py             # SL-SAM, layer_ratio 0.2
    python examples/quickstart.py --adamw     # the same module, plain AdamW
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import Accuracy

from lightning_slsam import SAMMixin, SparseLayerSAM


class DigitsClassifier(SAMMixin, L.LightningModule):  # the one change: SAMMixin first
    def __init__(self, hidden: int = 128, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.GELU(), nn.LayerNorm(hidden),
            nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 10),
        )  # fmt: skip
        self.val_acc = Accuracy(task="multiclass", num_classes=10)

    def training_step(self, batch, batch_idx):  # unchanged: returns the loss
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_acc(self.net(x).argmax(-1), y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self):  # unchanged: any optimizer and scheduler
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=self.trainer.max_epochs
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"},
        }


def digits_loaders(batch_size: int = 64, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    train, val = order[:1400], order[1400:]
    return (
        DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True),
        DataLoader(TensorDataset(x[val], y[val]), batch_size=256),
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adamw", action="store_true", help="train without the SL-SAM callback")
    parser.add_argument("--max-epochs", type=int, default=15)
    parser.add_argument("--layer-ratio", type=float, default=0.2)
    parser.add_argument("--root", default="runs/quickstart")
    args = parser.parse_args(argv)

    L.seed_everything(0)
    # rho: the package's default, the paper's fine-tuning radius. With noisy labels SAM gains
    # most at 0.3-0.5, a layer sampler at about a third of that (docs/choosing.md).
    callbacks = [] if args.adamw else [SparseLayerSAM(rho=0.01, layer_ratio=args.layer_ratio)]
    trainer = L.Trainer(
        max_epochs=args.max_epochs,
        callbacks=callbacks,
        default_root_dir=args.root,
        enable_checkpointing=False,
        log_every_n_steps=5,
    )
    model = DigitsClassifier()
    train, val = digits_loaders()
    trainer.fit(model, train, val)
    result = {"val_acc": float(trainer.callback_metrics["val_acc"])}
    if callbacks:
        result["mean_active_ratio"] = callbacks[0].mean_active_ratio
    print(result)
    return result


if __name__ == "__main__":
    main()
