"""Training processes that fail on purpose, run by tests/test_reliability.py.

Modes:

* ``train``: one process, SL-SAM on the small MLP for ``--steps`` steps with a step
  checkpoint every 2 steps; ``--kill-at K`` SIGKILLs the process inside the second (perturbed)
  pass of step K; ``--resume PATH`` resumes from a checkpoint. At the end, the weights,
  optimizer state and bandit probabilities are saved to ``<out>/final.pt``.
* ``diverge``: two gloo processes; process 1 reseeds its layer sampler, so the processes
  draw different layers. With ``--check-masks`` the run must stop with the debug error.
* ``kill``: two processes under ``ddp_spawn``; process 1 SIGKILLs itself at step 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

sys.path.insert(0, os.path.dirname(__file__))
from helpers import LitModel, ResumableLoader, make_data, make_mlp

from examples.methods import SLSAMAblation
from lightning_slsam import SparseLayerSAM


class Killable(LitModel):
    kill_at = -1

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.kill_at and self.sam_pass == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step, weights perturbed in memory
        return super().training_step(batch, batch_idx)


class Diverge(L.Callback):
    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 1:
            sam = next(c for c in trainer.callbacks if isinstance(c, SparseLayerSAM))
            sam.engine.selection._gen.manual_seed(12345)


def _trainer(**kwargs) -> L.Trainer:
    options = dict(accelerator="cpu", logger=False, enable_progress_bar=False, deterministic=True,
                   enable_model_summary=False, num_sanity_val_steps=0)  # fmt: skip
    options.update(kwargs)
    return L.Trainer(**options)


def train(args) -> None:
    L.seed_everything(7)
    model = Killable(make_mlp(seed=5))
    model.kill_at = args.kill_at
    sam = SLSAMAblation(layer_ratio=0.3, alpha_p=0.05)
    saver = ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), every_n_train_steps=2,
                            save_top_k=-1)  # fmt: skip
    trainer = _trainer(max_steps=args.steps, callbacks=[sam, saver], enable_checkpointing=True,
                       default_root_dir=args.out)  # fmt: skip
    data = ResumableLoader(make_data(96), batch_size=16)  # 6 steps per epoch
    trainer.fit(model, data, ckpt_path=args.resume)
    torch.save(
        {"weights": {n: p.detach().clone() for n, p in model.named_parameters()},
         "optimizer": trainer.optimizers[0].state_dict(), "probs": sam.probs.clone(),
         "counts": sam.engine.counts.clone(), "global_step": trainer.global_step},
        os.path.join(args.out, "final.pt"),
    )  # fmt: skip


def diverge(args) -> None:
    L.seed_everything(7)
    sam = SparseLayerSAM(layer_ratio=0.3, check_masks=args.check_masks)
    strategy = DDPStrategy(process_group_backend="gloo", start_method="fork", timeout=_timeout())
    trainer = _trainer(devices=2, strategy=strategy, max_steps=4, callbacks=[sam, Diverge()],
                       enable_checkpointing=False)  # fmt: skip
    trainer.fit(LitModel(make_mlp(seed=5)), ResumableLoader(make_data(64), batch_size=8))


class KillRank1(Killable):
    """Under ddp_spawn the rank is known only inside the process."""

    def on_train_start(self):
        self.kill_at = 2 if self.trainer.global_rank == 1 else -1


def kill_spawn(args) -> None:
    L.seed_everything(7)
    strategy = DDPStrategy(process_group_backend="gloo", start_method="spawn", timeout=_timeout())
    trainer = _trainer(devices=2, strategy=strategy, max_steps=6, enable_checkpointing=False,
                       callbacks=[SparseLayerSAM(layer_ratio=0.3)])  # fmt: skip
    trainer.fit(KillRank1(make_mlp(seed=5)), ResumableLoader(make_data(64), batch_size=8))


def _timeout():
    from datetime import timedelta

    return timedelta(seconds=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "diverge", "kill"])
    parser.add_argument("--out", default=".")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--check-masks", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    {"train": train, "diverge": diverge, "kill": kill_spawn}[args.mode](args)


if __name__ == "__main__":
    main()
