"""Golden runs: a refactor's safety net. Trains a fixed matrix of tiny, fully deterministic
runs with whatever ``lightning_slsam`` is importable, and compares two recordings tensor by
tensor (``torch.equal``): a refactor that must keep behaviour bit for bit identical keeps
every run equal.

The matrix: every method of the registry (SAM, SL-SAM with its presets, Random-SL-SAM,
Top-SL-SAM, S2-SAM, SL-S2-SAM, RST, ESAM, SSAM-F, LookSAM, the SL-SAM combinations, the
ablation, Momentum-SAM) through each front-end -- the plain loop (``make_engine`` and the
engine's ``train_step``), a Lightning ``Trainer`` with the method's callback and a
``SAMMixin`` module, ``FabricSAM`` in a Lightning Fabric loop, and the Hugging Face
``SAMTrainer`` on a tiny BERT -- 6 steps each on a small MLP; gradient accumulation,
clipping and a resume from a checkpoint; and multi-process runs on 2 gloo CPU processes
(Lightning DDP, Lightning FSDP2, the plain loop under DDP and FSDP2, Fabric DDP, the HF
Trainer under DDP). Each multi-process group runs in a subprocess of this script, so
``PYTHONPATH`` reaches it. ``--list`` prints the matrix.

Each run keeps, as CPU tensors: the final model ``state_dict`` (``model/...``), the
optimizer's ``state_dict`` (``optimizer/...``), the method's state (``method/...``: the
engine's or the front-end's checkpoint state), every loss the loss function returned
(``calls/loss``, one per forward pass), each step's result (``steps/<i>/...``: first-pass
loss, active layers, kind, ...) and the front-end's logged metrics where it keeps them.
Multi-process runs keep each rank's under ``rank<r>/``. A run that cannot run (a front-end
not installed or missing in that revision, an error) is listed as skipped, with why.

Against the revision a refactor starts from, in a git worktree put first on ``PYTHONPATH``
(this script itself imports nothing from ``tests/``, only the package's public names)::

    git worktree add /tmp/base HEAD       # or the starting commit
    PYTHONPATH=/tmp/base python benchmarks/golden_runs.py record /tmp/base.pt
    git worktree remove /tmp/base
    # ... the refactor ...
    python benchmarks/golden_runs.py record /tmp/after.pt
    python benchmarks/golden_runs.py compare /tmp/base.pt /tmp/after.pt

``compare`` prints one line per run (equal, or which tensors differ and by how much at
most), lists the runs only one file has, and exits 1 on any difference or missing run.
``record --only 'plain/*,lightning/slsam*'`` records a part of the matrix (globs).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FORMAT = "golden_runs/1"
STEPS = 6
BATCH = 16  # the global batch: 96 samples, 6 steps
SAMPLES = STEPS * BATCH
SEED = 0
LR = 1e-2
WEIGHT_DECAY = 0.01
WORLD = 2  # processes of a multi-process run
WORKER_TIMEOUT = 900

#: case -> (registry name, options beyond it): every method, with options that make 6 steps
#: exercise what it does (LookSAM's reuse, SSAM-F's mask refresh, both presets).
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "sam": ("sam", {}),
    "asam": ("sam", {"adaptive": True, "rho": 0.5}),
    "slsam": ("slsam", {}),  # SparseLayerSAM(): preset "default"
    "slsam_paper": ("slsam_paper", {}),  # SparseLayerSAM(preset="paper")
    "slsam_paper_half": ("slsam", {"preset": "paper", "layer_ratio": 0.5}),
    "random_slsam": ("random_slsam", {}),  # preset "paper"
    "random_slsam_default": ("random_slsam", {"preset": "default"}),
    "top_slsam": ("top_slsam", {"layer_ratio": 0.5}),
    "s2sam": ("s2sam", {}),
    "sl_s2sam": ("sl_s2sam", {}),  # preset "paper"
    "sl_s2sam_default": ("sl_s2sam", {"preset": "default"}),
    "rst": ("rst", {}),
    "esam": ("esam", {}),
    "ssamf": ("ssamf", {"mask_interval": 2}),
    "looksam": ("looksam", {"interval": 2, "alpha": 0.02}),
    "slsam_rst": ("slsam_rst", {}),
    "slsam_looksam": ("slsam_looksam", {"interval": 2, "alpha": 0.02}),
    "slsam_depth": ("slsam_depth", {}),
    "slsam_ablation": ("slsam_ablation", {"preset": "paper", "bandit_loss": "rank"}),
    "momentum_sam": ("momentum_sam", {}),
}
#: Methods whose loss function must return per-sample losses (ESAM picks samples by them);
#: the others return the mean.
PER_SAMPLE = {"esam", "ssamf"}
#: Cases of the multi-process groups.
PARALLEL_CASES = ["sam", "slsam", "slsam_paper", "esam", "looksam"]
#: StepResult fields kept per step.
STEP_FIELDS = ("loss", "active_mask", "kind", "pass_numel", "extra_backward",
               "allreduce_bytes", "skipped", "drawn", "active_ratio")  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One run of the matrix: ``<front-end>/<case>[_variant]``."""

    name: str
    frontend: str  # plain | lightning | fabric | hf
    case: str
    accumulate: int = 1
    clip: float | None = None
    resume: str = ""  # "whole": 2 epochs of 3 steps; "resumed": the 2nd from a checkpoint
    group: str = ""  # the multi-process worker group ("" = in this process)
    parallel: str = ""  # "ddp" | "fsdp2" (plain, lightning), "ddp" (fabric, hf)


def matrix() -> list[Run]:
    runs: list[Run] = []
    for frontend in ("plain", "lightning", "fabric", "hf"):
        runs += [Run(f"{frontend}/{case}", frontend, case) for case in CASES]
    runs.append(Run("lightning/adamw", "lightning", "adamw"))  # the mixin without a callback
    for case in ("sam", "slsam", "slsam_paper", "esam"):
        runs.append(Run(f"lightning/{case}_acc2", "lightning", case, accumulate=2))
    runs.append(Run("lightning/slsam_clip", "lightning", "slsam", clip=0.05))
    runs.append(Run("lightning/slsam_resume_whole", "lightning", "slsam", resume="whole"))
    runs.append(Run("lightning/slsam_resumed", "lightning", "slsam", resume="resumed"))
    for case in ("sam", "slsam", "esam"):
        runs.append(Run(f"fabric/{case}_acc2", "fabric", case, accumulate=2))
    runs.append(Run("fabric/slsam_clip", "fabric", "slsam", clip=0.05))
    runs.append(Run("hf/slsam_acc2", "hf", "slsam", accumulate=2))
    runs.append(Run("hf/sam_clip", "hf", "sam", clip=0.05))
    # Multi-process groups, each one subprocess of this script.
    for case in PARALLEL_CASES:
        runs.append(Run(f"ddp/lightning_{case}", "lightning", case, group="forked",
                        parallel="ddp"))  # fmt: skip
    runs.append(Run("ddp/lightning_slsam_acc2", "lightning", "slsam", accumulate=2,
                    group="forked", parallel="ddp"))  # fmt: skip
    for case in ("sam", "slsam", "slsam_paper"):
        runs.append(Run(f"fsdp2/lightning_{case}", "lightning", case, group="lightning_fsdp2",
                        parallel="fsdp2"))  # fmt: skip
    for parallel in ("ddp", "fsdp2"):
        for case in PARALLEL_CASES:
            runs.append(Run(f"{parallel}/plain_{case}", "plain", case, group="forked",
                            parallel=parallel))  # fmt: skip
    for case in ("sam", "slsam", "esam"):
        runs.append(Run(f"ddp/fabric_{case}", "fabric", case, group="fabric_ddp",
                        parallel="ddp"))  # fmt: skip
    for case in ("sam", "slsam", "slsam_paper"):
        runs.append(Run(f"ddp/hf_{case}", "hf", case, group="hf_ddp", parallel="ddp"))
    return runs


# -- what a run keeps ------------------------------------------------------------------------


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy (gathered first when sharded: a collective)."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().cpu().clone()


def flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``obj``'s tensors and numbers as CPU tensors under ``prefix/<key>/...`` (strings as
    their UTF-8 bytes; ``None`` left out)."""
    if isinstance(obj, torch.Tensor):
        out[prefix] = _whole(obj)
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):  # the same order on every rank (collectives)
            flatten(obj[key], f"{prefix}/{key}", out)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            flatten(value, f"{prefix}/{i}", out)
    elif isinstance(obj, bool):
        out[prefix] = torch.tensor(obj)
    elif isinstance(obj, int):
        out[prefix] = torch.tensor(obj, dtype=torch.int64)
    elif isinstance(obj, float):
        out[prefix] = torch.tensor(obj, dtype=torch.float64)
    elif isinstance(obj, str):
        out[prefix] = torch.tensor(list(obj.encode()), dtype=torch.uint8)
    elif obj is None:
        pass
    elif hasattr(obj, "__array__"):  # numpy
        out[prefix] = torch.as_tensor(obj.__array__()).clone()
    else:
        out[prefix] = torch.tensor(list(type(obj).__name__.encode()), dtype=torch.uint8)
    return out


class Trace:
    """What a run collects as it goes: every loss-function call, every step's result."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []
        self.steps: list[Any] = []

    def call(self, losses: torch.Tensor) -> None:
        self.calls.append(losses.detach().float().mean().cpu().clone())

    def step(self, result: Any) -> None:
        if result is not None and (not self.steps or result is not self.steps[-1]):
            self.steps.append(result)

    def record(self, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.calls:
            out["calls/loss"] = torch.stack(self.calls)
        for i, result in enumerate(self.steps):
            for name in STEP_FIELDS:
                if hasattr(result, name):
                    flatten(getattr(result, name), f"steps/{i}/{name}", out)
        return out


def _state(model: nn.Module, optimizer: Any, method_state: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    flatten(dict(model.state_dict()), "model", out)
    flatten(optimizer.state_dict(), "optimizer", out)
    flatten(method_state, "method", out)
    return out


# -- models and data (as the test-suite builds them) -----------------------------------------


def _seed(seed: int = SEED) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(seed)


def make_mlp(seed: int = SEED) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh(),
        nn.Linear(16, 3),
    )  # fmt: skip


def make_data(n: int = SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(n, 8, generator=gen)
    return x, x[:, :3].argmax(dim=1).long()


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def _options(case: str) -> tuple[str, dict[str, Any]]:
    method, options = CASES[case]
    return method, {"seed": SEED, **options}


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# -- front-ends ------------------------------------------------------------------------------


def run_plain(run: Run) -> dict[str, torch.Tensor]:
    """``make_engine`` and ``engine.train_step`` (under DDP: ``ddp=``; under FSDP2: each
    linear layer and the root ``fully_shard``-ed)."""
    from lightning_slsam import make_engine

    _seed()
    rank, world = _rank_world()
    net = make_mlp()
    wrapper: nn.Module = net
    ddp = None
    if run.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapper = ddp = DistributedDataParallel(net)
    elif run.parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(net)
    method, options = _options(run.case)
    optimizer = _optimizer(net.parameters())
    engine = make_engine(method, net, **options)
    x, y = make_data()
    trace = Trace()
    per_sample = method in PER_SAMPLE
    for step in range(STEPS):
        xb = x[step * BATCH : (step + 1) * BATCH][rank::world]
        yb = y[step * BATCH : (step + 1) * BATCH][rank::world]

        def loss(index: Any = None, xb: torch.Tensor = xb, yb: torch.Tensor = yb) -> torch.Tensor:
            if index is not None:
                xb, yb = xb[index], yb[index]
            losses = F.cross_entropy(wrapper(xb), yb, reduction="none")
            trace.call(losses)
            return losses if per_sample else losses.mean()

        extra = {"ddp": ddp} if ddp is not None else {}
        trace.step(engine.train_step(loss, optimizer, batch_size=len(xb), **extra))
    return trace.record(_state(net, optimizer, engine.state_dict()))


def _lightning_module(per_sample: bool, trace: Trace, accumulate: int, samples: int) -> Any:
    import lightning as L
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_slsam import SAMMixin

    class GoldenModule(SAMMixin, L.LightningModule):
        shard = False

        def __init__(self) -> None:
            super().__init__()
            self.net = make_mlp()

        def configure_model(self) -> None:
            if self.shard and self.trainer.world_size > 1:
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for layer in self.net:
                    if isinstance(layer, nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            losses = F.cross_entropy(self(x), y, reduction="none")
            trace.call(losses)
            return losses if per_sample else losses.mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _optimizer(self.parameters())

        def train_dataloader(self) -> DataLoader:
            data = TensorDataset(*(t[:samples] for t in make_data()))
            world, rank = self.trainer.world_size, self.trainer.global_rank
            sampler = DistributedSampler(data, world, rank, shuffle=False) if world > 1 else None
            return DataLoader(data, batch_size=BATCH // accumulate // world, sampler=sampler,
                              shuffle=False)  # fmt: skip

    return GoldenModule()


def _lightning_recorder(trace: Trace, keep: dict[str, Any], out: str | None) -> Any:
    import lightning as L

    class Recorder(L.Callback):
        """Each step's result; the final state at train end (per rank: ``out`` file)."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            sam = [cb for cb in trainer.callbacks if hasattr(cb, "engine")]
            engine = sam[0].engine if sam else None
            trace.step(getattr(engine, "last_result", None))

        def on_train_end(self, trainer, pl_module):
            sam = [cb for cb in trainer.callbacks if hasattr(cb, "engine")]
            state = sam[0].state_dict() if sam else None
            record = _state(pl_module, trainer.optimizers[0], state)
            record["trainer/global_step"] = torch.tensor(trainer.global_step)
            for key, value in sorted(trainer.callback_metrics.items()):
                if isinstance(value, torch.Tensor) and "time" not in key:
                    record[f"metrics/{key}"] = _whole(value)
            trace.record(record)
            keep["record"] = record
            if out is not None:
                torch.save(record, f"{out}__rank{trainer.global_rank}.pt")

    return Recorder()


def run_lightning(run: Run, out: str | None = None) -> dict[str, torch.Tensor] | None:
    """A ``Trainer`` with the method's callback and a ``SAMMixin`` module (manual
    optimization); ``out``: where each rank saves its record (multi-process runs)."""
    import lightning as L

    from lightning_slsam import make_callback

    method, options = _options(run.case) if run.case != "adamw" else ("adamw", {})
    if run.accumulate > 1:
        options["accumulate_grad_batches"] = run.accumulate
    if run.clip is not None:
        options["gradient_clip_val"] = run.clip
    if method != "adamw":
        options["plot"] = False  # no activation chart at the end of fit
    strategy: Any = "auto"
    if run.parallel == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(process_group_backend="gloo", start_method="fork")
    elif run.parallel == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)

    def fit(folder: str, epochs: int | None, recorded: bool, ckpt_path: str | None = None,
            save: bool = False) -> dict[str, Any]:  # fmt: skip
        L.seed_everything(SEED, verbose=False)
        trace, keep = Trace(), {}
        samples = SAMPLES if not run.resume else SAMPLES // 2  # resume: 3 steps an epoch
        model = _lightning_module(method in PER_SAMPLE, trace, run.accumulate, samples)
        model.shard = run.parallel == "fsdp2"
        callbacks: list[Any] = [make_callback(method, **options)] if method != "adamw" else []
        if recorded:
            callbacks.append(_lightning_recorder(trace, keep, out))
        if save:
            from lightning.pytorch.callbacks import ModelCheckpoint

            callbacks.append(ModelCheckpoint(folder, every_n_epochs=1, save_top_k=-1))
        trainer = L.Trainer(
            accelerator="cpu", devices=WORLD if run.parallel else 1, strategy=strategy,
            max_steps=-1 if epochs else STEPS, max_epochs=epochs or 1, callbacks=callbacks,
            logger=False, enable_checkpointing=save, enable_progress_bar=False,
            enable_model_summary=False, deterministic=True, num_sanity_val_steps=0,
            limit_val_batches=0, use_distributed_sampler=False, default_root_dir=folder,
        )  # fmt: skip
        trainer.fit(model, ckpt_path=ckpt_path)
        return keep

    with tempfile.TemporaryDirectory(prefix="golden_") as folder:
        if run.resume == "whole":
            return fit(folder, 2, True).get("record")
        if run.resume == "resumed":
            fit(folder, 1, False, save=True)
            (ckpt,) = [f for f in os.listdir(folder) if f.endswith(".ckpt")]
            return fit(folder, 2, True, ckpt_path=os.path.join(folder, ckpt)).get("record")
        return fit(folder, None, True).get("record")


def run_fabric(run: Run, fabric: Any = None) -> dict[str, torch.Tensor]:
    """``FabricSAM`` over the model and optimizer ``fabric.setup`` returned."""
    import lightning as L

    from lightning_slsam import FabricSAM

    if fabric is None:
        fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    _seed()
    rank, world = fabric.global_rank, fabric.world_size
    net = make_mlp()
    model, optimizer = fabric.setup(net, _optimizer(net.parameters()))
    method, options = _options(run.case)
    sam = FabricSAM(fabric, model, optimizer, method, gradient_clip_val=run.clip, **options)
    per_sample = method in PER_SAMPLE
    trace = Trace()

    def loss_fn(batch: Any) -> torch.Tensor:
        xb, yb = batch
        losses = F.cross_entropy(model(xb), yb, reduction="none")
        trace.call(losses)
        return losses if per_sample else losses.mean()

    x, y = make_data()
    size = BATCH // run.accumulate
    for step in range(STEPS):
        xs, ys = x[step * BATCH : (step + 1) * BATCH], y[step * BATCH : (step + 1) * BATCH]
        batches = [(xs[i : i + size][rank::world], ys[i : i + size][rank::world])
                   for i in range(0, BATCH, size)]  # fmt: skip
        trace.step(sam.step(loss_fn, *batches))
    return trace.record(_state(net, optimizer, sam.state_dict()))


def _hf_model() -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(SEED)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    model = BertForSequenceClassification(config)
    # BERT's loss ignores the token count the Trainer hands it: without this the Trainer
    # scales each process's mean loss by the process count.
    model.accepts_loss_kwargs = False
    return model


def _hf_data(n: int = SAMPLES, seq: int = 8) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(1, 64, (n, seq), generator=gen)
    labels = (ids == 5).any(1).long() | (ids[:, 0] < 32).long()
    return [{"input_ids": ids[i], "attention_mask": torch.ones(seq, dtype=torch.long),
             "labels": labels[i]} for i in range(n)]  # fmt: skip


def _hf_spec(method: str, options: dict[str, Any]) -> Any:
    """The method with its options, as ``SAMTrainer(sam=...)`` takes it."""
    try:
        from lightning_slsam.methods.registry import method_spec
    except ImportError:  # elsewhere in another revision: the callback's specification
        from lightning_slsam import make_callback

        return make_callback(method, **options).spec
    return method_spec(method, **options)


def run_hf(run: Run) -> dict[str, torch.Tensor]:
    """``SAMTrainer`` (the Hugging Face Trainer) on a tiny BERT classifier; under
    ``torchrun`` each process takes its share of the global batch (DDP, gloo)."""
    from transformers import TrainerCallback, TrainingArguments

    from lightning_slsam.hf import SAMTrainer

    trace = Trace()
    world = int(os.environ.get("WORLD_SIZE", "1"))

    class GoldenTrainer(SAMTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            output = super().compute_loss(model, inputs, *args, **kwargs)
            trace.call(output[0] if isinstance(output, tuple) else output)
            return output

    class Steps(TrainerCallback):
        trainer: Any = None

        def on_step_end(self, args, state, control, **kwargs):
            trace.step(getattr(self.trainer.sam_engine, "last_result", None))

    method, options = _options(run.case)
    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(
            output_dir=folder, per_device_train_batch_size=BATCH // run.accumulate // world,
            gradient_accumulation_steps=run.accumulate, max_steps=STEPS, learning_rate=LR,
            lr_scheduler_type="constant", weight_decay=WEIGHT_DECAY, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, seed=SEED,
            dataloader_num_workers=0, disable_tqdm=True, max_grad_norm=run.clip or 0.0,
            **({"ddp_backend": "gloo"} if world > 1 else {}),
        )  # fmt: skip
        steps = Steps()
        trainer = GoldenTrainer(model=_hf_model(), args=args, train_dataset=_hf_data(),
                                sam=_hf_spec(method, options), callbacks=[steps])  # fmt: skip
        steps.trainer = trainer
        trainer.train()
    record = _state(trainer.model, trainer.optimizer, trainer.sam_engine.state_dict())
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    for i, entry in enumerate(logs):
        for key, value in sorted(entry.items()):
            if isinstance(value, (int, float)) and "runtime" not in key and "per_second" not in key:
                record[f"logs/{i}/{key}"] = torch.tensor(value, dtype=torch.float64)
    return trace.record(record)


FRONTENDS: dict[str, Callable[[Run], dict[str, torch.Tensor] | None]] = {
    "plain": run_plain,
    "lightning": run_lightning,
    "fabric": run_fabric,
    "hf": run_hf,
}


def _unavailable(frontend: str) -> str | None:
    """Why ``frontend`` cannot run here (``None``: it can)."""
    needs = {
        "plain": ["make_engine"],
        "lightning": ["SAMMixin", "make_callback"],
        "fabric": ["FabricSAM"],
        "hf": [],
    }
    try:
        import lightning_slsam

        for name in needs[frontend]:
            getattr(lightning_slsam, name)
        if frontend == "hf":
            import lightning_slsam.hf
    except (ImportError, AttributeError) as err:
        return f"front-end unavailable: {type(err).__name__}: {err}"
    return None


def _failure(err: BaseException) -> str:
    last = traceback.extract_tb(err.__traceback__)[-1:]
    where = f" ({os.path.basename(last[0].filename)}:{last[0].lineno})" if last else ""
    return f"error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}{where}"


# -- multi-process groups (subprocesses of this script) --------------------------------------


def _file(out: str, run: Run, rank: int) -> str:
    return os.path.join(out, f"{run.name.replace('/', '+')}__rank{rank}.pt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plain_rank(rank: int, port: int, out: str, runs: list[Run]) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        for run in runs:
            record = run_plain(run)
            torch.save(record, _file(out, run, rank))
    finally:
        dist.destroy_process_group()


def worker(group: str, out: str, names: list[str]) -> None:
    """Run the ``group``'s runs named ``names`` on 2 processes; each rank saves each run's
    record to ``out``."""
    _quiet()
    import lightning_slsam

    package = os.path.dirname(os.path.abspath(lightning_slsam.__file__))
    expected = os.environ.get("GOLDEN_RUNS_PACKAGE", package)
    if package != expected:  # the record's package, not another one
        raise SystemExit(f"worker imported lightning_slsam from {package}, not {expected}")
    runs = [r for r in matrix() if r.group == group and r.name in names]
    if group == "forked":  # processes forked from this one: the plain loop's, Lightning's
        import torch.multiprocessing as mp

        plain = [r for r in runs if r.frontend == "plain"]
        if plain:
            mp.start_processes(_plain_rank, args=(_free_port(), out, plain), nprocs=WORLD,
                               start_method="fork")  # fmt: skip
        for run in [r for r in runs if r.frontend == "lightning"]:
            run_lightning(run, out=_file(out, run, 0).rsplit("__rank", 1)[0])
    elif group == "lightning_fsdp2":  # the strategy runs this script again for rank 1
        for run in runs:
            run_lightning(run, out=_file(out, run, 0).rsplit("__rank", 1)[0])
    elif group == "fabric_ddp":
        import lightning as L
        from lightning.fabric.strategies import DDPStrategy

        fabric = L.Fabric(accelerator="cpu", devices=WORLD,
                          strategy=DDPStrategy(process_group_backend="gloo"))  # fmt: skip
        fabric.launch()
        for run in runs:
            torch.save(run_fabric(run, fabric), _file(out, run, fabric.global_rank))
    elif group == "hf_ddp":
        rank = int(os.environ.get("RANK", "0"))
        for run in runs:
            torch.save(run_hf(run), _file(out, run, rank))
    else:
        raise ValueError(f"unknown group {group!r}")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # a gloo group alive at exit can abort the process


def _launch(group: str, runs: list[Run], out: str) -> str | None:
    """Run ``group`` in a subprocess; the error's tail, or ``None``."""
    script = os.path.abspath(__file__)
    command = [sys.executable, script, "_worker", group, out, ",".join(r.name for r in runs)]
    if group == "hf_ddp":
        command[1:2] = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                        str(WORLD), script]  # fmt: skip
    import lightning_slsam

    env = {
        **os.environ,
        "GOLDEN_RUNS_PACKAGE": os.path.dirname(os.path.abspath(lightning_slsam.__file__)),
    }
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env,
                              timeout=WORKER_TIMEOUT)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"worker {group} timed out after {WORKER_TIMEOUT} s"
    if done.returncode != 0:
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        error = [line for line in lines if "Error" in line or "error" in line]
        return f"worker {group} exited {done.returncode}: {(error or lines or [''])[-1][:300]}"
    return None


# -- record ----------------------------------------------------------------------------------


def _quiet() -> None:
    """One thread, deterministic algorithms, and no chatter from the libraries."""
    import logging

    torch.set_num_threads(1)  # the same reductions on every machine and every process
    torch.use_deterministic_algorithms(True)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with contextlib.suppress(ImportError):
        import lightning  # noqa: F401  (it sets its loggers' levels when imported)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers",
                 "lightning_slsam"):  # fmt: skip
        logging.getLogger(name).setLevel(logging.ERROR)


@contextlib.contextmanager
def _silenced() -> Iterator[io.StringIO]:
    """A run's prints (summaries, tips), kept apart from the script's own lines."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        yield buffer


def _selected(patterns: str | None) -> list[Run]:
    runs = matrix()
    if not patterns:
        return runs
    globs = [p.strip() for p in patterns.split(",") if p.strip()]
    return [r for r in runs if any(fnmatch.fnmatchcase(r.name, g) for g in globs)]


def _meta() -> dict[str, str]:
    import platform

    meta = {"format": FORMAT, "torch": str(torch.__version__),
            "python": platform.python_version()}  # fmt: skip
    try:
        import lightning_slsam

        meta["lightning_slsam"] = os.path.dirname(os.path.abspath(lightning_slsam.__file__))
        meta["version"] = str(getattr(lightning_slsam, "__version__", "?"))
        folder = os.path.dirname(meta["lightning_slsam"])
        head = subprocess.run(["git", "-C", folder, "rev-parse", "HEAD"], capture_output=True,
                              text=True)  # fmt: skip
        dirty = subprocess.run(["git", "-C", folder, "status", "--porcelain", "--",
                                "lightning_slsam"], capture_output=True, text=True)  # fmt: skip
        if head.returncode == 0:
            meta["commit"] = head.stdout.strip() + (" (modified)" if dirty.stdout.strip() else "")
    except ImportError as err:
        meta["lightning_slsam"] = f"not importable: {err}"
    return meta


def record(path: str, patterns: str | None = None) -> int:
    _quiet()
    started = time.perf_counter()
    runs = _selected(patterns)
    results: dict[str, dict[str, torch.Tensor]] = {}
    skipped: dict[str, str] = {}
    meta = _meta()
    print(f"lightning_slsam from {meta['lightning_slsam']} ({meta.get('commit', '?')})")
    for run in [r for r in runs if not r.group]:
        t0 = time.perf_counter()
        why = _unavailable(run.frontend)
        if why is None:
            try:
                with _silenced():
                    produced = FRONTENDS[run.frontend](run)
                if produced is None:
                    why = "error: the run recorded nothing"
                else:
                    results[run.name] = produced
            except Exception as err:
                why = _failure(err)
        if why is not None:
            skipped[run.name] = why
        status = "ok" if why is None else f"SKIPPED ({why})"
        print(f"{time.perf_counter() - t0:6.1f} s  {run.name}: {status}", flush=True)
    groups: dict[str, list[Run]] = {}
    for run in runs:
        if run.group:
            groups.setdefault(run.group, []).append(run)
    for group, members in groups.items():
        t0 = time.perf_counter()
        runnable = []
        for run in members:
            unavailable = _unavailable(run.frontend)
            if unavailable is None:
                runnable.append(run)
            else:
                skipped[run.name] = unavailable
        out = tempfile.mkdtemp(prefix=f"golden_{group}_")
        try:
            why = _launch(group, runnable, out) if runnable else None
            for run in runnable:
                files = [_file(out, run, rank) for rank in range(WORLD)]
                if all(os.path.exists(f) for f in files):
                    merged: dict[str, torch.Tensor] = {}
                    for rank, file in enumerate(files):
                        for key, value in torch.load(file, weights_only=True).items():
                            merged[f"rank{rank}/{key}"] = value
                    results[run.name] = merged
                else:
                    skipped[run.name] = why or f"worker {group} saved no record of the run"
        finally:
            shutil.rmtree(out, ignore_errors=True)
        done = sum(r.name in results for r in members)
        print(f"{time.perf_counter() - t0:6.1f} s  group {group}: {done}/{len(members)} runs"
              + (f" (SKIPPED: {why})" if why else ""), flush=True)  # fmt: skip
    meta["seconds"] = f"{time.perf_counter() - started:.0f}"
    torch.save({"format": FORMAT, "meta": meta, "runs": results, "skipped": skipped}, path)
    print(f"{len(results)} runs recorded, {len(skipped)} skipped, in {meta['seconds']} s: {path}")
    for name, why in skipped.items():
        print(f"  skipped {name}: {why}")
    return 0


# -- compare ---------------------------------------------------------------------------------


def _differs(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """How ``a`` and ``b`` differ (``None``: equal, NaNs in the same places included)."""
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if torch.equal(a, b):
        return None
    if a.is_floating_point() or a.is_complex():
        nan = a.isnan() | b.isnan()
        if torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~nan], b[~nan]):
            return None
        diff = (a[~nan].double() - b[~nan].double()).abs()
        most = float(diff.max()) if diff.numel() else float("nan")
        return f"max abs diff {most:.3g}" + (" (NaNs differ)" if nan.any() else "")
    if a.dtype == torch.bool:
        return f"{int((a != b).sum())} of {a.numel()} differ"
    return f"max abs diff {int((a.long() - b.long()).abs().max())}"


def _load(path: str) -> dict[str, Any]:
    data = torch.load(path, weights_only=True)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SystemExit(f"{path} is not a golden_runs recording ({FORMAT}).")
    return data


def compare(path_a: str, path_b: str, shown: int = 4) -> int:
    a, b = _load(path_a), _load(path_b)
    runs_a, runs_b = a["runs"], b["runs"]
    failed = 0
    equal = 0
    for name in [n for n in runs_a if n in runs_b]:
        ta, tb = runs_a[name], runs_b[name]
        problems = []
        for key in [k for k in ta if k in tb]:
            why = _differs(ta[key], tb[key])
            if why is not None:
                problems.append(f"{key} ({why})")
        problems += [f"{k} (only in A)" for k in ta if k not in tb]
        problems += [f"{k} (only in B)" for k in tb if k not in ta]
        if problems:
            failed += 1
            more = f", ... {len(problems) - shown} more" if len(problems) > shown else ""
            print(f"DIFFERS  {name}: {len(problems)} of {len(set(ta) | set(tb))} tensors:"
                  f" {', '.join(problems[:shown])}{more}")  # fmt: skip
        else:
            equal += 1
            print(f"equal    {name} ({len(ta)} tensors)")
    for mine, theirs, label, other in ((a, b, "A", "B"), (b, a, "B", "A")):
        for name in [n for n in mine["runs"] if n not in theirs["runs"]]:
            failed += 1
            why = theirs["skipped"].get(name, "not in its matrix")
            print(f"MISSING  {name}: only in {label} ({other}: {why})")
    for name in [n for n in a["skipped"] if n in b["skipped"]]:
        print(f"skipped  {name}: in both (A: {a['skipped'][name]})")
    print(f"{equal} equal, {failed} differing or missing;"
          f" A: {path_a} ({a['meta'].get('commit', '?')}),"
          f" B: {path_b} ({b['meta'].get('commit', '?')})")  # fmt: skip
    return 1 if failed else 0


# -- command line ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    try:
        from examples.methods import registered  # slsam_ablation, by name
    except ImportError:  # a revision whose package holds slsam_ablation
        registered = contextlib.nullcontext
    with registered():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:  # a multi-process group (see _launch)
        worker(argv[1], argv[2], argv[3].split(","))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="train the matrix and save it to OUT")
    rec.add_argument("out", nargs="?")
    rec.add_argument("--only", help="comma-separated globs of run names ('plain/*,hf/sam')")
    rec.add_argument("--list", action="store_true", help="print the matrix's runs and exit")
    cmp = commands.add_parser("compare", help="compare two recordings; 1 if they differ")
    cmp.add_argument("a")
    cmp.add_argument("b")
    args = parser.parse_args(argv)
    if args.command == "compare":
        return compare(args.a, args.b)
    if args.list:
        for run in _selected(args.only):
            print(run.name + (f"  [{run.group}]" if run.group else ""))
        return 0
    if not args.out:
        parser.error("record needs OUT (a .pt file)")
    return record(args.out, args.only)


if __name__ == "__main__":
    sys.exit(main())
