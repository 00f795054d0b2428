"""Overheads the plugin adds around the model's own work.

* ``bandit`` -- SL-SAM's selection and bookkeeping per step, timed on its own on a model's
  real partition: sampling, freezing and unfreezing the layers, the bandit update with a
  norm vector, the active-parameter accounting and the entropy that is logged.
* ``lightning_adamw`` -- the AdamW path (SAMMixin without a SAM callback) against the same
  LightningModule without the mixin, under plain automatic optimization: alternating
  short fits, median step time from a timing callback.
"""

from __future__ import annotations

import statistics
import time

import lightning as L
import torch
from models import make_workload
from torch.utils.data import DataLoader

from examples.methods import SLSAMAblationSpec
from lightning_slsam import SAMMixin
from lightning_slsam.core.engine import normalized_entropy


def bandit(
    model_name: str, iterations: int = 300, layer_ratio: float = 0.2, loss: str = "shifted"
) -> dict:
    """Milliseconds per step of SL-SAM's selection and bookkeeping on ``model_name``, with
    the bandit ``loss`` (``"shifted"``: the paper's default; ``"rank"``: scale-free)."""
    work = make_workload(model_name, 1)
    # The paper's SL-SAM with the bandit's loss set alone (examples/methods.py).
    engine = SLSAMAblationSpec(
        layer_ratio=layer_ratio, bandit_loss=loss, seed=0, preset="paper"
    ).build_engine(work.model)
    n = engine.partition.num_layers
    gen = torch.Generator().manual_seed(0)
    norms = torch.rand(n, generator=gen, dtype=torch.float64)
    parts = {"sample": 0.0, "freeze": 0.0, "update": 0.0, "accounting": 0.0}
    for _ in range(iterations):
        t0 = time.perf_counter()
        mask = engine.selection.sample()
        t1 = time.perf_counter()
        engine.freezer.activate(mask)
        engine.freezer.release()
        t2 = time.perf_counter()
        engine.selection.update(
            mask, norms * (1 + torch.rand(n, generator=gen, dtype=torch.float64))
        )
        t3 = time.perf_counter()
        engine.freezer.numel(mask)
        engine.counts += mask.to(torch.int64)
        normalized_entropy(engine.selection.probs)
        t4 = time.perf_counter()
        parts["sample"] += t1 - t0
        parts["freeze"] += t2 - t1
        parts["update"] += t3 - t2
        parts["accounting"] += t4 - t3
    per_step = {k: 1000 * v / iterations for k, v in parts.items()}
    per_step["total"] = sum(per_step.values())
    return {"model": model_name, "num_layers": n, "ms_per_step": per_step}


class _Plain(L.LightningModule):
    def __init__(self, model, loss):
        super().__init__()
        self.model, self.loss = model, loss

    def training_step(self, batch, batch_idx):
        return self.loss(self.model, batch).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01)


class _WithMixin(SAMMixin, _Plain):
    def training_step(self, batch, batch_idx):
        return self.loss(self.model, batch).mean()


class _Timer(L.Callback):
    def __init__(self):
        self.times = []

    def on_train_batch_start(self, *args):
        self.start = time.perf_counter()

    def on_train_batch_end(self, *args):
        self.times.append(time.perf_counter() - self.start)


def lightning_adamw(model_name: str = "minilm", fits: int = 3, steps: int = 10) -> dict:
    """Median step time of SAMMixin's AdamW path and of plain automatic optimization."""
    import copy

    work = make_workload(model_name, steps)
    times: dict[str, list[float]] = {"plain": [], "mixin": []}
    for _ in range(fits):
        for name, cls in (("plain", _Plain), ("mixin", _WithMixin)):
            timer = _Timer()
            trainer = L.Trainer(
                accelerator="cpu", devices=1, max_steps=steps, callbacks=[timer],
                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False,
            )  # fmt: skip
            module = cls(copy.deepcopy(work.model), work.loss)
            trainer.fit(module, DataLoader(work.batches, batch_size=None))
            times[name].extend(timer.times[2:])  # the first steps warm up
    median = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": model_name,
        "median_s": median,
        "ratio_mixin_to_plain": median["mixin"] / median["plain"],
        "samples": times,
    }
