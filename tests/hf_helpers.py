"""Tiny Transformers models, data and Trainer arguments for the Hugging Face front-end's
tests (tests/hf) and its DDP worker (hf_ddp_worker.py)."""

from __future__ import annotations

from typing import Any

import kernels
import torch

kernels.apply()  # worker processes import this module: the variant reaches them too


def tiny_classifier(seed: int = 0) -> Any:
    """A 2-layer BERT sequence classifier (no dropout), initialised from ``seed``."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    return BertForSequenceClassification(config)


def tiny_causal_lm(seed: int = 0) -> Any:
    """A 2-layer Llama causal LM, initialised from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=32)  # fmt: skip
    return LlamaForCausalLM(config)


def classification_data(n: int = 96, seq: int = 8, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` samples whose label is whether token 5 appears (learnable)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (n, seq), generator=gen)
    labels = (ids == 5).any(1).long() | (ids[:, 0] < 32).long()
    return [{"input_ids": ids[i], "attention_mask": torch.ones(seq, dtype=torch.long),
             "labels": labels[i]} for i in range(n)]  # fmt: skip


def lm_data(n: int = 64, seq: int = 8, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` token sequences of varied length (padding labelled -100) for a causal LM."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(1, 64, (seq,), generator=gen)
        length = seq - i % 3
        mask = (torch.arange(seq) < length).long()
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def training_args(out: Any, **overrides: Any) -> Any:
    """Trainer arguments for a short CPU run: constant LR, no clipping, no saving."""
    from transformers import TrainingArguments

    values = dict(
        output_dir=str(out), per_device_train_batch_size=8, max_steps=4, learning_rate=1e-2,
        lr_scheduler_type="constant", weight_decay=0.01, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
        max_grad_norm=0.0,
    )  # fmt: skip
    values.update(overrides)
    return TrainingArguments(**values)


def decay_groups(model: Any, decay: set[str], weight_decay: float = 0.01) -> list[dict]:
    """The Trainer's two parameter groups (``decay``: its decayed parameter names)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
