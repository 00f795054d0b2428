"""The per-layer activation charts shown in ``docs/metrics.md``, from short real fits.

    python benchmarks/layer_charts.py            # 15 to 25 minutes on 2 CPU cores

Each chart is the one ``SparseLayerSAM(layer_ratio=0.2)`` writes at the end of fit
(:func:`lightning_slsam.core.record.plot_layer_frequency`), copied to
``docs/images/``:

* ``layer_frequency_minilm_lora.png`` -- PEFT LoRA (r=8 on the query and value
  projections) on the pretrained all-MiniLM-L6-v2, Rotten Tomatoes sentences: 24 LoRA
  tensors with names of over 80 characters, and the classifier PEFT keeps trainable;
* ``layer_frequency_minilm.png`` -- the same model fully fine-tuned: 105 tensors;
* ``layer_frequency_vit.png`` -- timm's ViT-Tiny (depth 12, width 192, random init) at
  32x32 with 4x4 patches on scikit-learn's digits: 152 tensors.

Needs the ``examples`` extra and ``peft`` (in the ``dev`` extra); runs offline.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable

import lightning as L
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # examples.tasks, from the repository

from examples.tasks.vision import DigitsDataModule, ImageClassifier  # noqa: E402
from lightning_slsam import SparseLayerSAM  # noqa: E402
from lightning_slsam.demo.text import RottenTomatoesDataModule, TextClassifier  # noqa: E402

IMAGES = os.path.join(os.path.dirname(HERE), "docs", "images")


def minilm_lora(steps: int) -> tuple[L.LightningModule, L.LightningDataModule]:
    from peft import LoraConfig, get_peft_model

    module = TextClassifier(learning_rate=5e-4, dropout=0.0)
    lora = LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16, lora_dropout=0.0)
    module.model = get_peft_model(module.model, lora)  # only the adapters and head train
    return module, RottenTomatoesDataModule(batch_size=32, num_train=32 * steps)


def minilm(steps: int) -> tuple[L.LightningModule, L.LightningDataModule]:
    module = TextClassifier(learning_rate=1e-4, dropout=0.0)
    return module, RottenTomatoesDataModule(batch_size=32, num_train=32 * steps)


def vit(steps: int) -> tuple[L.LightningModule, L.LightningDataModule]:
    import timm

    module = ImageClassifier(learning_rate=1e-3, pretrained=False)
    # The task's EfficientNet swapped for a ViT of 152 tensors.
    module.model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                                     patch_size=4, num_classes=10)  # fmt: skip
    return module, DigitsDataModule(batch_size=32, image_size=32)


CHARTS: dict[str, Callable[[int], tuple[L.LightningModule, L.LightningDataModule]]] = {
    "minilm_lora": minilm_lora,
    "minilm": minilm,
    "vit": vit,
}


def chart(name: str, steps: int, folder: str) -> str:
    """Fit ``name`` for ``steps`` steps with SL-SAM; returns the chart's path in ``folder``."""
    L.seed_everything(0, verbose=False)
    module, data = CHARTS[name](steps)
    callback = SparseLayerSAM(layer_ratio=0.2, seed=0)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="cpu", max_steps=steps, limit_val_batches=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=root, callbacks=[callback],
        )  # fmt: skip
        trainer.fit(module, data)
        assert callback.frequency_plot_path is not None
        path = os.path.join(folder, f"layer_frequency_{name}.png")
        shutil.copyfile(callback.frequency_plot_path, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--charts", default=",".join(CHARTS), help="comma-separated names")
    parser.add_argument("--steps", type=int, default=40, help="training steps of each fit")
    parser.add_argument("--out", default=IMAGES, help="folder of the PNG files")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    os.makedirs(args.out, exist_ok=True)
    for name in args.charts.split(","):
        print(chart(name.strip(), args.steps, args.out), flush=True)


if __name__ == "__main__":
    main()
