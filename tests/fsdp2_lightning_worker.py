"""Trains SAM methods through Lightning's ModelParallelStrategy (FSDP2) on 2 gloo CPU
processes, or on one process without sharding, and records what each rank saw.

Run by tests/parallel/test_fsdp2.py as a separate program (the strategy starts its processes by
running this script again). Each rank writes ``<out>/<tag>_rank<r>.pt`` with its per-step
layer masks and the final full (gathered) weights. The global batch is the same whatever
the number of processes: rank r takes samples r, r + 2, ... of each 16-sample batch.
``--plan FILE`` runs several command lines in one launch (``helpers.launch``).
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
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


class Sharded(LitModel):
    shard = True
    accumulate = 1
    fail_rank = -1  # this process raises in the second pass of step 2
    backend: Counting | None = None  # --compile: compiled after sharding
    compile_whole = False  # --compile whole: the network compiled whole (handed to its blocks)

    def configure_model(self) -> None:
        blocks = list(getattr(self.net, "blocks", []))
        if self.trainer.world_size > 1 and self.shard:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in blocks or self.net:
                if blocks or isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)
        if self.backend is not None:  # regional compilation: each block one layer
            torch._dynamo.reset()
            for block in [self.net] if self.compile_whole else blocks:
                block.compile(backend=self.backend)

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.fail_rank and self.global_step == 2 and self.sam_pass == 2:
            raise RuntimeError(f"a fault on rank {self.global_rank}")
        return per_sample_outputs(self, batch)  # ESAM's losses, MESA's logits, SAF's indices

    def train_dataloader(self) -> DataLoader:
        return rank_loader(self.trainer, GLOBAL_BATCH // self.accumulate)

    def val_dataloader(self) -> DataLoader:
        return rank_loader(self.trainer, GLOBAL_BATCH)


class Record(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path
        self.masks: list[torch.Tensor] = []
        self.validations = 0  # validation loops run, the sanity check included

    def on_validation_end(self, trainer, pl_module):
        self.validations += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.backend is not None and trainer.global_step == trainer.max_steps // 2:
            torch.compiler.set_stance("fail_on_recompile")  # warm-up over: no more graphs

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == len(self.masks):
            return  # a micro-batch buffered for accumulation: no step yet
        sam = [cb for cb in trainer.callbacks if hasattr(cb, "engine")]
        if sam:
            self.masks.append(sam[0].engine.last_result.active_mask.clone())

    def on_train_end(self, trainer, pl_module):
        torch.compiler.set_stance("default")
        sam = [cb for cb in trainer.callbacks if hasattr(cb, "engine")]
        backend = pl_module.backend
        weights = {}
        for name, param in pl_module.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            weights[name] = full.detach().clone()
        sharded = any(hasattr(p, "full_tensor") for p in pl_module.parameters())
        torch.save(
            {"masks": self.masks, "weights": weights, "sharded": sharded,
             "global_step": trainer.global_step, "validations": self.validations,
             "layer_names": sam[0].layer_names if sam else None,
             "graphs": backend.graphs if backend else None,
             "compiled_calls": backend.calls if backend else None},
            f"{self.path}_rank{trainer.global_rank}.pt",
        )  # fmt: skip


def run(
    method: str, devices: int, steps: int, out: str, options: dict, shard: bool,
    accumulate: int, precision: str, resume_at: int = 0, full_checkpoint: bool = False,
    resume_from: str | None = None, validate: bool = False, compile_blocks: str = "",
) -> None:  # fmt: skip
    """One fit of ``steps`` steps; with ``resume_at``, that fit checkpoints every step
    (``<tag>_uninterrupted``), and a fresh fit resumes from its checkpoint of step
    ``resume_at`` up to ``steps`` (``<tag>_resumed``)."""
    L.seed_everything(7)
    suffix = options.pop("tag", "")
    options_fail_rank = options.pop("fail_rank", -1)
    tag = f"{method}_{devices}{f'_acc{accumulate}' if accumulate > 1 else ''}"
    tag += f"_{precision}" if precision != "32-true" else ""
    tag += (
        suffix
        + ("_val" if validate else "")
        + (f"_compiled_{compile_blocks}" if compile_blocks else "")
    )

    def fit(name: str, ckpt_path: str | None = None, save_dir: str | None = None) -> None:
        strategy = (
            ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                  save_distributed_checkpoint=not full_checkpoint)
            if devices == 2
            else "auto"
        )  # fmt: skip
        callback = make_callback(method, accumulate_grad_batches=accumulate, **options)
        savers = [ModelCheckpoint(save_dir, every_n_train_steps=1, save_top_k=-1)]
        savers = savers if save_dir else []
        trainer = L.Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=strategy,
            max_steps=steps,
            callbacks=[callback, Record(os.path.join(out, name)), *savers],
            precision=precision,
            logger=False,
            default_root_dir=out,
            enable_checkpointing=save_dir is not None,
            enable_progress_bar=False,
            enable_model_summary=False,
            # --validate: Lightning's default sanity check, then validation after every step.
            **VALIDATE if validate else {"limit_val_batches": 0},
            use_distributed_sampler=False,
        )
        net = Stack(seed=5) if compile_blocks else make_mlp(seed=5)
        model = Sharded(net, **compared_optimizer(bool(compile_blocks)))  # as ddp_worker's runs
        model.backend = Counting() if compile_blocks else None
        model.compile_whole = compile_blocks == "whole"
        model.shard, model.accumulate = shard, accumulate
        model.fail_rank = options_fail_rank
        trainer.fit(model, ckpt_path=ckpt_path)

    if resume_from:  # another run's checkpoint (another strategy's)
        fit(tag, ckpt_path=resume_from.format(method=method))
        return
    if not resume_at:
        fit(tag)
        return
    saved = os.path.join(out, f"{tag}_checkpoints")
    fit(f"{tag}_uninterrupted", save_dir=saved)
    fit(f"{tag}_resumed", ckpt_path=os.path.join(saved, f"epoch=0-step={resume_at}.ckpt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-shard", action="store_true", help="configure_model shards nothing")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--check-masks", action="store_true")
    parser.add_argument("--tag", default="", help="added to the record's name")
    parser.add_argument("--resume-at", type=int, default=0)
    parser.add_argument("--full-checkpoint", action="store_true")
    parser.add_argument("--resume-from", default=None, help="a checkpoint ({method} filled in)")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--validate", action="store_true", help="validate before and between steps")
    parser.add_argument("--compile", choices=["", "blocks", "whole"], default="",
                        help="compile each block, or the network, after sharding")  # fmt: skip
    for args in planned(parser):
        for method in args.methods.split(","):
            options = {"seed": 3, "plot": False, "check_masks": args.check_masks}
            if args.clip is not None:
                options["gradient_clip_val"] = args.clip
            if method in ("slsam_paper", "random_slsam", "sl_s2sam"):
                options["layer_ratio"] = 0.5
            options.update(OPTIONS.get(method, {}))
            options["tag"], options["fail_rank"] = args.tag, args.fail_rank
            run(method, args.devices, args.steps, args.out, options, not args.no_shard,
                args.accumulate, args.precision, args.resume_at, args.full_checkpoint,
                args.resume_from, args.validate, args.compile)  # fmt: skip


if __name__ == "__main__":
    main()
    release_process_group()  # a gloo group alive at exit can abort a finished run
