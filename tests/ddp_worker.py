"""Trains SAM methods on CPU with 1 or 2 gloo processes and records what each rank saw.

Run by tests/parallel/test_ddp.py as a separate program (DDP launchers start processes of their
own). Every rank writes ``<out>/<tag>_rank<r>.pt`` with its per-step layer masks, bytes
all-reduced and per-step weight checksums, and its final weights and probabilities.
``--plan FILE`` runs several command lines in one launch (``helpers.launch``).
The global batch is the same whatever the number of processes: with 2 processes each
gets every other sample (DistributedSampler), so a step sees the same 16 samples.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import BackboneFinetuning
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
from helpers import (
    Counting,
    LitModel,
    Stack,
    compared_optimizer,
    make_mlp,
    per_sample_outputs,
    planned,
    rank_loader,
)

from lightning_slsam import make_callback
from lightning_slsam.parallel.ddp import release_process_group

GLOBAL_BATCH = 16
#: Options a method runs with here beyond its name's: SL-SAM on LookSAM's interval in the
#: paper's configuration, what the name ran before 0.3 (the default preset's update scaling
#: multiplies the rounding that LookSAM's reused component amplifies past the tolerances).
OPTIONS: dict[str, dict] = {"slsam_looksam": {"preset": "paper"},
                            "saf": {"delay": 1, "start_epoch": 0}}  # fmt: skip
#: Trainer options of a run that validates before training and between its steps.
VALIDATE = {"val_check_interval": 1, "limit_val_batches": 2}


class PerSample(LitModel):
    accumulate = 1
    overflow_step = -1  # a step whose second pass overflows (fp16 runs)

    def __init__(self, net, compiled: bool = False) -> None:
        super().__init__(net, **compared_optimizer(compiled))  # compared across processes

    def training_step(self, batch, batch_idx):
        out = per_sample_outputs(self, batch)  # ESAM's losses, MESA's logits, SAF's indices
        if batch_idx // self.accumulate == self.overflow_step and self.sam_pass == 2:
            out["loss"] = out["loss"] * float("inf")
        return out

    def train_dataloader(self) -> DataLoader:
        return rank_loader(self.trainer, GLOBAL_BATCH // self.accumulate)

    def val_dataloader(self) -> DataLoader:
        return rank_loader(self.trainer, GLOBAL_BATCH)


class Backboned(PerSample):
    """--unfreeze: the first linear layer is the backbone that Lightning's
    BackboneFinetuning keeps frozen for the first epoch (4 steps), then unfreezes."""

    def __init__(self, net) -> None:
        super().__init__(net)
        self.backbone = net[0]  # the same tensors, first named net.0.*

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        return self.optimizer(trainable, lr=self.lr, weight_decay=0.01)


class Record(L.Callback):
    def __init__(self, path: str, backend: Counting | None = None) -> None:
        self.path = path
        self.backend = backend  # --compile: the blocks' counting backend
        self.masks, self.bytes, self.checksums, self.scales = [], [], [], []
        self.validations = 0  # validation loops run, the sanity check included

    def on_validation_end(self, trainer, pl_module):
        self.validations += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.backend is not None and trainer.global_step == trainer.max_steps // 2:
            torch.compiler.set_stance("fail_on_recompile")  # warm-up over: no more graphs

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == len(self.checksums):
            return  # a micro-batch buffered for accumulation: no step yet
        sam = [cb for cb in trainer.callbacks if hasattr(cb, "engine")]
        if sam:
            result = sam[0].engine.last_result
            self.masks.append(result.active_mask.clone())
            self.bytes.append(result.allreduce_bytes)
        self.checksums.append(sum(p.double().sum().item() for p in pl_module.parameters()))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scales.append(scaler.get_scale() if scaler is not None else None)

    def on_train_end(self, trainer, pl_module):
        torch.compiler.set_stance("default")
        sam = [cb for cb in trainer.callbacks if hasattr(cb, "engine")]
        torch.save(
            {
                "masks": self.masks,
                "bytes": self.bytes,
                "checksums": self.checksums,
                "scales": self.scales,
                "global_step": trainer.global_step,
                "validations": self.validations,
                "weights": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
                "probs": sam[0].probs.clone() if sam else None,
                "numel": [p.numel() for p in pl_module.parameters()],
                "layer_names": sam[0].layer_names if sam else None,
                "graphs": self.backend.graphs if self.backend else None,
                "compiled_calls": self.backend.calls if self.backend else None,
            },
            f"{self.path}_rank{trainer.global_rank}.pt",
        )


def run(
    method: str, devices: int, strategy: str, steps: int, out: str, sync: bool, accumulate: int,
    fp16: bool, precision: str, num_nodes: int = 1, validate: bool = False,
    compile_blocks: bool = False, unfreeze: bool = False,
) -> None:  # fmt: skip
    L.seed_everything(7)
    options = {"seed": None, "sync_first_pass": sync, "accumulate_grad_batches": accumulate}
    if method in ("esam", "ssamf"):
        options["seed"] = 3
    options.update(OPTIONS.get(method, {}))
    callback = make_callback(method, **options) if method != "adamw" else None
    tag = f"{method}_{strategy}_{devices}{'' if sync else '_local'}"
    tag += f"{f'_acc{accumulate}' if accumulate > 1 else ''}{'_fp16' if fp16 else ''}"
    tag += f"_{precision}" if precision != "32-true" else ""
    tag += f"_nodes{num_nodes}" if num_nodes > 1 else ""
    tag += "_val" if validate else ""
    tag += "_compiled" if compile_blocks else ""
    tag += "_unfreeze" if unfreeze else ""
    backend = Counting() if compile_blocks else None
    plugins = []
    if fp16:  # fp16 autocast with a real gradient scaler, as "16-mixed" on CUDA
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=scaler))
    if devices == 1 and num_nodes == 1:
        chosen = "auto"
    elif strategy == "ddp":
        chosen = DDPStrategy(process_group_backend="gloo")
    else:
        chosen = DDPStrategy(process_group_backend="gloo", start_method=strategy.split("_")[1])
    callbacks = [BackboneFinetuning(1)] if unfreeze else []
    callbacks += [c for c in (callback, Record(os.path.join(out, tag), backend)) if c is not None]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=chosen,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        default_root_dir=out,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # --validate: Lightning's default sanity check, then validation after every step.
        **VALIDATE if validate else {"limit_val_batches": 0},
        deterministic=True,
        use_distributed_sampler=False,
        plugins=plugins,
        precision=None if plugins else precision,
    )
    if unfreeze:
        model = Backboned(make_mlp(seed=5))
    else:
        model = PerSample(Stack(seed=5) if compile_blocks else make_mlp(seed=5), compile_blocks)
    if compile_blocks:  # regional compilation: each block one layer, trained or frozen whole
        torch._dynamo.reset()
        for block in model.net.blocks:
            block.compile(backend=backend)
    model.accumulate = accumulate
    model.overflow_step = 1 if fp16 else -1
    trainer.fit(model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="ddp_fork", choices=["ddp", "ddp_fork", "ddp_spawn"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--local-first-pass", action="store_true")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--num-nodes", type=int, default=1, help="under torchrun, one per node")
    parser.add_argument("--validate", action="store_true", help="validate before and between steps")
    parser.add_argument("--compile", action="store_true", help="compile the model's blocks")
    parser.add_argument("--unfreeze", action="store_true", help="BackboneFinetuning at epoch 1")
    parser.add_argument("--out", required=True)
    torch.set_num_threads(1)
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # never fall back to eager
    for args in planned(parser):
        for method in args.methods.split(","):
            run(
                method, args.devices, args.strategy, args.steps, args.out,
                not args.local_first_pass, args.accumulate, args.fp16, args.precision,
                args.num_nodes, args.validate, args.compile, args.unfreeze,
            )  # fmt: skip


if __name__ == "__main__":
    main()
    release_process_group()  # a gloo group alive at exit can abort a finished run
