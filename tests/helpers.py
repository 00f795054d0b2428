"""Small models, data and an independent SAM reference loop shared by the tests."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import kernels
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_slsam import SAMMixin

kernels.apply()  # worker processes import this module: the variant reaches them too


def make_data(
    n: int = 64, dim: int = 8, classes: int = 3, seed: int = 0, indexed: int = 0
) -> TensorDataset:
    """``n`` samples (x, y); ``indexed``: each with an index last (SAF's), counting up to
    ``indexed`` and again (so that a short run revisits its "samples", as epochs would)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen)
    y = (x[:, :classes].argmax(dim=1)).long()
    if not indexed:
        return TensorDataset(x, y)
    return TensorDataset(x, y, torch.arange(n) % indexed)


def per_sample_outputs(model: nn.Module, batch) -> dict:
    """``model``'s per-sample cross-entropy on ``batch`` (x, y[, index]) with what the methods
    read besides: the logits (MESA, SAF) and, where the batch carries them, the samples'
    indices (SAF)."""
    logits = model(batch[0])
    out = {"loss": F.cross_entropy(logits, batch[1], reduction="none"), "logits": logits}
    if len(batch) > 2:
        out["index"] = batch[2]
    return out


def loader(dataset: TensorDataset, batch_size: int = 16) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


def rank_loader(trainer: L.Trainer, global_batch: int) -> DataLoader:
    """64 samples for a multi-process test: rank r takes samples r, r + world, ... of each
    batch (Lightning's own sampler would shuffle), so the ranks' batches together are the
    one-process batch of ``global_batch`` samples. Each sample carries its index (SAF's)."""
    data, world = make_data(64, indexed=global_batch), trainer.world_size
    sampler = (
        DistributedSampler(data, world, trainer.global_rank, shuffle=False) if world > 1 else None
    )
    return DataLoader(data, batch_size=global_batch // world, sampler=sampler)


def make_mlp(dim: int = 8, hidden: int = 16, classes: int = 3, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(dim, hidden),
        nn.Tanh(),
        nn.LayerNorm(hidden),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, classes),
    )


class HeadMLP(nn.Module):
    """``make_mlp`` with a fresh task head it names (``sam_head_parameters``): the head rule
    of SL-SAM's default preset applies to it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_mlp(classes=8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))

    def sam_head_parameters(self) -> list[str]:
        return ["head.weight", "head.bias"]


def linear_sgd(params, lr: float = 0.1, weight_decay: float = 0.01) -> torch.optim.SGD:
    """SGD with momentum: the optimizer of runs compared across process counts, precisions
    or code paths (the multi-process workers). Its update is linear in the gradient, so two
    runs that sum the same gradients in another order differ by rounding; AdamW divides each
    update by the gradient's root mean square, and a near-zero gradient's last bits become a
    step of up to the learning rate (tests/tolerance.py). The momentum gives resume tests an
    optimizer state to restore."""
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)


def compared_optimizer(compiled: bool = False) -> dict:
    """:class:`LitModel`'s optimizer for the multi-process workers' runs: :func:`linear_sgd`
    at lr 0.1. Compiled runs keep AdamW at lr 1e-2: their last 4 steps run under
    ``fail_on_recompile``, so they must draw only layer patterns the first 4 traced, which
    AdamW's trajectory does (under linear_sgd a pattern first seen at step 5 recompiled);
    against one process they use 1% of their tolerance."""
    if compiled:
        return {"lr": 1e-2, "optimizer": torch.optim.AdamW}
    return {"lr": 0.1, "optimizer": linear_sgd}


class LitModel(SAMMixin, L.LightningModule):
    """A classifier around any ``net``; optimizer and scheduler are configurable."""

    def __init__(
        self,
        net: nn.Module,
        lr: float = 1e-2,
        weight_decay: float = 0.01,
        scheduler: Callable | None = None,
        scheduler_config: dict | None = None,
        optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
    ) -> None:
        super().__init__()
        self.net = net
        self.lr = lr
        self.weight_decay = weight_decay
        self.scheduler = scheduler
        self.scheduler_config = scheduler_config or {}
        self.optimizer = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch[0], batch[1]
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch[0], batch[1]
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        opt = self.optimizer(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        if self.scheduler is None:
            return opt
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": self.scheduler(opt), **self.scheduler_config},
        }


def trainer(callbacks=(), **kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return L.Trainer(callbacks=list(callbacks), **defaults)


class Snapshots(L.Callback):
    """Records every parameter after each training batch (and before the first)."""

    def __init__(self) -> None:
        self.before: dict[str, torch.Tensor] | None = None
        self.after: list[dict[str, torch.Tensor]] = []
        self.masks: list[torch.Tensor | None] = []

    @staticmethod
    def _state(module: nn.Module) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    def on_train_start(self, trainer, pl_module) -> None:
        self.before = self._state(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.after.append(self._state(pl_module))
        sam = [cb for cb in trainer.callbacks if hasattr(cb, "active_mask")]
        mask = sam[0].active_mask if sam else None
        self.masks.append(None if mask is None else mask.clone())


def _cross_entropy(net: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(net(x), y)


def reference_sam(
    net: nn.Module,
    batches: list,
    rho: float,
    lr: float,
    weight_decay: float,
    eps: float = 1e-12,
    loss_fn: Callable = _cross_entropy,
    optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
) -> list[dict[str, torch.Tensor]]:
    """Plain SAM + AdamW (or another ``optimizer``), written from the SAM paper without any
    project code."""
    net = copy.deepcopy(net)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = optimizer(params, lr=lr, weight_decay=weight_decay)
    history = []

    def loss_of(batch):  # a loss function of MODELS returns a dict with its logits
        loss = loss_fn(net, batch)
        return loss["loss"].mean() if isinstance(loss, dict) else loss

    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss_of(batch).backward()
        with torch.no_grad():
            norm = torch.norm(torch.stack([p.grad.norm(p=2) for p in params]), p=2)
            old = [p.clone() for p in params]
            for p in params:
                p.add_(p.grad * (rho / (norm + eps)))
        opt.zero_grad(set_to_none=True)
        loss_of(batch).backward()
        with torch.no_grad():
            for p, o in zip(params, old):
                p.copy_(o)
        opt.step()
        history.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return history


class ResumableLoader(DataLoader):
    """A DataLoader that Lightning can resume mid-epoch (it skips the batches already seen)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._skip = 0
        self._seen = 0

    def __iter__(self):
        skip, self._skip = self._skip, 0
        self._seen = skip
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self._seen += 1
                yield batch

    def state_dict(self) -> dict:
        return {"seen": self._seen}

    def load_state_dict(self, state: dict) -> None:
        self._skip = state["seen"]


# -- small real architectures: a timm ViT and Transformers models (random init) -------------


class Wrapped(SAMMixin, L.LightningModule):
    """A LightningModule around ``net`` with a ``loss_fn(net, batch)``."""

    def __init__(self, net, loss_fn, lr=1e-3, optimizer=torch.optim.AdamW):
        super().__init__()
        self.net = net
        self.loss_fn = loss_fn
        self.lr = lr
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        return self.loss_fn(self.net, batch)

    def configure_optimizers(self):
        return self.optimizer(self.parameters(), lr=self.lr, weight_decay=0.01)


#: The models every method trains (tests/test_methods_models.py): each batch ends with the
#: samples' indices (SAF's), each loss function returns its logits (MESA's and SAF's).


def _reduce(losses: torch.Tensor, per_sample: bool) -> torch.Tensor:
    """The per-sample losses (ESAM ranks them), or their mean."""
    return losses if per_sample else losses.mean()


def vit_model(per_sample: bool = False):
    import timm

    torch.manual_seed(0)
    net = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4,
        embed_dim=32, depth=2, num_heads=2, num_classes=3,
    )  # fmt: skip
    data = TensorDataset(torch.randn(16, 3, 16, 16), torch.randint(0, 3, (16,)), torch.arange(16))

    def loss_fn(m, batch):
        logits = m(batch[0])
        losses = F.cross_entropy(logits, batch[1], reduction="none")
        return {"loss": _reduce(losses, per_sample), "logits": logits, "index": batch[-1]}

    return net, data, loss_fn


def bert_model(per_sample: bool = False):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    net = BertForSequenceClassification(cfg)
    data = TensorDataset(
        torch.randint(1, 50, (16, 12)), torch.randint(0, 2, (16,)), torch.arange(16)
    )

    def loss_fn(m, batch):
        logits = m(input_ids=batch[0]).logits
        losses = F.cross_entropy(logits, batch[1], reduction="none")
        return {"loss": _reduce(losses, per_sample), "logits": logits, "index": batch[-1]}

    return net, data, loss_fn


def llama_model(per_sample: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=True,
    )  # fmt: skip
    net = LlamaForCausalLM(cfg)
    data = TensorDataset(torch.randint(0, 64, (16, 12)), torch.arange(16))

    def loss_fn(m, batch):
        ids = batch[0]
        logits = m(input_ids=ids).logits[:, :-1]
        tokens = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        # the causal LM loss per sequence; MESA and SAF read every token's logits
        loss = _reduce(tokens.mean(dim=1), per_sample)
        return {"loss": loss, "logits": logits, "index": batch[-1]}

    return net, data, loss_fn


MODELS = {"timm-vit": vit_model, "bert": bert_model, "llama": llama_model}


class ShardProbe(L.Callback):
    """Writes ``<path>_rank<r>.pt`` per process: whether the parameters were sharded
    DTensors, the layer masks the SAM callback drew, and the final step (for runs launched
    as a separate program, e.g. through the CLI)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.masks: list[torch.Tensor] = []
        self.before: dict[str, torch.Tensor] = {}
        self.sharded: list[bool] = []

    @staticmethod
    def _whole(module: nn.Module) -> dict[str, torch.Tensor]:  # a collective when sharded
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in module.named_parameters()}  # fmt: skip

    def on_train_start(self, trainer, pl_module) -> None:
        self.before = self._whole(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # After the step (FSDP2 keeps the root's parameters unsharded after a forward).
        self.sharded = [type(p).__name__ == "DTensor" for p in pl_module.parameters()]
        sam = [cb for cb in trainer.callbacks if hasattr(cb, "engine")]
        if sam and sam[0].engine is not None and sam[0].engine.last_result is not None:
            self.masks.append(sam[0].engine.last_result.active_mask.clone())

    def on_train_end(self, trainer, pl_module) -> None:
        after = self._whole(pl_module)
        changed = [n for n in after if not torch.equal(after[n], self.before[n])]
        record = {"sharded": all(self.sharded), "masks": self.masks, "changed": changed,
                  "weights": after, "global_step": trainer.global_step}  # fmt: skip
        torch.save(record, f"{self.path}_rank{trainer.global_rank}.pt")


def launch(worker: str, runs: list[list[str]], out, timeout: int = 900) -> None:
    """Run a worker script once for several runs (``--plan``): each process start (imports,
    and with Lightning's subprocess launcher the second rank's) is paid once, not per run."""
    import json
    import subprocess
    import sys

    plan = out / f"plan_{len(list(out.glob('plan_*.json')))}.json"
    plan.write_text(json.dumps([[*run, "--out", str(out)] for run in runs]))
    done = subprocess.run(
        [sys.executable, worker, "--plan", str(plan)], capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def planned(parser) -> Iterator:
    """A worker's runs: its command line's, or every argument list of ``--plan FILE`` (see
    :func:`launch`), in order. A second rank started by re-running the script reads the
    same file, so both ranks run the same fits."""
    import json
    import sys

    if sys.argv[1:2] == ["--plan"]:
        with open(sys.argv[2]) as f:
            runs = json.load(f)
        for number, run in enumerate(runs, 1):  # which run of the plan failed, in the output
            print(f"plan run {number}/{len(runs)}: {' '.join(run)}", file=sys.stderr, flush=True)
            yield parser.parse_args(run)
        return
    yield parser.parse_args()


def two_ranks(worker: str, out) -> list[dict]:
    """Run a 2-process worker script (``--out``) and load what each rank saved."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, worker, "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


# -- compiled models ---------------------------------------------------------------------


class Block(nn.Module):
    """A residual MLP block (every block runs the same code: one compiled function)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self, dim: int = 8, depth: int = 3, classes: int = 3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Counting:
    """A torch.compile backend (aot_eager: AOTAutograd, then eager kernels) that counts the
    graphs it compiles and the calls into them."""

    def __init__(self) -> None:
        self.graphs = 0
        self.calls = 0

    def __deepcopy__(self, memo):  # Fabric deep-copies the compile arguments: count in one place
        return self

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs += 1
        compiled = lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args):
            self.calls += 1
            return compiled(*args)

        return run
