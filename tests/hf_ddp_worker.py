"""SAMTrainer under DDP (torchrun, 2 gloo processes on CPU) or in one process: each rank
saves its final weights, the steps' active layers and the bytes it all-reduced.

SGD, whose update is linear in the gradient: AdamW divides a tensor's near-zero gradient
by its own root mean square, turning the last bits of a sum taken in another order into
a visible step.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/hf_ddp_worker.py \
        --out DIR --batch 4 --method sam,slsam
    python tests/hf_ddp_worker.py --out DIR --batch 8 --method sam,slsam
"""

from __future__ import annotations

import os

import torch
from hf_helpers import (
    StepLog,
    classification_data,
    run_methods,
    tiny_classifier,
    training_args,
    worker_arguments,
)

from lightning_slsam.hf import SAMTrainer
from lightning_slsam.parallel.ddp import release_process_group


class _Recording(SAMTrainer):
    """Keeps the labels of each step's micro-batches."""

    def get_batch_samples(self, epoch_iterator, num_batches, *args, **kwargs):
        batches, items = super().get_batch_samples(epoch_iterator, num_batches, *args, **kwargs)
        self.labels = [*getattr(self, "labels", []), [b["input_ids"].tolist() for b in batches]]
        return batches, items


def main() -> None:
    args = worker_arguments(optim_args="")
    run_methods(args, train)


def train(args, method: str) -> None:
    """Trains ``method`` for 5 steps and saves ``{method}_rank{r}_of{world}.pt``."""
    steps = StepLog()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = {"ddp_backend": "gloo"} if world > 1 else {}
    model = tiny_classifier(0)
    # BERT's loss ignores the token count the Trainer hands it: without this, the Trainer
    # scales each process's mean loss by the process count (with or without SAM).
    model.accepts_loss_kwargs = False
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = _Recording(
        model=model, train_dataset=classification_data(96),
        args=training_args(os.path.join(args.out, method), per_device_train_batch_size=args.batch,
                           max_steps=5, optim="sgd", optim_args=args.optim_args or None,
                           learning_rate=0.5, **backend),
        sam=method, callbacks=[steps],
    )  # fmt: skip
    steps.trainer = trainer
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    torch.save(
        {"weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
         "start": start, "masks": steps.masks, "allreduce": steps.allreduce,
         "inputs": trainer.labels,
         "trainable_bytes": sum(p.numel() * p.element_size() for p in trainer.model.parameters()),
         "world": world},
        os.path.join(args.out, f"{method}_rank{rank}_of{world}.pt"),
    )  # fmt: skip


if __name__ == "__main__":
    main()
    release_process_group()  # a gloo group alive at exit can abort a finished run
