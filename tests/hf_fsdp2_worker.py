"""SAMTrainer under accelerate's FSDP2 (torchrun, 2 gloo processes on CPU) or in one process:
each rank saves its final weights (gathered whole), the steps' active layers and its
parameters' kind (DTensor shards under FSDP2).

accelerate sets FSDP up only on accelerators: on CPU processes (``MULTI_CPU``) it drops the
FSDP plugin and runs DDP without a word (``AcceleratorState.__init__``). ``_OnCPU`` puts the
plugin back after the Trainer built its Accelerator, so that the Trainer's own FSDP2 path
runs here (``accelerator.prepare`` -> ``fully_shard`` by decoder layer, its backward, its
clipping, its optimizer step); on GPUs the Trainer needs none of it.

SGD, whose update is linear in the gradient (see hf_ddp_worker.py), and sequences without
padding, so each process's mean loss is the same share of the global batch's.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/hf_fsdp2_worker.py \
        --out DIR --batch 4
    python tests/hf_fsdp2_worker.py --out DIR --batch 8
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from hf_helpers import tiny_causal_lm, training_args
from transformers import TrainerCallback

from lightning_slsam.hf import SAMTrainer


class _Steps(TrainerCallback):
    def __init__(self) -> None:
        self.trainer = None
        self.masks: list[list[bool]] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.masks.append(self.trainer.sam_engine.last_result.active_mask.tolist())


class _OnCPU(SAMTrainer):
    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state
        if self.args.fsdp_plugin_args is not None and state.distributed_type == "MULTI_CPU":
            state.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True


def _data(n: int = 64, seq: int = 8) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (n, seq), generator=gen)
    mask = torch.ones(seq, dtype=torch.long)
    return [{"input_ids": ids[i], "attention_mask": mask, "labels": ids[i]} for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--method", default="slsam")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--save", type=int, default=0, help="save a checkpoint every N steps")
    parser.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
    parser.add_argument("--tag", default="")
    parser.add_argument("--optim", default="sgd")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sharded: dict = {}
    if world > 1:
        wrap = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
        sharded = {"ddp_backend": "gloo", "fsdp": "full_shard auto_wrap", "fsdp_config": wrap}
    steps = _Steps()
    model = tiny_causal_lm(0)
    model.accepts_loss_kwargs = False  # each process's mean loss, averaged (hf_ddp_worker.py)
    trainer = _OnCPU(
        model=model, train_dataset=_data(),
        args=training_args(os.path.join(args.out, f"run{args.tag}"),
                           per_device_train_batch_size=args.batch, max_steps=5, optim=args.optim,
                           learning_rate=0.5, max_grad_norm=1.0,
                           gradient_accumulation_steps=args.accumulate,
                           save_strategy="steps" if args.save else "no",
                           save_steps=args.save or 500,
                           **sharded),
        sam=args.method, callbacks=[steps],
    )  # fmt: skip
    steps.trainer = trainer
    trainer.train(resume_from_checkpoint=args.resume)
    from torch.distributed.tensor import DTensor

    params = list(trainer.model.parameters())
    weights = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in trainer.model.state_dict().items()
    }
    rank = int(os.environ.get("RANK", "0"))
    torch.save(
        {"weights": weights, "masks": steps.masks, "world": world,
         "dtensors": sum(isinstance(p, DTensor) for p in params), "params": len(params),
         "seam": type(trainer.sam_engine.shards).__name__},
        os.path.join(args.out, f"rank{rank}_of{world}{args.tag}.pt"),
    )  # fmt: skip
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
