"""What DeepSpeed ZeRO does to SAM and to per-step layer freezing, measured on CPU.

    DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed   # no compiled ops needed
    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 \\
        examples/scripts/deepspeed_probe.py --out docs/results/deepspeed_probe.json

Two processes (gloo, CPU) train a 4-layer MLP (12-20-20-20-4, tanh, 1,184 parameters) with a
torch AdamW handed to ``deepspeed.initialize`` (float32, no clipping, one micro-batch of 4
rows per rank, so a global batch of 8). Rank 0 also runs plain torch on one process with the
same initial weights and the same global batches. For each ZeRO stage (1, 2 and 3; a stage
or case that fails is recorded with its error) it measures:

a. **SAM by hand through the engine.** Per step: ``engine.backward`` of the first pass, the
   full (all-reduced) gradient g1 read with ``deepspeed.utils.safe_get_full_grad``, every
   parameter moved by ``rho * g1 / ||g1||`` (under ZeRO-3 inside ``GatheredParameters``),
   the second pass's ``engine.backward``, the perturbation taken off, ``engine.step``; once
   as is and once with ``engine.optimizer.zero_grad()`` between the passes. Reported: the
   largest weight difference from plain-torch SAM after ``--steps`` steps, and from plain
   torch stepping with g1 + g2 (an engine that kept the first pass's gradient).
b. **A sparse step.** One layer (module ``2``, the second Linear: weight and bias) is left
   out of one optimizer step in three ways a per-step freezer would use:
   ``requires_grad_(False)`` for the step's forward and backward (what lightning_slsam's
   layer samplers do), its ``.grad`` set to ``None`` between backward and step (a
   plain-torch loop's way), or its gradient set to zero with ``safe_set_full_grad``. Each in
   three settings: the first step of the run at weight_decay 0.1 (decay alone can move it),
   the step after one full step at weight_decay 0 (Adam's moments alone), and the step after
   one full step at weight_decay 0.1 (both). Reported: the left-out layer's largest change
   in that step under DeepSpeed and under plain torch with its gradient ``None`` (AdamW
   skips it), zero, or kept; and the whole model's largest difference from each. Then two
   workarounds over three steps (the layer left out of the second): putting back the
   layer's float32 master weights and Adam moments after the step
   (``safe_set_full_fp32_param``, ``safe_set_full_optimizer_state``; with one parameter
   group, and with one group per Linear), and a group per Linear with the layer's learning
   rate 0 for the step; each compared with plain torch (gradient ``None``), and with plain
   torch whose Adam step count for the layer is advanced in the left-out step. Last, a layer
   frozen when the engine is built and made trainable afterwards: is it in ZeRO's groups,
   does a step move it, is its gradient averaged over the ranks.
c. **accelerate.** Whether ``accelerator.backward`` (``DeepSpeedEngineWrapper.backward``)
   runs the optimizer step: an ``Accelerator`` with a ZeRO-2 ``DeepSpeedPlugin`` (one
   micro-batch per step, so every backward is at a sync boundary), a forward and one
   ``accelerator.backward``: did the weights change, how many engine steps ran; then a
   second forward and backward, as SAM's second pass would be.

The results go to ``--out`` (JSON; rank 0 writes it) and a table is printed. About 30 s on
two CPU cores; the first run on a machine also JIT-builds DeepSpeed's CPU shared-memory
communication op (a minute or two, then cached under ~/.cache/torch_extensions).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import json
import logging
import os
import platform
import time
import traceback
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
import torch.nn.functional as F

WIDTHS = (12, 20, 20, 20, 4)
PER_RANK = 4
LAYER = "2"  # the second Linear (its index in the Sequential)


# -- model, data, reference ----------------------------------------------------------------
def make_model(seed: int, frozen: str | None = None) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(WIDTHS)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(WIDTHS) - 2:
            layers.append(torch.nn.Tanh())
    model = torch.nn.Sequential(*layers)
    if frozen is not None:
        model.get_submodule(frozen).requires_grad_(False)
    return model


def global_batch(step: int, world: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randn(PER_RANK * world, WIDTHS[0], generator=gen)
    y = torch.randint(0, WIDTHS[-1], (PER_RANK * world,), generator=gen)
    return x, y


def local_batch(step: int, world: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, world, seed)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return x[rows], y[rows]


def adamw(params: Any, lr: float, wd: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, weight_decay=wd, betas=(0.9, 0.999), eps=1e-8)


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names: Any = None) -> float:
    names = list(a) if names is None else list(names)
    return max(float((a[n] - b[n]).abs().max()) for n in names)


def layer_names(layer: str = LAYER) -> list[str]:
    return [f"{layer}.weight", f"{layer}.bias"]


def reference_sam(args: argparse.Namespace, world: int, summed: bool = False
                  ) -> dict[str, torch.Tensor]:  # fmt: skip
    """SAM in plain torch on one process: the same global batches, the same AdamW.
    ``summed``: the step takes the sum of both passes' gradients (what an engine that keeps
    the first pass's gradient would step with)."""
    model = make_model(args.seed)
    opt = adamw(model.parameters(), args.lr, args.wd)
    params = list(model.parameters())
    for step in range(args.steps):
        x, y = global_batch(step, world, args.seed)
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), params)
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.add_(g, alpha=args.rho / float(norm + 1e-12))
        first = grads
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), params)
        with torch.no_grad():
            for p, s, g, g1 in zip(params, saved, grads, first):
                p.copy_(s)
                p.grad = g + g1 if summed else g
        opt.step()
        opt.zero_grad(set_to_none=True)
    return state(model)


def reference_run(args: argparse.Namespace, world: int, steps: int, skip: int, wd: float,
                  how: str, count_skip: bool = False) -> list[dict[str, torch.Tensor]]:  # fmt: skip
    """Plain torch AdamW on one process, ``steps`` steps; in step ``skip`` the layer's
    gradient is ``None`` (``how='none'``: AdamW skips it), zero (``'zero'``) or kept
    (``'full'``). ``count_skip``: the skipped step still advances the layer's Adam step
    count (as one count per flat ZeRO group does). The weights before the first step and
    after each."""
    model = make_model(args.seed)
    opt = adamw(model.parameters(), args.lr, wd)
    states = [state(model)]
    for step in range(steps):
        x, y = global_batch(step, world, args.seed)
        F.cross_entropy(model(x), y).backward()
        if step == skip and how != "full":
            for p in model.get_submodule(LAYER).parameters():
                p.grad = None if how == "none" else torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == skip and count_skip:
            for p in model.get_submodule(LAYER).parameters():
                opt.state[p]["step"] += 1
        states.append(state(model))
    return states


# -- DeepSpeed -----------------------------------------------------------------------------
def ds_config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": PER_RANK,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build_engine(args: argparse.Namespace, stage: int, wd: float, frozen: str | None = None
                 ) -> Any:  # fmt: skip
    import deepspeed

    model = make_model(args.seed, frozen)
    opt = adamw(model.parameters(), args.lr, wd)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage))
    return engine


def gathered(engine: Any, params: list[torch.nn.Parameter], modify: bool) -> Any:
    """ZeRO-3: the full parameters (written back from rank 0 when ``modify``)."""
    import deepspeed

    if engine.zero_optimization_stage() != 3:
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None)


def ds_weights(engine: Any) -> dict[str, torch.Tensor]:
    """Every rank: the full weights the module holds (gathered under ZeRO-3)."""
    named = list(engine.module.named_parameters())
    with gathered(engine, [p for _, p in named], modify=False):
        return {n: p.detach().clone() for n, p in named}


def ds_master(engine: Any) -> dict[str, torch.Tensor]:
    """Every rank: ZeRO's float32 master weights (``safe_get_full_fp32_param``), trained
    tensors only."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            out[n] = safe_get_full_fp32_param(p).detach().clone().reshape(p.ds_shape if hasattr(
                p, "ds_shape") else p.shape)  # fmt: skip
    return out


def ds_loss(engine: Any, step: int, args: argparse.Namespace) -> torch.Tensor:
    x, y = local_batch(step, dist.get_world_size(), dist.get_rank(), args.seed)
    return F.cross_entropy(engine(x), y)


def ds_sam(args: argparse.Namespace, stage: int, reference: Any, clear: bool) -> dict[str, Any]:
    """SAM by hand; ``clear``: ``engine.optimizer.zero_grad()`` between the two passes."""
    from deepspeed.utils import safe_get_full_grad

    engine = build_engine(args, stage, args.wd)
    start = ds_weights(engine)
    params = [p for p in engine.module.parameters() if p.requires_grad]
    for step in range(args.steps):
        engine.backward(ds_loss(engine, step, args))
        grads = [safe_get_full_grad(p).detach().clone() for p in params]
        norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads))
        scale = args.rho / float(norm + 1e-12)
        with gathered(engine, params, modify=True), torch.no_grad():
            for p, g in zip(params, grads):
                p.add_(g.reshape(p.shape), alpha=scale)
        if clear:
            engine.optimizer.zero_grad(set_to_none=True)
        engine.backward(ds_loss(engine, step, args))
        with gathered(engine, params, modify=True), torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(g.reshape(p.shape), alpha=scale)
        engine.step()
    end = ds_weights(engine)
    master = ds_master(engine)
    owned = None
    if stage in (1, 2):  # the tensors (or slices of them) in this rank's flat partition
        names = {id(p): n for n, p in engine.module.named_parameters()}
        mine = [names[id(p)] for p in engine.optimizer.params_in_partition[0]]
        owned = [None] * dist.get_world_size()
        dist.all_gather_object(owned, mine)
    out: dict[str, Any] = {"steps": args.steps, "rho": args.rho,
                           "engine_global_steps": int(engine.global_steps),
                           "tensors_in_each_rank_partition": owned}  # fmt: skip
    if reference is not None:
        out["max_weight_diff_vs_reference"] = max_diff(end, reference["sam"])
        out["max_master_diff_vs_reference"] = max_diff(master, reference["sam"], master)
        out["max_weight_diff_vs_reference_summed_passes"] = max_diff(end, reference["summed"])
        out["max_weight_change_over_run"] = max_diff(end, start)
    return out


def ds_sparse(args: argparse.Namespace, stage: int, warm: int, wd: float, how: str
              ) -> dict[str, Any]:  # fmt: skip
    """``warm`` full steps, then one step with the layer left out ``how``; the layer's
    change in that step (module weights and master weights), and the whole model after it."""
    from deepspeed.utils import safe_set_full_grad

    engine = build_engine(args, stage, wd)
    layer = engine.module.get_submodule(LAYER)
    layer_params = list(layer.parameters())
    for step in range(warm + 1):
        if step == warm:
            before, before_master = ds_weights(engine), ds_master(engine)
            if how == "requires_grad":
                layer.requires_grad_(False)
        engine.backward(ds_loss(engine, step, args))
        if step == warm and how == "grad_none":
            for p in layer_params:
                p.grad = None
        if step == warm and how == "set_full_grad_zero":
            for p in layer_params:
                safe_set_full_grad(p, torch.zeros(p.ds_shape if hasattr(p, "ds_shape") else
                                                  p.shape))  # fmt: skip
        engine.step()
        if step == warm and how == "requires_grad":
            layer.requires_grad_(True)
    after, after_master = ds_weights(engine), ds_master(engine)
    names = layer_names()
    return {
        "layer_max_change": max_diff(after, before, names),
        "layer_master_max_change": max_diff(after_master, before_master, names),
        "weights": after,
    }


def ds_late_trainable(args: argparse.Namespace, stage: int) -> dict[str, Any]:
    """The layer frozen when the engine is built, trainable from the first step on."""
    engine = build_engine(args, stage, args.wd, frozen=LAYER)
    layer = engine.module.get_submodule(LAYER)
    layer.requires_grad_(True)
    ids = {id(p) for p in layer.parameters()}
    groups = getattr(engine.optimizer, "bit16_groups", None)
    if groups is None:  # ZeRO-3
        groups = getattr(engine.optimizer, "fp16_groups", [])
    in_groups = any(id(q) in ids for group in groups for q in group)
    before = ds_weights(engine)
    for step in range(2):
        engine.backward(ds_loss(engine, step, args))
        engine.step()
    after = ds_weights(engine)
    grad = layer.weight.grad
    out: dict[str, Any] = {
        "in_zero_groups": in_groups,
        "layer_max_change_after_2_steps": max_diff(after, before, layer_names()),
        "others_max_change_after_2_steps": max_diff(
            after, before, [n for n in after if n not in layer_names()]
        ),
        "layer_grad_present_after_steps": grad is not None,
    }
    if grad is not None:
        both = [torch.zeros_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(both, grad.contiguous())
        out["layer_grad_max_diff_between_ranks"] = float((both[0] - both[1]).abs().max())
    return out


def ds_workaround(args: argparse.Namespace, stage: int, how: str) -> dict[str, Any]:
    """Three steps (weight decay ``--wd``), the layer left out of the second by ``how``:
    ``'restore'``: ``requires_grad_(False)`` for the step, then its float32 master weights,
    Adam moments and module weights put back as they were before the step
    (``safe_set_full_fp32_param``, ``safe_set_full_optimizer_state``), one parameter group;
    ``'restore_per_layer_groups'``: the same with one parameter group per Linear;
    ``'group_lr0'``: one parameter group per Linear, the layer's learning rate 0 for the
    step. Rank 0 compares with plain torch where that step's gradient is ``None``."""
    import deepspeed
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )

    model = make_model(args.seed)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    index = list(model).index(model.get_submodule(LAYER))
    group_of_layer = next(i for i, m in enumerate(linears) if m is model[index])
    if how == "restore":
        group_of_layer = 0
        opt = adamw(model.parameters(), args.lr, args.wd)
    else:
        opt = adamw([{"params": list(m.parameters())} for m in linears], args.lr, args.wd)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage))
    layer = engine.module.get_submodule(LAYER)
    params = list(layer.parameters())
    keys = ("exp_avg", "exp_avg_sq")
    states = [ds_weights(engine)]
    for step in range(3):
        skip = step == 1
        if skip and how.startswith("restore"):
            saved = [(safe_get_full_fp32_param(p).clone(),
                      {k: safe_get_full_optimizer_state(p, k).clone() for k in keys})
                     for p in params]  # fmt: skip
            layer.requires_grad_(False)
        if skip and how == "group_lr0":
            groups = engine.optimizer.param_groups
            lr = groups[group_of_layer]["lr"]
            groups[group_of_layer]["lr"] = 0.0
        engine.backward(ds_loss(engine, step, args))
        engine.step()
        if skip and how.startswith("restore"):
            layer.requires_grad_(True)
            for p, (master, moments) in zip(params, saved):
                safe_set_full_fp32_param(p, master)
                for k, v in moments.items():
                    safe_set_full_optimizer_state(p, v, k)
            with gathered(engine, params, modify=True), torch.no_grad():
                for p, (master, _) in zip(params, saved):
                    p.copy_(master.reshape(p.shape))
        if skip and how == "group_lr0":
            groups[group_of_layer]["lr"] = lr
        states.append(ds_weights(engine))
    out: dict[str, Any] = {
        "param_groups": len(engine.optimizer.param_groups),
        "layer_max_change_in_left_out_step": max_diff(states[2], states[1], layer_names()),
        "states": states,
    }
    return out


# -- accelerate ----------------------------------------------------------------------------
def accelerate_probe(args: argparse.Namespace) -> dict[str, Any]:
    import accelerate
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    lines, first = inspect.getsourcelines(DeepSpeedEngineWrapper.backward)
    calls = [first + i for i, line in enumerate(lines) if "self.engine.step()" in line]
    out: dict[str, Any] = {
        "wrapper_backward_calls_engine_step": bool(calls),
        "wrapper_backward_lines": f"accelerate/utils/deepspeed.py:{first}-{first + len(lines) - 1}",
        "engine_step_call_line": calls,
        "accelerate_version": accelerate.__version__,
    }
    config = ds_config(2)
    plugin = DeepSpeedPlugin(hf_ds_config=config)
    accelerator = Accelerator(deepspeed_plugin=plugin)  # cpu=False (the default), no GPU here
    out["distributed_type"] = str(accelerator.distributed_type)
    out["device"] = str(accelerator.device)
    model = make_model(args.seed)
    opt = adamw(model.parameters(), args.lr, args.wd)
    model, opt = accelerator.prepare(model, opt)
    engine = model
    out["prepared_model_type"] = type(engine).__name__

    def weights() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    x, y = local_batch(0, dist.get_world_size(), dist.get_rank(), args.seed)
    w0 = weights()
    out["sync_gradients"] = bool(accelerator.sync_gradients)
    accelerator.backward(F.cross_entropy(model(x), y))  # SAM's first pass
    w1 = weights()
    out["after_first_backward_max_weight_change"] = max_diff(w1, w0)
    out["after_first_backward_engine_global_steps"] = int(engine.global_steps)
    accelerator.backward(F.cross_entropy(model(x), y))  # SAM's second pass
    out["after_second_backward_max_weight_change"] = max_diff(weights(), w1)
    out["after_second_backward_engine_global_steps"] = int(engine.global_steps)
    opt.step()  # accelerate's DeepSpeedOptimizerWrapper.step: a no-op
    opt.zero_grad()
    out["after_optimizer_step_engine_global_steps"] = int(engine.global_steps)
    return out


# -- driver --------------------------------------------------------------------------------
def attempt(record: dict[str, Any], key: str, fn: Any, *a: Any) -> Any:
    try:
        value = fn(*a)
    except Exception as exc:  # a failure is a result here
        record[key] = {"error": f"{type(exc).__name__}: {exc}".strip()[:600],
                       "where": [line.split("site-packages/")[-1] for line in
                                 traceback.format_exc().strip().splitlines()[-3:]]}  # fmt: skip
        return None
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for the results (rank 0)")
    parser.add_argument("--stages", default="1,2,3", help="ZeRO stages to probe")
    parser.add_argument("--steps", type=int, default=3, help="SAM steps compared (a)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument(
        "--wd", type=float, default=0.1, help="AdamW weight decay (a, b's workarounds, c)"
    )
    parser.add_argument("--rho", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-accelerate", action="store_true", help="skip part c")
    args = parser.parse_args()

    torch.set_num_threads(1)
    import deepspeed

    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("run with --nproc_per_node 2")
    started = time.perf_counter()
    import accelerate
    import transformers

    results: dict[str, Any] = {
        "versions": {
            "deepspeed": deepspeed.__version__, "torch": torch.__version__,
            "accelerate": accelerate.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "setup": {
            "processes": world, "backend": dist.get_backend(), "device": "cpu",
            "ds_accelerator": deepspeed.get_accelerator().device_name(),
            "model": f"MLP {'-'.join(map(str, WIDTHS))} tanh",
            "parameters": sum(p.numel() for p in make_model(args.seed).parameters()),
            "micro_batch_per_rank": PER_RANK, "global_batch": PER_RANK * world,
            "optimizer": "torch.optim.AdamW (client optimizer), float32, no clipping",
            "lr": args.lr, "weight_decay": args.wd, "rho": args.rho, "sam_steps": args.steps,
            "excluded_layer": LAYER,
        },
        "stages": {},
    }  # fmt: skip
    reference = None
    if rank == 0:
        reference = {"sam": reference_sam(args, world),
                     "summed": reference_sam(args, world, summed=True)}  # fmt: skip
    sparse_cases = [("first_step_wd0.1", 0, 0.1), ("after_1_step_wd0", 1, 0.0),
                    ("after_1_step_wd0.1", 1, 0.1)]  # fmt: skip
    for stage in [int(s) for s in args.stages.split(",")]:
        record: dict[str, Any] = {"sam": {}, "sparse": {}, "workaround": {}}
        results["stages"][str(stage)] = record
        for label, clear in (("as_is", False), ("zero_grad_between_passes", True)):
            sam = attempt(record["sam"], label, ds_sam, args, stage, reference, clear)
            if sam is not None:
                record["sam"][label] = sam
        for label, warm, wd in sparse_cases:
            case: dict[str, Any] = {}
            record["sparse"][label] = case
            if rank == 0:
                refs = {how: reference_run(args, world, warm + 1, warm, wd, how)
                        for how in ("none", "zero", "full")}  # fmt: skip
                for how in refs:
                    case[f"torch_grad_{how}_layer_max_change"] = max_diff(
                        refs[how][-1], refs[how][-2], layer_names())  # fmt: skip
            for how in ("requires_grad", "grad_none", "set_full_grad_zero"):
                got = attempt(case, how, ds_sparse, args, stage, warm, wd, how)
                if got is None:
                    continue
                weights = got.pop("weights")
                if rank == 0:
                    for ref in refs:
                        got[f"model_max_diff_vs_torch_grad_{ref}"] = max_diff(
                            weights, refs[ref][-1]
                        )
                case[how] = got
        if rank == 0:
            ref_states = reference_run(args, world, 3, 1, args.wd, "none")
            ref_counted = reference_run(args, world, 3, 1, args.wd, "none", count_skip=True)
        for how in ("restore", "restore_per_layer_groups", "group_lr0"):
            got = attempt(record["workaround"], how, ds_workaround, args, stage, how)
            if got is None:
                continue
            states = got.pop("states")
            if rank == 0:
                got["model_max_diff_vs_torch_grad_none_per_step"] = [
                    max_diff(mine, ref) for mine, ref in zip(states[1:], ref_states[1:])
                ]
                got["model_max_diff_vs_torch_grad_none_step_counted_per_step"] = [
                    max_diff(mine, ref) for mine, ref in zip(states[1:], ref_counted[1:])
                ]
            record["workaround"][how] = got
        late = attempt(record, "trainable_after_init", ds_late_trainable, args, stage)
        if late is not None:
            record["trainable_after_init"] = late
        dist.barrier()
    if not args.no_accelerate:
        acc = attempt(results, "accelerate", accelerate_probe, args)
        if acc is not None:
            results["accelerate"] = acc
    results["seconds"] = round(time.perf_counter() - started, 1)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
        print_table(results)
    dist.barrier()


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def print_table(results: dict[str, Any]) -> None:
    v = results["versions"]
    print(f"\ndeepspeed {v['deepspeed']}, torch {v['torch']}, accelerate {v['accelerate']}")
    print("\n(a) SAM by hand, max weight difference from plain-torch SAM after"
          f" {results['setup']['sam_steps']} steps")  # fmt: skip
    print("| stage | as is | as is vs torch stepping g1+g2 | zero_grad between passes"
          " | weight change over run |")  # fmt: skip
    print("|---|---|---|---|---|")
    for stage, record in results["stages"].items():
        as_is = record["sam"].get("as_is", {})
        clear = record["sam"].get("zero_grad_between_passes", {})
        cells = [as_is.get("max_weight_diff_vs_reference"),
                 as_is.get("max_weight_diff_vs_reference_summed_passes"),
                 clear.get("max_weight_diff_vs_reference"),
                 as_is.get("max_weight_change_over_run")]  # fmt: skip
        print(f"| {stage} | " + " | ".join(fmt(c) for c in cells) + " |")
    print("\n(b) max abs change of the left-out layer in its step")
    print(
        "| stage | step | torch grad None | torch grad 0 | torch full | DS requires_grad False"
        " | DS grad None | DS safe_set_full_grad 0 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for stage, record in results["stages"].items():
        for label, case in record["sparse"].items():
            cells = [fmt(case.get(f"torch_grad_{how}_layer_max_change"))
                     for how in ("none", "zero", "full")]  # fmt: skip
            for how in ("requires_grad", "grad_none", "set_full_grad_zero"):
                got = case.get(how, {})
                cells.append("error" if "error" in got else fmt(got.get("layer_max_change")))
            print(f"| {stage} | {label} | " + " | ".join(cells) + " |")
    print(
        "\nworkarounds (step 2 of 3 leaves the layer out): layer change in that step;"
        " model difference from torch (grad None) after each step; the same from torch"
        " with the layer's Adam step count advanced in the left-out step"
    )
    for stage, record in results["stages"].items():
        for how, got in record["workaround"].items():
            if "error" in got:
                print(f"stage {stage} {how}: error {got['error'][:100]}")
                continue
            diffs = ", ".join(fmt(d) for d in got["model_max_diff_vs_torch_grad_none_per_step"])
            counted = ", ".join(
                fmt(d) for d in got["model_max_diff_vs_torch_grad_none_step_counted_per_step"]
            )
            print(f"stage {stage} {how}: {fmt(got['layer_max_change_in_left_out_step'])};"
                  f" {diffs}; {counted}")  # fmt: skip
    print()
    for stage, record in results["stages"].items():
        print(f"stage {stage} trainable after init: {record.get('trainable_after_init')}")
    acc = results.get("accelerate")
    if acc is not None:
        print(f"\n(c) accelerate: {acc}")
    print(f"\n{results['seconds']} s after start-up")


if __name__ == "__main__":
    main()
