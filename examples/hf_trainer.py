"""SL-SAM in the Hugging Face Trainer: MiniLM fine-tuned on Rotten Tomatoes, offline.

``SAMTrainer`` is a ``transformers.Trainer`` with one argument more, ``sam``: the method.
Everything else -- ``TrainingArguments``, accumulation, clipping, bf16, checkpoints,
reporters -- is the Trainer's::

    python examples/hf_trainer.py --steps 60                     # SparseLayerSAM()'s method
    python examples/hf_trainer.py --steps 60 --lora              # PEFT LoRA r=8: adapters only
    python examples/hf_trainer.py --method sam --accumulate 2    # any method of the registry
    python examples/hf_trainer.py --steps 80 --resume runs/hf/checkpoint-40
"""

from __future__ import annotations

import argparse

import numpy as np
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    TrainingArguments,
)

from lightning_slsam.demo.text import RottenTomatoesDataModule, default_model_path
from lightning_slsam.hf import SAMTrainer
from lightning_slsam.methods.registry import method_spec


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="slsam",
                        help="a method name: slsam (SparseLayerSAM()'s), slsam_paper (the"
                             " paper's SL-SAM), sam, esam, looksam, ...")  # fmt: skip
    parser.add_argument("--layer-ratio", type=float, default=None)
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (r=8) only")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--batch-size", type=int, default=32, help="per micro-batch")
    parser.add_argument("--lr", type=float, default=None,
                        help="default 2e-4, or 2e-3 with --lora (runs of 60 steps)")  # fmt: skip
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--num-train", type=int, default=None, help="cap training sentences")
    parser.add_argument("--num-val", type=int, default=256, help="cap validation sentences")
    parser.add_argument("--save-steps", type=int, default=20)
    parser.add_argument("--out", default="runs/hf")
    parser.add_argument("--resume", default=None, help="a checkpoint folder of this script")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    data = RottenTomatoesDataModule(num_train=args.num_train, num_val=args.num_val)
    data.setup("fit")
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    model = AutoModelForSequenceClassification.from_pretrained(default_model_path(), num_labels=2)
    # BERT-style classifiers take **kwargs but return the batch's mean loss: told so, the
    # Trainer averages the micro-batches of an accumulated step instead of summing their
    # means (which would log 2 ln 2 for a chance-level loss under --accumulate 2, and double
    # the update). docs/huggingface.md, "What keeps its meaning".
    model.accepts_loss_kwargs = False
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, task_type="SEQ_CLS",
                                                 target_modules=["query", "value"]))  # fmt: skip
    options = {} if args.layer_ratio is None else {"layer_ratio": args.layer_ratio}
    trainer = SAMTrainer(
        model=model,
        args=TrainingArguments(
            output_dir=args.out,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.accumulate,
            learning_rate=args.lr or (2e-3 if args.lora else 2e-4),
            weight_decay=0.01,
            lr_scheduler_type="cosine",
            warmup_steps=0,
            max_grad_norm=1.0,
            bf16=args.bf16,
            logging_steps=10,
            save_strategy="steps",
            save_steps=args.save_steps,
            eval_strategy="no",
            per_device_eval_batch_size=64,
            report_to=[],
            use_cpu=True,
            seed=args.seed,
            dataloader_num_workers=0,
        ),
        train_dataset=data.train_dataset,
        eval_dataset=data.val_dataset,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=lambda p: {
            "accuracy": float((np.argmax(p.predictions, -1) == p.label_ids).mean())
        },
        sam=method_spec(args.method, **options),
    )
    trainer.train(resume_from_checkpoint=args.resume)
    metrics = trainer.evaluate()
    engine = trainer.sam_engine
    done = max(engine.num_steps - engine.num_skipped, 1)
    summary = {
        "method": args.method, "lora": args.lora, "steps": trainer.state.global_step,
        "val_accuracy": metrics["eval_accuracy"], "val_loss": metrics["eval_loss"],
        "mean_active_ratio": engine.active_ratio_sum / done,
        "trainable_parameters": engine.trainable_numel,
    }  # fmt: skip
    logged = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    print(", ".join(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}"
                    for k, v in summary.items()))  # fmt: skip
    return {**summary, "logged_loss": logged}


if __name__ == "__main__":
    main()
