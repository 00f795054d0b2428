"""SL-SAM under each precision on one device: the GPU path of the training-features checks.

Trains a small timm ViT with SparseLayerSAM for a few steps under ``32-true``,
``bf16-mixed`` and ``16-mixed`` (with one injected overflow in a second pass), and reports
per precision: skipped steps, the gradient scaler's scale before and after the overflow,
the final loss, the largest weight difference to the 32-bit run and the median step time.

    python benchmarks/precision_check.py                    # CUDA if available, else CPU
    python benchmarks/precision_check.py --accelerator cpu  # CPU (16-mixed emulated)

On a CPU, Lightning runs "16-mixed" as bfloat16; this script then builds the CUDA-style
path (fp16 autocast with a real GradScaler) so the skip-and-back-off logic runs anyway.
Results go to ``benchmarks/results/precision_check_<accelerator>.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time

import lightning as L
import timm
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from lightning_slsam import SAMMixin, SparseLayerSAM

OVERFLOW_STEP = 5


class ViT(SAMMixin, L.LightningModule):
    def __init__(self, overflow: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = timm.create_model(
            "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4,
            embed_dim=192, depth=6, num_heads=3, num_classes=10,
        )  # fmt: skip
        self.overflow = overflow
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x).float(), y)
        if self.overflow and batch_idx == OVERFLOW_STEP and self.sam_pass == 2:
            loss = loss * float("inf")
        if self.sam_pass == 1:
            self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Timer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.scales: list[float | None] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.start)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scales.append(scaler.get_scale() if scaler is not None else None)


def run(precision: str, accelerator: str, steps: int, batch: int) -> dict:
    L.seed_everything(0)
    data = TensorDataset(
        torch.randn(steps * batch, 3, 32, 32), torch.randint(0, 10, (steps * batch,))
    )
    cb, timer = SparseLayerSAM(layer_ratio=0.2, seed=0), Timer()
    plugins, chosen = [], precision
    if precision == "16-mixed" and accelerator == "cpu":
        plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
        chosen = None
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, precision=chosen, plugins=plugins, max_steps=steps,
        callbacks=[cb, timer],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    model = ViT(overflow=precision == "16-mixed")
    trainer.fit(model, DataLoader(data, batch_size=batch))
    return {
        "precision": precision,
        "skipped": cb.engine.num_skipped,
        "scales": timer.scales,
        "final_loss": model.losses[-1],
        "median_step_s": statistics.median(timer.times[2:]),
        "weights": {n: p.detach().float().cpu() for n, p in model.named_parameters()},
        "mean_active_ratio": cb.mean_active_ratio,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--accelerator", default=default)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)

    runs = [
        run(p, args.accelerator, args.steps, args.batch_size)
        for p in ("32-true", "bf16-mixed", "16-mixed")
    ]
    reference = runs[0]["weights"]
    rows = []
    for r in runs:
        diff = max((r["weights"][n] - reference[n]).abs().max().item() for n in reference)
        scales = [s for s in r["scales"] if s is not None]
        rows.append(
            {
                "precision": r["precision"],
                "skipped_steps": r["skipped"],
                "scale_before_overflow": scales[OVERFLOW_STEP - 1] if scales else None,
                "scale_after_overflow": scales[OVERFLOW_STEP] if scales else None,
                "final_loss": r["final_loss"],
                "max_weight_diff_vs_fp32": diff,
                "median_step_s": r["median_step_s"],
                "mean_active_ratio": r["mean_active_ratio"],
            }
        )
    device = torch.cuda.get_device_name(0) if args.accelerator in ("cuda", "gpu") else "CPU"
    result = {
        "benchmark": "precision_check",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "config": vars(args),
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"precision_check_{args.accelerator}")
    with open(stem + ".json", "w") as handle:
        json.dump(result, handle, indent=2)
    lines = [
        f"# SL-SAM under each precision ({device}, torch {torch.__version__}, {result['date']})",
        "",
        f"timm ViT (dim 192, depth 6) at 32x32, batch {args.batch_size}, {args.steps} steps,"
        f" SparseLayerSAM(layer_ratio=0.2); 16-mixed overflows in the second pass of step"
        f" {OVERFLOW_STEP}.",
        "",
        "| precision | skipped | scale before -> after overflow | final loss"
        " | max weight diff vs fp32 | median step (s) |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        scale = (
            f"{row['scale_before_overflow']:g} -> {row['scale_after_overflow']:g}"
            if row["scale_before_overflow"] is not None
            else "-"
        )
        lines.append(
            f"| {row['precision']} | {row['skipped_steps']} | {scale} | {row['final_loss']:.4f}"
            f" | {row['max_weight_diff_vs_fp32']:.2e} | {row['median_step_s']:.3f} |"
        )
    with open(stem + ".md", "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
