"""Probes and independent references that test files in several folders share: what each
pass of an engine step saw, gradients computed apart from the engine, a selection that
returns a given mask, fp16 on the CPU, and a bisection solver for the KL projection."""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
import torch.nn.functional as F
from helpers import loader, make_data, make_mlp
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from lightning_slsam.core.engine import SAMEngine
from lightning_slsam.core.partition import build_partition
from lightning_slsam.core.perturbation import SAMPerturbation
from lightning_slsam.selection.rules import LayerSelection

RHO = 0.05


def gradients(net: nn.Module, x, y) -> list[torch.Tensor]:
    """Plain gradient of the mean cross-entropy at ``net``'s current weights."""
    net = copy.deepcopy(net)
    net.zero_grad()
    F.cross_entropy(net(x), y).backward()
    return [p.grad.clone() for p in net.parameters()]


def shifted(net: nn.Module, offsets: list[torch.Tensor]) -> nn.Module:
    moved = copy.deepcopy(net)
    with torch.no_grad():
        for p, e in zip(moved.parameters(), offsets):
            p.add_(e)
    return moved


def net_at(weights, net):
    moved = copy.deepcopy(net)
    with torch.no_grad():
        for p, w in zip(moved.parameters(), weights):
            p.copy_(w)
    return moved


class Recorder:
    """compute_loss for engine.train_step that records what each pass saw."""

    def __init__(self, net, x, y, per_sample=False):
        self.net, self.x, self.y, self.per_sample = net, x, y, per_sample
        self.passes: list[dict] = []

    def __call__(self, index=None):
        x, y = (self.x, self.y) if index is None else (self.x[index], self.y[index])
        self.passes.append(
            {
                "weights": [p.detach().clone() for p in self.net.parameters()],
                "trainable": [p.requires_grad for p in self.net.parameters()],
                "index": None if index is None else index.clone(),
                "grad_enabled": torch.is_grad_enabled(),
            }
        )
        losses = F.cross_entropy(self.net(x), y, reduction="none")
        return losses if self.per_sample else losses.mean()


def setup_engine(cb, seed=0, n=32):
    torch.manual_seed(seed)
    net = make_mlp()
    x, y = make_data(n).tensors
    return net, x, y, cb.spec.build_engine(net), torch.optim.SGD(net.parameters(), lr=0.1)


class FixedSelection(LayerSelection):
    """A selection that returns a given mask and records what it is told."""

    def __init__(self, mask: list[bool]) -> None:
        self.mask = torch.tensor(mask)
        self.num_layers = len(mask)
        self.updates: list[tuple[torch.Tensor, torch.Tensor]] = []

    def sample(self) -> torch.Tensor:
        return self.mask.clone()

    def update(self, active, norms) -> bool:
        self.updates.append((active.clone(), norms.clone()))
        return True


def loss_closure(net, x, y, observe=None):
    """The forward pass for SAMEngine.train_step, optionally watching the model."""

    def compute_loss():
        if observe is not None:
            observe(net)
        return F.cross_entropy(net(x), y)

    return compute_loss


def fixed_engine(net, mask, rho=0.05, norm="global"):
    partition = build_partition(net)
    return SAMEngine(partition, FixedSelection(mask), SAMPerturbation(rho, norm=norm))


def batches(dataset, batch_size):
    return [(x, y) for x, y in loader(dataset, batch_size)]


def fp16(init_scale: float = 2.0**10) -> MixedPrecision:
    """fp16 autocast with a real GradScaler, on the CPU (what "16-mixed" is on CUDA)."""
    return MixedPrecision(
        "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale)
    )


def bisect_projection(log_u, budget: float, lower: float, upper: float) -> np.ndarray:
    """Independent reference: bisection on t = log(c) for sum(clip(exp(t + x))) == budget."""
    x = np.asarray(log_u, dtype=float)
    x = x - x.max()
    lo, hi = math.log(lower), math.log(upper) - x.min()
    with np.errstate(over="ignore"):
        for _ in range(300):
            mid = 0.5 * (lo + hi)
            if np.clip(np.exp(mid + x), lower, upper).sum() < budget:
                lo = mid
            else:
                hi = mid
        return np.clip(np.exp(0.5 * (lo + hi) + x), lower, upper)
