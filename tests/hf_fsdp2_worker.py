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
        --out DIR --batch 4 --method sam,slsam
    python tests/hf_fsdp2_worker.py --out DIR --batch 8 --method sam,slsam

Options: ``--accumulate``, ``--optim``/``--optim-args`` (the Trainer's), ``--bf16``, ``--lora``
(PEFT adapters on the attention and MLP projections), ``--trl`` (TRL's SFTTrainer with the
mixin, on sentences), ``--state-dict`` (the FSDP checkpoint
kind), ``--save N`` and ``--resume FOLDER``, ``--tag`` (a suffix to the files' names).
"""

from __future__ import annotations

import os

import torch
from hf_helpers import (
    StepLog,
    run_methods,
    sentences,
    tiny_causal_lm,
    training_args,
    worker_arguments,
)

from lightning_slsam.hf import SAMTrainer
from lightning_slsam.parallel.ddp import release_process_group


class _FSDPOnCPU:
    """Puts back the FSDP plugin accelerate drops on CPU processes (above)."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state
        if self.args.fsdp_plugin_args is not None and state.distributed_type == "MULTI_CPU":
            state.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            if state.mixed_precision != "no":  # as AcceleratorState does for FSDP
                plugin.set_mixed_precision(state.mixed_precision)
            state.fsdp_plugin = plugin
            self.is_fsdp_enabled = True


class _OnCPU(_FSDPOnCPU, SAMTrainer):
    pass


def _sft(out: str, **values):
    """TRL's SFTTrainer with SAMTrainerMixin, on 10-token sentences of a small grammar (every
    sequence the same length, so each process's mean loss is the same share of the global
    batch's), glassllm's tokenizer."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    from examples.tasks.causal_lm import load_glassllm
    from lightning_slsam.hf import SAMTrainerMixin

    class SFT(_FSDPOnCPU, SAMTrainerMixin, SFTTrainer):
        pass

    tokenizer = load_glassllm("en", pretrained=False)[1]
    texts = [t for t in sentences(400) if len(tokenizer(t)["input_ids"]) == 10][:64]
    values["args"] = training_args(out, config=SFTConfig, max_length=32, **values["args"])
    model = tiny_causal_lm(0, vocab_size=1024)
    return SFT(model=model, train_dataset=datasets.Dataset.from_dict({"text": texts}),
               processing_class=tokenizer, **values)  # fmt: skip


def _data(n: int = 64, seq: int = 8) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (n, seq), generator=gen)
    mask = torch.ones(seq, dtype=torch.long)
    return [{"input_ids": ids[i], "attention_mask": mask, "labels": ids[i], "index": i}
            for i in range(n)]  # fmt: skip


def main() -> None:
    args = worker_arguments(accumulate=1, save=0, resume=None, tag="", optim="sgd",
                            optim_args="", bf16=False, lora=False, trl=False,
                            state_dict="FULL_STATE_DICT")  # fmt: skip
    run_methods(args, train)


def train(args, method: str) -> None:
    """Trains ``method`` for 5 steps and saves ``{method}_rank{r}_of{world}{tag}.pt``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sharded: dict = {}
    if world > 1:
        wrap = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                "state_dict_type": args.state_dict}  # fmt: skip
        sharded = {"ddp_backend": "gloo", "fsdp": "full_shard auto_wrap", "fsdp_config": wrap}
    steps = StepLog()
    model = tiny_causal_lm(0)
    model.accepts_loss_kwargs = False  # each process's mean loss, averaged (hf_ddp_worker.py)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                          target_modules=["q_proj", "v_proj", "up_proj"])  # fmt: skip
        model = get_peft_model(model, lora)
    arguments = dict(per_device_train_batch_size=args.batch, max_steps=5, optim=args.optim,
                     optim_args=args.optim_args or None, learning_rate=0.5, max_grad_norm=1.0,
                     bf16=args.bf16, gradient_accumulation_steps=args.accumulate,
                     save_strategy="steps" if args.save else "no", save_steps=args.save or 500,
                     **sharded)  # fmt: skip
    out = os.path.join(args.out, f"{method}{args.tag}")
    if args.trl:
        trainer = _sft(out, args={**arguments, "learning_rate": 5e-3}, sam=method,
                       callbacks=[steps])  # fmt: skip
        model = trainer.model
    else:
        trainer = _OnCPU(model=model, train_dataset=_data(), args=training_args(out, **arguments),
                         sam=method, callbacks=[steps])  # fmt: skip
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    steps.trainer = trainer
    trainer.train(resume_from_checkpoint=args.resume)
    from torch.distributed.tensor import DTensor

    params = list(trainer.model.parameters())
    weights = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in trainer.model.state_dict().items()
    }
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    policy = getattr(plugin, "mixed_precision_policy", None)
    rank = int(os.environ.get("RANK", "0"))
    torch.save(
        {"weights": weights, "start": start, "masks": steps.masks, "world": world,
         "dtensors": sum(isinstance(p, DTensor) for p in params), "params": len(params),
         "trainable": {n for n, p in trainer.model.named_parameters() if p.requires_grad},
         "param_dtype": getattr(policy, "param_dtype", None), "begin_params": steps.begin_params,
         "seam": type(trainer.sam_engine.shards).__name__,
         "num_tokens": [e["num_tokens"] for e in trainer.state.log_history if "num_tokens" in e]},
        os.path.join(args.out, f"{method}_rank{rank}_of{world}{args.tag}.pt"),
    )  # fmt: skip


if __name__ == "__main__":
    main()
    release_process_group()  # a gloo group alive at exit can abort a finished run
