"""SL-SAM in a Lightning Fabric loop: MiniLM fine-tuned on Rotten Tomatoes, offline.

The loop is the one Fabric users write; ``FabricSAM`` replaces ``fabric.backward(loss)`` +
``optimizer.step()`` with one SAM step (both passes through ``fabric.backward``, one
optimizer step). Its state goes into ``fabric.save`` with the model's and optimizer's::

    python examples/fabric_text.py --steps 50                    # one CPU process
    python examples/fabric_text.py --steps 50 --devices 2        # DDP, 2 CPU processes
    python examples/fabric_text.py --method sam --accumulate 2   # any method of the registry
    python examples/fabric_text.py --resume runs/fabric/last.ckpt --steps 80
"""

from __future__ import annotations

import argparse
import os
from itertools import cycle, islice

import lightning as L
import torch
from torchmetrics.classification import Accuracy

from lightning_slsam import FabricSAM
from lightning_slsam.demo.text import RottenTomatoesDataModule, default_model_path
from lightning_slsam.parallel.ddp import release_process_group


def build(args: argparse.Namespace, fabric: L.Fabric):
    from transformers import AutoModelForSequenceClassification

    data = RottenTomatoesDataModule(batch_size=args.batch_size, num_train=args.num_train,
                                    num_val=args.num_val)  # fmt: skip
    data.setup("fit")
    with fabric.init_module():
        model = AutoModelForSequenceClassification.from_pretrained(default_model_path(),
                                                                   num_labels=2)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    train, val = fabric.setup_dataloaders(data.train_dataloader(), data.val_dataloader())
    return model, optimizer, train, val


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="slsam",
                        help="a method name: slsam (the plugin's default, SparseLayerSAM()),"
                             " slsam_paper (the paper's SL-SAM), sam, esam, ...")  # fmt: skip
    parser.add_argument("--layer-ratio", type=float, default=None)
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps in all")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--batch-size", type=int, default=32, help="per process, per micro-batch")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--devices", type=int, default=1, help="CPU processes (2+: DDP, gloo)")
    parser.add_argument("--precision", default="32-true", help="32-true or bf16-mixed")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: off)")
    parser.add_argument("--num-train", type=int, default=None, help="cap training sentences")
    parser.add_argument("--num-val", type=int, default=256, help="cap validation sentences")
    parser.add_argument("--out", default="runs/fabric", help="checkpoint folder")
    parser.add_argument("--resume", default=None, help="a checkpoint this script saved")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    strategy = "ddp" if args.devices > 1 else "auto"
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy,
                      precision=args.precision)  # fmt: skip
    fabric.launch()
    fabric.seed_everything(args.seed)
    model, optimizer, train, val = build(args, fabric)
    options = {"layer_ratio": args.layer_ratio} if args.layer_ratio else {}
    sam = FabricSAM(fabric, model, optimizer, args.method, gradient_clip_val=args.clip or None,
                    seed=args.seed, **options)  # fmt: skip
    state = {"model": model, "optimizer": optimizer, "sam": sam, "step": 0}
    if args.resume:
        remainder = fabric.load(args.resume, state)
        state["step"] = remainder.get("step", state["step"])

    def logits(batch: dict) -> torch.Tensor:
        return model(**{k: v for k, v in batch.items() if k != "labels"}).logits

    def loss_fn(batch: dict) -> torch.Tensor:  # per-sample losses: every method takes them
        return torch.nn.functional.cross_entropy(logits(batch), batch["labels"], reduction="none")

    model.train()
    batches = cycle(train)
    first = state["step"]
    for step in range(first, args.steps):
        result = sam.step(loss_fn, *islice(batches, args.accumulate))
        state["step"] = step + 1
        if step == first or (step + 1) % 10 == 0 or step + 1 == args.steps:
            ratio = sam.engine.mean_active_ratio
            fabric.print(f"step {step + 1}/{args.steps}  loss {result.loss.item():.4f}"
                         f"  kind {result.kind}  mean active ratio {ratio:.3f}x")  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "last.ckpt")
    fabric.save(path, state)

    model.eval()
    accuracy = Accuracy(task="multiclass", num_classes=2).to(fabric.device)
    with torch.no_grad():
        for batch in val:
            accuracy.update(logits(batch).argmax(-1), batch["labels"])
    summary = {"val_acc": float(accuracy.compute()), "steps": state["step"],
               "mean_active_ratio": sam.engine.mean_active_ratio, "checkpoint": path}  # fmt: skip
    fabric.print(f"val_acc {summary['val_acc']:.4f}  mean active ratio"
                 f" {summary['mean_active_ratio']:.3f}x (SAM 2.0x)  checkpoint {path}")  # fmt: skip
    if fabric.world_size > 1:
        release_process_group()  # a gloo group alive at exit can abort a finished run
    return summary


if __name__ == "__main__":
    main()
