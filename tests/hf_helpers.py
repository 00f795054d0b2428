"""Tiny Transformers models, data, Trainer arguments and a step recorder for the Hugging
Face front-end's tests (tests/hf) and its process workers (hf_ddp_worker.py,
hf_fsdp2_worker.py)."""

from __future__ import annotations

from typing import Any

import kernels
import torch
from transformers import TrainerCallback

kernels.apply()  # worker processes import this module: the variant reaches them too


def tiny_classifier(seed: int = 0) -> Any:
    """A 2-layer BERT sequence classifier (no dropout), initialised from ``seed``."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    return BertForSequenceClassification(config)


def tiny_causal_lm(seed: int = 0, vocab_size: int = 64) -> Any:
    """A 2-layer Llama causal LM, initialised from ``seed`` (``vocab_size`` 1024: glassllm's
    tokenizer's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=32)  # fmt: skip
    return LlamaForCausalLM(config)


def classification_data(n: int = 96, seq: int = 8, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` samples whose label is whether token 5 appears (learnable), each with its
    ``index`` (SAF's; SAMTrainer keeps it from the model)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (n, seq), generator=gen)
    labels = (ids == 5).any(1).long() | (ids[:, 0] < 32).long()
    return [{"input_ids": ids[i], "attention_mask": torch.ones(seq, dtype=torch.long),
             "labels": labels[i], "index": i} for i in range(n)]  # fmt: skip


def lm_data(n: int = 64, seq: int = 8, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` token sequences of varied length (padding labelled -100) for a causal LM."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(1, 64, (seq,), generator=gen)
        length = seq - i % 3
        mask = (torch.arange(seq) < length).long()
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels, "index": i})
    return rows


def sentences(n: int = 96, seed: int = 0) -> list[str]:
    """Short sentences of a small grammar: a tiny LM learns them in a few steps."""
    import random

    rng = random.Random(seed)
    parts = (["the cat", "a dog", "the bird", "my friend"],
             ["sat on", "looked at", "ran to", "slept by"],
             ["the mat.", "a tree.", "the door.", "the house."])  # fmt: skip
    return [" ".join(rng.choice(words) for words in parts) for _ in range(n)]


def training_args(out: Any, config: Any = None, **overrides: Any) -> Any:
    """Trainer arguments for a short CPU run: constant LR, no clipping, no saving (of the
    class ``config``, e.g. TRL's ``SFTConfig``; ``TrainingArguments`` by default)."""
    from transformers import TrainingArguments

    values = dict(
        output_dir=str(out), per_device_train_batch_size=8, max_steps=4, learning_rate=1e-2,
        lr_scheduler_type="constant", weight_decay=0.01, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
        max_grad_norm=0.0,
    )  # fmt: skip
    values.update(overrides)
    return (config or TrainingArguments)(**values)


def decay_groups(model: Any, decay: set[str], weight_decay: float = 0.01) -> list[dict]:
    """The Trainer's two parameter groups (``decay``: its decayed parameter names)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


class StepLog(TrainerCallback):
    """Each optimizer step's active layers and the bytes the engine all-reduced, read from
    ``trainer.sam_engine`` after the step, and the kinds of the engine's parameters when
    training begins (set ``trainer`` once the Trainer is built)."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.masks: list[list[bool]] = []
        self.allreduce: list[int] = []
        self.begin_params: set[str] = set()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        engine = self.trainer.sam_engine
        self.begin_params = {type(p).__name__ for p in engine.partition.flat_params}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        result = self.trainer.sam_engine.last_result
        self.masks.append(result.active_mask.tolist())
        self.allreduce.append(result.allreduce_bytes)


def worker_arguments(**more: Any) -> Any:
    """The process workers' command line: ``--out``, ``--batch``, ``--method`` and ``more``
    (name -> default; ``None``: a string without default)."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--method", default="slsam")
    for name, default in more.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(default) if default is not None else str,
                                default=default)  # fmt: skip
    return parser.parse_args()


def run_methods(args: Any, train: Any) -> None:
    """``train(args, method)`` for each method of ``--method`` (comma-separated), one after
    another in the same processes; then, both ranks done with every collective (the
    checkpoints' too), the process groups go: a gloo worker thread still running at the
    interpreter's teardown aborts the process."""
    import torch.distributed as dist

    for method in args.method.split(","):
        train(args, method)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
