"""One SL-SAM training step in plain PyTorch (Algorithm 1 of the SL-SAM paper).

:class:`SparseSAMEngine` knows nothing of Lightning: it is given three callables and
runs the step around them, so the same code serves the Lightning mixin, a hand-written
loop and the benchmarks.

* ``forward_backward()`` computes the loss on the current batch, back-propagates it
  (when it requires grad) and returns it detached;
* ``zero_grad()`` sets every gradient to ``None``;
* ``optimizer_step(skip)`` steps the base optimizer (``skip=True``: every gradient is
  ``None`` and nothing may change, but step counters that must advance once per
  training step -- Lightning's ``global_step`` -- still do).

One step:

1. sample the active layers and freeze the others (``requires_grad=False``) *before*
   the first forward, so autograd builds no weight-gradient work for them;
2. first pass; per-layer gradient norms, kept on the device;
3. SAM ascent on the active tensors (:class:`~lightning_slsam.perturbation.SAMPerturbation`);
4. second pass at the perturbed point; exact restore of the active tensors;
5. base-optimizer step on the second-pass gradients (frozen tensors have ``grad=None``,
   so AdamW gives them no update, no weight decay and no state advance);
6. selection update with the first-pass norms; every tensor trainable again.

The step synchronises with the host once, after the second pass: both losses, a
finiteness probe of the second-pass gradients and the per-layer norm vector travel in
one transfer. A non-finite loss or gradient in either pass then skips the step
(weights restored exactly, optimizer and selection untouched); skips are counted and
reported.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_slsam.layers import LayerPartition
from lightning_slsam.perturbation import SAMPerturbation, tensor_norms

__all__ = ["LayerSelection", "SparseSAMEngine", "StepResult"]


class LayerSelection(Protocol):
    """What the engine needs from a layer-selection rule (e.g. :class:`LayerBandit`)."""

    @property
    def probs(self) -> Tensor: ...

    def sample(self) -> Tensor: ...

    def update(self, active: Tensor, norms: Tensor) -> bool: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class StepResult:
    """What happened in one step.

    Attributes:
        loss: first-pass loss, detached (``None`` if nothing was computed).
        active_mask: bool ``[num_layers]`` CPU mask of the sampled layers.
        active_numel: parameters that took part in each gradient pass (sampled layers
            plus always-active tensors).
        trainable_numel: parameters that could take part (the ratio's denominator).
        num_backward: backward passes run.
        skipped: whether the update was skipped.
        skip_reason: why, when skipped.
    """

    loss: Tensor | None
    active_mask: Tensor
    active_numel: int
    trainable_numel: int
    num_backward: int
    skipped: bool = False
    skip_reason: str | None = None

    @property
    def active_ratio_per_pass(self) -> float:
        """Fraction of trainable parameters with a gradient in each pass."""
        return self.active_numel / max(self.trainable_numel, 1)

    @property
    def active_ratio(self) -> float:
        """The SL-SAM paper's "Active Ratio": parameter fraction summed over the passes
        (plain AdamW 1.0, SAM 2.0)."""
        return self.active_ratio_per_pass * self.num_backward


class SparseSAMEngine:
    """Runs SL-SAM steps over a :class:`LayerPartition` (pure PyTorch).

    Args:
        partition: the layers, from :func:`~lightning_slsam.layers.build_partition`.
        selection: samples the active layers and learns from their norms; a
            :class:`~lightning_slsam.bandit.LayerBandit` for SL-SAM.
        perturbation: the SAM ascent applied to the active tensors.

    Attributes:
        counts: how many steps each layer was active (int64, CPU).
        num_steps: steps run, skipped ones included.
        num_skipped: steps skipped for a non-finite loss or gradient.
        active_ratio_sum: sum over non-skipped steps of :attr:`StepResult.active_ratio`.
        last_result: the latest :class:`StepResult`.
    """

    def __init__(
        self,
        partition: LayerPartition,
        selection: LayerSelection,
        perturbation: SAMPerturbation,
    ) -> None:
        self.partition = partition
        self.selection = selection
        self.perturbation = perturbation
        self.counts = torch.zeros(partition.num_layers, dtype=torch.int64)
        self.num_steps = 0
        self.num_skipped = 0
        self.active_ratio_sum = 0.0
        self.last_result: StepResult | None = None
        self._layer_numel = torch.tensor(partition.numel, dtype=torch.int64)
        self._always_numel = sum(p.numel() for p in partition.always_active)
        # Layer slot of every sampled tensor; always-active tensors use slot num_layers.
        self._slot = {id(p): i for i, group in enumerate(partition.params) for p in group}

    # -- freezing -------------------------------------------------------------------
    def activate(self, mask: Tensor) -> list[Tensor]:
        """Make exactly the layers in ``mask`` (plus always-active tensors) trainable.

        Returns the active tensors, always-active ones first.
        """
        active: list[Tensor] = list(self.partition.always_active)
        for param in self.partition.always_active:
            param.requires_grad_(True)
        for param in self.partition.always_frozen:
            param.requires_grad_(False)
        for on, group in zip(mask.tolist(), self.partition.params):
            for param in group:
                if param.requires_grad != on:
                    param.requires_grad_(on)
            if on:
                active.extend(group)
        return active

    def release(self) -> None:
        """Make every partition tensor trainable again (the state outside a step)."""
        for param in self.partition.flat_params:
            if not param.requires_grad:
                param.requires_grad_(True)
        for param in self.partition.always_frozen:
            param.requires_grad_(True)

    # -- the step -------------------------------------------------------------------
    def step(
        self,
        forward_backward: Callable[[], Tensor],
        zero_grad: Callable[[], None],
        optimizer_step: Callable[[bool], None],
    ) -> StepResult:
        """Run one SL-SAM step; see the module docstring for the sequence."""
        mask = self.selection.sample()
        active = self.activate(mask)
        active_numel = int(self._layer_numel[mask].sum()) + self._always_numel
        result = StepResult(
            loss=None,
            active_mask=mask,
            active_numel=active_numel,
            trainable_numel=self.partition.trainable_numel,
            num_backward=0,
        )
        try:
            self._run(result, active, forward_backward, zero_grad, optimizer_step)
        finally:
            self.release()
        self.num_steps += 1
        if result.skipped:
            self.num_skipped += 1
        else:
            self.counts += mask.to(torch.int64)
            self.active_ratio_sum += result.active_ratio
        self.last_result = result
        return result

    def train_step(
        self, compute_loss: Callable[[], Tensor], optimizer: torch.optim.Optimizer
    ) -> StepResult:
        """One step in a plain PyTorch loop.

        Args:
            compute_loss: runs the forward pass on the current batch and returns the loss
                (called once per gradient pass; back-propagation is done here).
            optimizer: the base optimizer (any ``torch.optim`` optimizer); it is not
                stepped at all when the step is skipped.
        """

        def forward_backward() -> Tensor:
            loss = compute_loss()
            if loss.requires_grad:  # False when no active layer reaches the loss
                loss.backward()
            return loss.detach()

        def optimizer_step(skip: bool) -> None:
            if not skip:
                optimizer.step()

        return self.step(
            forward_backward, lambda: optimizer.zero_grad(set_to_none=True), optimizer_step
        )

    def _run(
        self,
        result: StepResult,
        active: list[Tensor],
        forward_backward: Callable[[], Tensor],
        zero_grad: Callable[[], None],
        optimizer_step: Callable[[bool], None],
    ) -> None:
        zero_grad()
        loss = forward_backward()
        result.loss = loss
        result.num_backward = 1
        params, grads, layer_index = self._with_grad(active)
        norms = tensor_norms(grads, loss.device)
        layer_norms = self._layer_norms(norms, layer_index, loss.device)

        group_norms = None
        if self.perturbation.norm == "layer":
            # Each sampled tensor is scaled by its layer's norm, an always-active one by its own.
            padded = torch.cat([layer_norms, layer_norms.new_zeros(1)])
            index = layer_index.to(norms.device)
            group_norms = torch.where(index == len(layer_norms), norms, padded[index])
        # A non-finite first pass is only detected after the second one: checking here would
        # cost a second host synchronisation every step, and the exact restore below undoes
        # whatever a NaN perturbation did.
        backup = self.perturbation.perturb_(params, grads, norms, group_norms)
        del grads
        zero_grad()  # frees the first-pass gradients before the second forward
        try:
            loss2 = forward_backward()
            result.num_backward = 2
        finally:
            self.perturbation.restore_(params, backup)
        del backup
        _, grads2, _ = self._with_grad(active)
        second = tensor_norms(grads2, loss.device).sum()
        # The one host transfer of the step: both losses, the second pass's gradient
        # magnitude and the first pass's per-layer norms travel together.
        host = torch.cat(
            [
                loss.detach().reshape(1).float(),
                loss2.detach().reshape(1).float().to(loss.device),
                second.reshape(1).float(),
                layer_norms.float(),
            ]
        ).cpu()
        finite = torch.isfinite(host)
        if not bool(finite[0]) or not bool(finite[3:].all()):
            reason = "non-finite loss or gradient in the first pass"
        elif not bool(finite[1:3].all()):
            reason = "non-finite loss or gradient in the second pass"
        else:
            optimizer_step(False)
            self.selection.update(result.active_mask, host[3:].double())
            return
        self._skip(result, reason, zero_grad)
        optimizer_step(True)

    def _with_grad(self, active: list[Tensor]) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Active tensors that received a gradient, their grads and layer indices.

        A sampled tensor the forward did not use has ``grad=None``: it counts as norm 0.
        The slot of an always-active tensor is ``num_layers`` (it is not a bandit arm).
        """
        params, grads, slots = [], [], []
        other = self.partition.num_layers
        for param in active:
            if param.grad is not None:
                params.append(param)
                grads.append(param.grad)
                slots.append(self._slot.get(id(param), other))
        return params, grads, torch.tensor(slots, dtype=torch.long)

    def _layer_norms(self, norms: Tensor, slots: Tensor, device: torch.device) -> Tensor:
        """Per-layer L2 norms (``[num_layers]``; 0 for a layer without gradient)."""
        n = self.partition.num_layers
        squares = torch.zeros(n + 1, device=device, dtype=torch.float32)
        if norms.numel():
            squares.index_add_(0, slots.to(device, non_blocking=True), norms.square())
        return squares[:n].sqrt()

    def _skip(self, result: StepResult, reason: str, zero_grad: Callable[[], None]) -> None:
        result.skipped = True
        result.skip_reason = reason
        zero_grad()
        warnings.warn(
            f"SL-SAM skipped step {self.num_steps}: {reason}. Weights, optimizer state and"
            " layer probabilities are unchanged.",
            RuntimeWarning,
            stacklevel=3,
        )

    # -- statistics and state ----------------------------------------------------------
    @property
    def mean_active_ratio(self) -> float:
        """Mean "Active Ratio" (summed over passes) over the non-skipped steps."""
        done = self.num_steps - self.num_skipped
        return self.active_ratio_sum / done if done else math.nan

    def frequencies(self) -> Tensor:
        """Fraction of non-skipped steps each layer was active (float64)."""
        done = max(self.num_steps - self.num_skipped, 1)
        return self.counts.double() / done

    def state_dict(self) -> dict[str, Any]:
        """Selection state and counters (everything needed to continue identically)."""
        return {
            "selection": self.selection.state_dict(),
            "counts": self.counts.clone(),
            "num_steps": self.num_steps,
            "num_skipped": self.num_skipped,
            "active_ratio_sum": self.active_ratio_sum,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the partition must match)."""
        counts = state["counts"]
        if counts.numel() != self.partition.num_layers:
            raise ValueError(
                f"The checkpoint's SL-SAM state has {counts.numel()} layers but the model has"
                f" {self.partition.num_layers}."
            )
        self.selection.load_state_dict(state["selection"])
        self.counts = counts.clone().to(torch.int64)
        self.num_steps = int(state["num_steps"])
        self.num_skipped = int(state["num_skipped"])
        self.active_ratio_sum = float(state["active_ratio_sum"])
