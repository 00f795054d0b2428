"""ARWP (Li et al., 2024, "Revisiting Random Weight Perturbation for Efficiently Improving
Generalization", TMLR): one pass per step, at the weights moved by Gaussian noise. Each row
``f`` of a weight (a filter, a linear layer's output unit; a vector is one row, with ``F``
per element) draws ``eps_f ~ N(0, (sigma_t ||w_f||)^2 / (1 + eta F_f))``, ``F <- beta F + g^2``
the running squared gradients and ``sigma_t`` :func:`noise_radius`. The defaults are the
authors' CIFAR ones (``nblt/mARWP``).

>>> import torch
>>> net = torch.nn.Linear(4, 2)
>>> engine = ARWPSpec(growth=0.0).build_engine(net, seed=0)
>>> opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
>>> x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
>>> loss = lambda: torch.nn.functional.cross_entropy(net(x), y)
>>> [engine.train_step(loss, opt).kind for _ in range(2)]  # one pass, perturbed, each step
['single', 'single']
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_slsam.core.partition import by_position
from lightning_slsam.core.perturbation import SAMPerturbation
from lightning_slsam.core.step import MethodParts, StepContext, StepKind
from lightning_slsam.methods.options import number
from lightning_slsam.methods.spec import MethodOptions, MethodSpec, option

__all__ = ["ARWPOptions", "ARWPSpec", "RandomRows", "noise_radius"]


def noise_radius(rho: float, growth: float, step: int, planned: float) -> float:
    """``sigma_t``: ``rho`` at step 0, growing along a half cosine to ``rho * (1 + growth)``
    at step ``planned`` (and held there after it).

    >>> noise_radius(0.001, 10.0, 0, 100), round(noise_radius(0.001, 10.0, 50, 100), 6)
    (0.001, 0.006)
    >>> round(noise_radius(0.001, 10.0, 100, 100), 6)
    0.011
    """
    if growth == 0.0:
        return rho
    progress = min(step / planned, 1.0)
    return rho * (1.0 + growth * (1.0 - math.cos(math.pi * progress)) / 2.0)


def _rows(tensor: Tensor) -> Tensor:
    """``tensor`` as rows: its first dimension by the rest; a vector or a scalar is one row."""
    return tensor.reshape(tensor.shape[0], -1) if tensor.dim() > 1 else tensor.reshape(1, -1)


class RandomRows(MethodParts):
    """ARWP's parts: a row-scaled noise draw as each step's move; after each update, ``F``."""

    keeps_last_grads = False
    fresh_directions = True
    reads_update_grads = True

    def __init__(self, spec: ARWPSpec, generator: torch.Generator) -> None:
        self.rho, self.eta, self.beta, self.growth = spec.rho, spec.eta, spec.beta, spec.growth
        self.seed_source = generator
        #: The noise's generator, on the weights' device (made at the first step).
        self.generator: torch.Generator | None = None
        self._saved_generator: Tensor | None = None
        #: Each tensor's ``F`` by ``id``: one value per row, per element of a vector.
        self.squares: dict[int, Tensor] = {}

    def kind(self, step: int) -> StepKind:
        return "single"

    def _generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None or self.generator.device != device:
            seed = int(torch.randint(2**62, (), generator=self.seed_source))
            self.generator = torch.Generator(device=device).manual_seed(seed)
            if self._saved_generator is not None:
                self.generator.set_state(self._saved_generator)
                self._saved_generator = None
        return self.generator

    def directions(
        self, ctx: StepContext, params: Sequence[Tensor], last_grads: dict[int, Tensor]
    ) -> dict[int, Tensor]:
        if self.growth > 0 and math.isinf(ctx.planned):
            raise ValueError(
                f"ARWP(growth={self.growth:g}) grows its noise over the run, whose length this"
                " training loop does not give: set `engine.planned_steps` to the run's optimizer"
                " steps (FabricSAM: `sam.engine.planned_steps = N`), or `growth=0`."
            )
        sigma = noise_radius(self.rho, self.growth, ctx.step, ctx.planned)
        params = list(params)
        if not params:
            return {}
        shards = ctx.shards
        local = shards.local(params)
        # A vector's noise scales with its whole norm (across shards under FSDP2).
        vector_norms = shards.norms(params, local[0].device)
        generator = self._generator(local[0].device)
        moves: dict[int, Tensor] = {}
        with torch.no_grad():
            for k, (param, part) in enumerate(zip(params, local)):
                # Drawn in float32 whatever the weights' precision, scaled in float32 or wider.
                dtype = torch.promote_types(part.dtype, torch.float32)
                whole = torch.randn(param.shape, generator=generator, device=part.device,
                                    dtype=torch.float32)  # fmt: skip
                noise = _rows(shards.local_rows(whole, param)).to(dtype)
                if param.dim() > 1:
                    scale = _rows(part).to(dtype).norm(dim=1, keepdim=True) * sigma
                else:
                    scale = vector_norms[k].to(dtype) * sigma
                squares = self.squares.get(id(param))
                if squares is not None:  # one value per row, or per element of a vector
                    shaped = squares.view(-1, 1) if param.dim() > 1 else squares.view(1, -1)
                    scale = scale / torch.sqrt(1.0 + self.eta * shaped)
                moves[id(param)] = (noise * scale).to(part.dtype).view_as(part)
        return moves

    def after_update(self, ctx: StepContext, params: list[Tensor], grads: list[Tensor]) -> None:
        with torch.no_grad():
            for param, grad in zip(params, ctx.shards.local(grads)):
                squared = _rows(grad).to(torch.promote_types(grad.dtype, torch.float32)).square()
                row = squared.sum(dim=1) if param.dim() > 1 else squared.view(-1)
                old = self.squares.get(id(param))
                self.squares[id(param)] = row if old is None else old.mul_(self.beta).add_(row)

    def state_dict(self, index: dict[int, int]) -> dict[str, Any]:
        state = self.generator.get_state() if self.generator is not None else None
        return {
            "noise": {"source": self.seed_source.get_state(), "generator": state},
            "arwp_squares": {index[k]: v for k, v in self.squares.items()},
        }

    def load_state_dict(self, state: dict[str, Any], tensors: list[Tensor]) -> None:
        saved = state.get("noise") or {}
        if "source" in saved:
            self.seed_source.set_state(saved["source"])
        self.generator, self._saved_generator = None, saved.get("generator")
        self.squares = by_position(state.get("arwp_squares", {}), tensors)


@dataclass(kw_only=True, eq=False)
class ARWPOptions(MethodOptions):
    """ARWP's options.

    Args:
        rho: the noise's standard deviation at the start, relative to each row's norm
            (> 0; default 0.001). It grows to ``rho * (1 + growth)``.
        growth: how far the noise grows over the run (>= 0; default 10; 0: constant); needs
            the run's length (set ``engine.planned_steps`` outside Lightning and ``SAMTrainer``).
        eta: how much ``F`` shrinks a row's noise (>= 0; default 0.1; 0: plain random weight
            perturbation).
        beta: ``F``'s decay, in [0, 1) (default 0.99).
    """

    rho: float = option(1e-3, number(0, low_open=True, note=" (noise relative to a row's norm)"))
    growth: float = option(10.0, number(0))
    eta: float = option(0.1, number(0))
    beta: float = option(0.99, number(0, 1, high_open=True))


@dataclass(kw_only=True, eq=False)
class ARWPSpec(ARWPOptions, MethodSpec):
    """ARWP: one pass per step, at the weights moved by row-scaled Gaussian noise."""

    name: ClassVar[str] = "arwp"
    label: ClassVar[str] = "ARWP"
    own_move: ClassVar[str | None] = "ARWP draws its move, scaled by each row's norm"

    def make_perturbation(self) -> SAMPerturbation:
        return SAMPerturbation(1.0, norm="none")  # the drawn noise is the move

    def parts(self, generator: torch.Generator) -> MethodParts:
        return RandomRows(self, generator)
