"""Instruction fine-tuning of a causal LM on Open-Platypus (the SL-SAM paper's Table 5).

The paper continues fine-tuning Llama-3.2-3B-Instruct on Open-Platypus for one epoch in
bfloat16, AdamW at 1e-5, batch 2, rho 0.01, layer_ratio 0.2, and evaluates the final model
on MMLU, RTE, HellaSwag, BoolQ, OpenBookQA and ARC-Challenge. Config:
``examples/configs/recipes/llama_platypus.yaml``; with ``export_dir`` set, the model and
tokenizer are saved there at the end of training for an evaluation harness, e.g.

    lm_eval --model hf --model_args pretrained=runs/llama_platypus/export,dtype=bfloat16 \\
        --tasks mmlu,rte,hellaswag,boolq,openbookqa,arc_challenge --batch_size 8

Each example is the instruction (plus its input, if any) as the user turn of the
tokenizer's chat template, then the answer; the loss covers the answer tokens only.
Data: ``garage-bAInd/Open-Platypus`` from the Hugging Face hub (``pip install
datasets``), or a local JSON-lines file with ``instruction``, ``input`` and ``output``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader

from examples.recipes.common import check_path, load_hub_dataset, read_jsonl
from examples.recipes.fsdp import full_state_dict, fully_shard_blocks
from lightning_slsam.demo.common import (
    check_training,
    require,
    with_schedule,
)
from lightning_slsam.lightning.mixin import SAMMixin
from lightning_slsam.methods.options import check_int, check_number

__all__ = ["CausalLMFineTuner", "InstructionDataModule", "encode_example"]

IGNORE = -100
_FALLBACK_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"


def encode_example(tokenizer: Any, row: dict[str, Any], max_length: int) -> dict[str, list[int]]:
    """Token ids of one example and its labels (``-100`` on the prompt and on nothing else)."""
    prompt = row["instruction"].strip()
    if row.get("input", "").strip():
        prompt += "\n\n" + row["input"].strip()
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = _FALLBACK_TEMPLATE.format(prompt=prompt)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None and prompt_ids[:1] != [tokenizer.bos_token_id]:
        prompt_ids = [tokenizer.bos_token_id, *prompt_ids]
    answer = tokenizer(row["output"].strip(), add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        answer = [*answer, tokenizer.eos_token_id]
    ids = (prompt_ids + answer)[:max_length]
    labels = ([IGNORE] * len(prompt_ids) + answer)[:max_length]
    return {"input_ids": ids, "labels": labels}


@dataclass
class _Collator:
    pad_token_id: int

    def __call__(self, examples: list[dict[str, list[int]]]) -> dict[str, Tensor]:
        longest = max(len(ex["input_ids"]) for ex in examples)

        def pad(key: str, fill: int) -> Tensor:
            return torch.tensor([ex[key] + [fill] * (longest - len(ex[key])) for ex in examples])

        lengths = [len(ex["input_ids"]) for ex in examples]
        mask = [[1] * n + [0] * (longest - n) for n in lengths]
        return {"input_ids": pad("input_ids", self.pad_token_id), "labels": pad("labels", IGNORE),
                "attention_mask": torch.tensor(mask)}  # fmt: skip


class InstructionDataModule(L.LightningDataModule):
    """Instruction/answer pairs, tokenised with the model's chat template, a held-out split.

    Args:
        tokenizer: tokenizer folder or hub name; default
            ``meta-llama/Llama-3.2-3B-Instruct`` (gated: accept its licence on the hub).
        dataset: hub dataset name; default ``garage-bAInd/Open-Platypus``.
        data_file: a local JSON-lines file instead of the hub dataset.
        batch_size: examples per batch (>= 1); paper: 2.
        max_length: tokens kept per example (>= 16); default 1024.
        val_size: examples held out for ``val_loss`` (>= 0); default 200.
        seed: seed of the held-out split.
        num_train: keep only this many training examples (``None``: all).
    """

    def __init__(
        self,
        tokenizer: str = "meta-llama/Llama-3.2-3B-Instruct",
        dataset: str = "garage-bAInd/Open-Platypus",
        data_file: str | None = None,
        batch_size: int = 2,
        max_length: int = 1024,
        val_size: int = 200,
        seed: int = 0,
        num_train: int | None = None,
    ) -> None:
        super().__init__()
        require("transformers", "InstructionDataModule")
        check_int("batch_size", batch_size, 1)
        check_int("max_length", max_length, 16)
        check_int("val_size", val_size, 0)
        check_path("data_file", data_file, folder=False)
        self.save_hyperparameters()
        self.splits: dict[str, list[dict[str, list[int]]]] = {}

    def rows(self) -> list[dict[str, Any]]:
        hp = self.hparams
        if hp.data_file is not None:
            return read_jsonl(hp.data_file)
        return [dict(row) for row in load_hub_dataset(hp.dataset, split="train")]

    def setup(self, stage: str) -> None:
        if self.splits:
            return
        from transformers import AutoTokenizer

        hp = self.hparams
        self.tokenizer = AutoTokenizer.from_pretrained(hp.tokenizer)
        rows = self.rows()
        missing = [f for f in ("instruction", "output") if rows and f not in rows[0]]
        if missing:
            raise ValueError(f"Instruction rows lack fields {missing}.")
        if hp.val_size >= len(rows):
            raise ValueError(f"`val_size` {hp.val_size} leaves no training data of {len(rows)}.")
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(hp.seed))
        held, kept = order[: hp.val_size].tolist(), order[hp.val_size :].tolist()[: hp.num_train]
        encode = [encode_example(self.tokenizer, row, hp.max_length) for row in rows]
        self.splits = {"train": [encode[i] for i in kept], "val": [encode[i] for i in held]}

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def _loader(self, name: str, shuffle: bool) -> DataLoader:
        assert self.splits, "call setup() first"
        pad = self.tokenizer.pad_token_id
        pad = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        return DataLoader(self.splits[name], batch_size=self.hparams.batch_size,
                          shuffle=shuffle, collate_fn=_Collator(pad))  # fmt: skip


class CausalLMFineTuner(SAMMixin, L.LightningModule):
    """A Hugging Face causal LM fine-tuned on instruction data.

    Args:
        model_name_or_path: model folder or hub name; default
            ``meta-llama/Llama-3.2-3B-Instruct``.
        learning_rate: AdamW peak learning rate (> 0); paper: 1e-5.
        weight_decay: AdamW decoupled weight decay (>= 0); default 0.
        schedule: ``"constant"`` (default), ``"linear"`` or ``"cosine"``.
        warmup_ratio: fraction of the steps with a linear warm-up, in [0, 1); default 0.
        pretrained: load the pretrained weights (default); ``False``: random init.
        load_dtype: dtype the weights are loaded in (``"bfloat16"``, ``"float32"``...);
            ``None``: the checkpoint's. With ``precision: bf16-true`` the Trainer keeps
            weights, gradients and optimizer state in bfloat16.
        gradient_checkpointing: recompute activations in the backward pass (less memory).
        export_dir: if set, the trained model and its tokenizer are saved there at the end
            of fit (``save_pretrained``), ready for an evaluation harness.
    """

    def __init__(
        self,
        model_name_or_path: str = "meta-llama/Llama-3.2-3B-Instruct",
        learning_rate: float = 1e-5,
        weight_decay: float = 0.0,
        schedule: str = "constant",
        warmup_ratio: float = 0.0,
        pretrained: bool = True,
        load_dtype: str | None = "bfloat16",
        gradient_checkpointing: bool = False,
        export_dir: str | None = None,
    ) -> None:
        super().__init__()
        require("transformers", "CausalLMFineTuner")
        check_number("learning_rate", learning_rate, "> 0", lambda v: v > 0)
        check_training(learning_rate, weight_decay, warmup_ratio, schedule)
        dtype = None
        if load_dtype is not None:
            dtype = getattr(torch, str(load_dtype), None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise ValueError(
                    f"`load_dtype` must be a floating torch dtype name such as 'bfloat16' or"
                    f" 'float32', or null; got {load_dtype!r}."
                )
        self.save_hyperparameters()
        from transformers import AutoConfig, AutoModelForCausalLM

        if pretrained:
            self.model = AutoModelForCausalLM.from_pretrained(model_name_or_path, dtype=dtype)
        else:
            config = AutoConfig.from_pretrained(model_name_or_path)
            self.model = AutoModelForCausalLM.from_config(config)
            if dtype is not None:
                self.model.to(dtype)
        if gradient_checkpointing:  # renamed in Transformers 5
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            (enable or self.model.gradient_checkpointing_enable)()
        self.model.train()

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` (FSDP2): shard every decoder layer, then the
        model, over the data-parallel mesh. Nothing to do on one device or under DDP."""
        mesh = self.device_mesh
        if mesh is None or getattr(self, "_sharded", False):
            return
        if mesh.ndim > 1 and mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                "CausalLMFineTuner shards with FSDP2 only: use ModelParallelStrategy("
                "data_parallel_size=<number of processes>, tensor_parallel_size=1)."
            )
        fully_shard_blocks(self.model, mesh["data_parallel"] if mesh.ndim > 1 else mesh)
        self._sharded = True

    def _losses(self, batch: dict[str, Tensor]) -> Tensor:
        """Mean token loss of each example's answer."""
        labels = batch["labels"]
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        logits = self.model(**inputs).logits
        shifted = labels[:, 1:]
        tokens = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), shifted,
                                 ignore_index=IGNORE, reduction="none")  # fmt: skip
        counts = (shifted != IGNORE).sum(1).clamp_min(1)
        return tokens.sum(1) / counts

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Per-example losses (averaged by SAMMixin)."""
        losses = self._losses(batch)
        self.log("train_loss", losses.mean(), prog_bar=True, batch_size=len(losses))
        return losses

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        losses = self._losses(batch)
        self.log("val_loss", losses.mean(), prog_bar=True, batch_size=len(losses))

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        params = [p for p in self.model.parameters()]
        optimizer = torch.optim.AdamW(params, lr=hp.learning_rate, weight_decay=hp.weight_decay)
        return with_schedule(self.trainer, optimizer, hp.schedule, hp.warmup_ratio)

    def on_train_end(self) -> None:
        hp = self.hparams
        if hp.export_dir is None:
            return
        weights = full_state_dict(self.model)  # a collective under FSDP2: every process
        if not self.trainer.is_global_zero:
            return
        from transformers import AutoTokenizer

        self.model.save_pretrained(hp.export_dir, state_dict=weights)
        AutoTokenizer.from_pretrained(hp.model_name_or_path).save_pretrained(hp.export_dir)
