"""Reliability: nothing lost under faults, bad input and long runs.

Each test states the guarantee it proves; docs/reliability.md lists them.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import subprocess
import sys
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    LitModel,
    ResumableLoader,
    Snapshots,
    loader,
    make_data,
    make_mlp,
    per_sample_outputs,
    trainer,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_slsam import METHODS, SparseLayerSAM, make_callback
from lightning_slsam.lightning.callbacks import make_callbacks
from lightning_slsam.selection.bandit import LayerBandit

WORKER = os.path.join(os.path.dirname(__file__), "fault_worker.py")


def _worker(*args, timeout=300):
    return subprocess.run([sys.executable, WORKER, *args], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _sha(path):
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def _weights(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _finite(tree) -> bool:
    if isinstance(tree, torch.Tensor):
        return bool(torch.isfinite(tree).all()) if tree.is_floating_point() else True
    if isinstance(tree, dict):
        return all(_finite(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return all(_finite(v) for v in tree)
    return True


class _PerSample(LitModel):
    def training_step(self, batch, batch_idx):
        return per_sample_outputs(self, batch)


# --- 1. crash and resume ----------------------------------------------------------------


def test_sigkill_mid_step_then_resume_equals_the_uninterrupted_run(tmp_path):
    """A process SIGKILLed inside a SAM step (weights perturbed in memory), resumed from its
    last step checkpoint, ends with the uninterrupted run's weights, optimizer state and
    bandit probabilities, bit for bit."""
    full, crash = tmp_path / "full", tmp_path / "crash"
    done = _worker("train", "--steps", "10", "--out", str(full))
    assert done.returncode == 0, done.stderr[-3000:]
    done = _worker("train", "--steps", "10", "--kill-at", "5", "--out", str(crash))
    assert done.returncode == -9, done.stderr[-3000:]  # killed by SIGKILL
    checkpoints = sorted(os.listdir(crash / "ckpt"))
    assert checkpoints == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    assert not (crash / "final.pt").exists()
    last = str(crash / "ckpt" / checkpoints[-1])
    done = _worker("train", "--steps", "10", "--resume", last, "--out", str(crash))
    assert done.returncode == 0, done.stderr[-3000:]
    a = torch.load(full / "final.pt", weights_only=False)
    b = torch.load(crash / "final.pt", weights_only=False)
    assert a["global_step"] == b["global_step"] == 10
    for name in a["weights"]:
        assert torch.equal(a["weights"][name], b["weights"][name]), name
    assert torch.equal(a["probs"], b["probs"]) and torch.equal(a["counts"], b["counts"])
    assert not torch.allclose(a["probs"], torch.full_like(a["probs"], 0.3))  # it learned
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and sa
    for index in sa:
        for key in sa[index]:
            assert torch.equal(torch.as_tensor(sa[index][key]), torch.as_tensor(sb[index][key]))


class _FailingModel(LitModel):
    """Raises inside the perturbed second pass of step ``fail_at``."""

    fail_at = 3

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.fail_at and self.sam_pass == 2:
            raise RuntimeError("injected failure between the passes")
        return super().training_step(batch, batch_idx)


def test_exception_between_passes_leaves_and_checkpoints_the_unperturbed_weights(tmp_path):
    """An exception inside the second (perturbed) pass: the module afterwards, and the
    checkpoint OnExceptionCheckpoint writes, hold the weights of the last completed step --
    never the perturbed ones; the optimizer state is that of the last step; every tensor
    is trainable again."""
    model = _FailingModel(make_mlp(seed=2))
    snaps = Snapshots()
    sam = SparseLayerSAM(rho=0.5, layer_ratio=0.5)
    on_exc = OnExceptionCheckpoint(dirpath=tmp_path, filename="on_exception")
    t = trainer(callbacks=[sam, snaps, on_exc], max_epochs=2, enable_checkpointing=True)
    with pytest.raises(RuntimeError, match="injected failure"):
        t.fit(model, loader(make_data(96), 16))
    assert len(snaps.after) == 3  # steps 0, 1, 2 completed
    last = snaps.after[-1]
    for name, value in _weights(model).items():
        assert torch.equal(value, last[name]), name
    assert all(p.requires_grad for p in model.parameters())
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)
    for name, value in last.items():
        assert torch.equal(saved["state_dict"][name], value), name
    # The perturbation was large: had it leaked, the comparison above would fail.
    assert sam.rho == 0.5


class _ValidationProbe(L.Callback):
    def __init__(self):
        self.seen = []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.seen.append((trainer.global_step, _weights(pl_module)))


def test_validation_and_checkpoints_see_the_unperturbed_weights(tmp_path):
    """Validation mid-epoch and every step checkpoint hold the post-step weights."""
    model = LitModel(make_mlp(seed=3))
    snaps, probe = Snapshots(), _ValidationProbe()
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    t = trainer(callbacks=[SparseLayerSAM(rho=0.5, layer_ratio=0.5), snaps, probe, saver],
                max_epochs=1, val_check_interval=2, enable_checkpointing=True,
                limit_val_batches=1)  # fmt: skip
    t.fit(model, loader(make_data(96), 16), loader(make_data(32, seed=1), 16))
    assert [step for step, _ in probe.seen] == [2, 4, 6]
    for step, weights in probe.seen:
        for name, value in weights.items():
            assert torch.equal(value, snaps.after[step - 1][name]), (step, name)
    for step in range(1, 7):
        state = torch.load(tmp_path / f"epoch=0-step={step}.ckpt", weights_only=False)
        for name, value in snaps.after[step - 1].items():
            assert torch.equal(state["state_dict"][name], value), (step, name)


# --- 3. checkpoint compatibility --------------------------------------------------------


class _Renamed(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return self.body(x)


@pytest.fixture(scope="module")
def sl_sam_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("compat")
    L.seed_everything(0)
    saver = ModelCheckpoint(dirpath=out, filename="slsam", save_last=False)
    t = trainer(callbacks=[SparseLayerSAM(layer_ratio=0.4), saver], max_epochs=1,
                enable_checkpointing=True)  # fmt: skip
    t.fit(LitModel(make_mlp(seed=1)), loader(make_data(64), 16))
    return str(out / "slsam.ckpt")


@pytest.mark.parametrize(
    "variant, message",
    [
        ("added", r"Missing key\(s\) in state_dict: \"net\.6\.weight\""),
        ("removed", r"Unexpected key\(s\) in state_dict: \"net\.5\.weight\""),
        ("renamed", r"Missing key\(s\) in state_dict: \"net\.body\.0\.weight\""),
        ("grouping", r"does not match this model's layers"),
    ],
)
def test_resuming_into_other_layers_fails_naming_the_mismatch_and_loses_nothing(
    variant, message, sl_sam_checkpoint
):
    """Added, removed or renamed tensors, or another layer grouping: the resume fails before
    any training step with a message naming the mismatch; the checkpoint is untouched."""
    before = _sha(sl_sam_checkpoint)
    base = make_mlp(seed=1)
    layers = "tensor"
    if variant == "added":
        net = nn.Sequential(*list(base), nn.Linear(3, 3))
    elif variant == "removed":
        net = nn.Sequential(*list(base)[:-1])
    elif variant == "renamed":
        net = _Renamed(base)
    else:
        net, layers = base, "module"
    model = LitModel(net)
    snaps = Snapshots()
    t = trainer(callbacks=[SparseLayerSAM(layer_ratio=0.4, layers=layers), snaps], max_epochs=2)
    with pytest.raises(Exception, match=message) as info:
        t.fit(model, loader(make_data(64), 16), ckpt_path=sl_sam_checkpoint)
    assert not snaps.after, "no training step may run"
    if variant == "grouping":  # the method's own check: Lightning's exception for Lightning
        assert isinstance(info.value, MisconfigurationException)
    assert len(str(info.value)) < 4000
    assert _sha(sl_sam_checkpoint) == before


def test_plain_adamw_checkpoint_resumes_with_sl_sam_and_back(tmp_path):
    """A checkpoint of plain AdamW (automatic optimization) resumes with SL-SAM added, and an
    SL-SAM checkpoint resumes as plain AdamW: steps continue, optimizer state carries over."""
    data = make_data(64)
    L.seed_everything(0)
    saver = ModelCheckpoint(dirpath=tmp_path, filename="adamw")
    first = LitModel(make_mlp(seed=1))
    trainer(callbacks=[saver], max_epochs=1, enable_checkpointing=True).fit(first, loader(data, 16))
    adamw = torch.load(tmp_path / "adamw.ckpt", weights_only=False)
    assert adamw["global_step"] == 4

    class Start(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.state = copy.deepcopy(trainer.optimizers[0].state_dict()["state"])
            self.weights = _weights(pl_module)

    start, sam = Start(), SparseLayerSAM(layer_ratio=0.4)
    saver = ModelCheckpoint(dirpath=tmp_path, filename="slsam")
    second = LitModel(make_mlp(seed=9))
    t = trainer(callbacks=[sam, start, saver], max_epochs=2, enable_checkpointing=True)
    t.fit(second, loader(data, 16), ckpt_path=str(tmp_path / "adamw.ckpt"))
    assert t.global_step == 8 and sam.engine.num_steps == 4
    for name, value in adamw["state_dict"].items():
        assert torch.equal(start.weights[name], value)
    saved = adamw["optimizer_states"][0]["state"]
    assert all(torch.equal(start.state[i]["exp_avg"], saved[i]["exp_avg"]) for i in saved)
    assert _finite(_weights(second))

    third = LitModel(make_mlp(seed=4))
    t = trainer(max_epochs=3, enable_checkpointing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning notes the callback state it does not use
        t.fit(third, loader(data, 16), ckpt_path=str(tmp_path / "slsam.ckpt"))
    assert t.global_step == 12 and third.automatic_optimization
    moved = _weights(third)
    resumed_from = torch.load(tmp_path / "slsam.ckpt", weights_only=False)["state_dict"]
    assert all(not torch.equal(moved[n], resumed_from[n]) for n in moved)


# --- 4. non-finite values over long runs --------------------------------------------------


class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class _Injecting(LitModel):
    """Injects NaN/Inf at chosen (step, pass): into the loss, or into the gradients only."""

    plan: dict = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        fault = self.plan.get((self.trainer.global_step, self.sam_pass))
        if fault == "grad":
            out = _InfGrad.apply(out)
        loss = F.cross_entropy(out.float(), y)
        if fault in ("nan", "inf"):
            loss = loss * float(fault)
        return loss


class _Skips(L.Callback):
    def __init__(self):
        self.skipped, self.kinds = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sam = next(c for c in trainer.callbacks if isinstance(c, SparseLayerSAM))
        if sam.engine.last_result.skipped:
            self.skipped.append(trainer.global_step - 1)


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_injected_non_finite_steps_are_skipped_counted_logged_and_training_continues(
    precision, tmp_path
):
    steps = 60
    gen = torch.Generator().manual_seed(11)
    chosen = torch.randperm(steps, generator=gen)[:12].tolist()
    faults = ("nan", "inf", "grad")
    plan = {(s, 1 + (i % 2)): faults[i % 3] for i, s in enumerate(chosen)}
    model = _Injecting(make_mlp(seed=6))
    model.plan = plan
    plugins = []
    if precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=scaler))
    skips, sam = _Skips(), SparseLayerSAM(layer_ratio=0.4)
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="run")
    t = trainer(callbacks=[sam, skips], max_steps=steps, logger=logger, log_every_n_steps=1,
                plugins=plugins, precision=None if plugins else precision)  # fmt: skip
    start = _weights(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        t.fit(model, ResumableLoader(make_data(16 * steps), batch_size=16))
    assert t.global_step == steps
    assert set(chosen) <= set(skips.skipped)
    if precision == "32-true":
        assert sorted(skips.skipped) == sorted(chosen)
    assert sam.engine.num_skipped == len(skips.skipped)
    assert float(t.callback_metrics["slsam/skipped_steps"]) == len(skips.skipped)
    assert _finite(_weights(model)) and _finite(t.optimizers[0].state_dict()["state"])
    costs = sam.bandit.costs  # the default's compute budget: 40% of the parameters
    spent = float((costs * sam.probs).sum())
    assert _finite(sam.probs) and abs(spent - 0.4 * float(costs.sum())) < 1e-6
    assert sum(not torch.equal(start[n], p) for n, p in _weights(model).items()) > 0
    with open(os.path.join(logger.log_dir, "metrics.csv")) as handle:
        assert "slsam/skipped_steps" in handle.readline()


# --- 5. long-run bandit invariants ----------------------------------------------------------


@pytest.mark.slow
def test_bandit_keeps_its_invariants_over_100k_adversarial_updates():
    n, ratio, p_min = 12, 0.2, 0.01
    bandit = LayerBandit(n, ratio, p_min, alpha_p=0.05, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(n, dtype=torch.int64)
    patterns = [
        lambda: torch.zeros(n),
        lambda: torch.full((n,), 1e30),
        lambda: torch.full((n,), 1e-30),
        lambda: torch.eye(n)[0] * 1e20,  # one layer dominates
        lambda: torch.eye(n)[5] * 1e-20 + 1e-30,
        lambda: torch.exp(torch.randn(n, generator=gen, dtype=torch.float64) * 30),  # 1e±50
        lambda: torch.rand(n, generator=gen),
    ]
    total = 100_000
    for step in range(total):
        mask = bandit.sample()
        counts += mask.to(torch.int64)
        assert bandit.update(mask, patterns[(step // 7) % len(patterns)]())
        if step % 500 == 0 or step == total - 1:
            p = bandit.probs
            assert torch.isfinite(p).all()
            assert abs(float(p.sum()) - ratio * n) < 1e-9
            assert float(p.min()) >= p_min * (1 - 1e-12) and float(p.max()) <= 1 + 1e-12
    # No starvation: every layer drawn at a frequency of at least p_min (5 sigma slack).
    floor = p_min * total - 5 * math.sqrt(p_min * total)
    assert int(counts.min()) >= floor, counts.tolist()


# --- 6. config fuzzing ----------------------------------------------------------------------

OPTION_VALUES = {
    "rho": [0.01, 0.2, 0.0, -0.1, "big"],
    "layer_ratio": [0.2, 1.0, 0.0, 1.5],
    "p_min": [1e-3, 0.1, 0.0, 0.5],
    "alpha_p": [1e-3, 1.0, -1.0],
    "adaptive": [False, True, "yes"],
    "perturbation_norm": ["global", "layer", "l3"],
    "accumulate_grad_batches": [1, 2, 0, 1.5],
    "gradient_clip_val": [None, 1.0, -1.0],
    "gradient_clip_algorithm": ["norm", "value", "max"],
    "bn_stats": ["first", "both", "all"],
    "replay_dropout": [False, True, 1],
    "preset": ["default", "paper", "robust"],
    "probability": [0.5, 1.0, 2.0],
    "layers": ["tensor", "module", "block"],
}
TRAINER_VALUES = {
    "precision": ["32-true", "bf16-mixed", "64-true"],
    "accumulate_grad_batches": [1, 2],
    "gradient_clip_val": [None, 0.5],
}


# Values no method accepts: a config holding one must fail at construction or setup.
INVALID = {("rho", 0.0), ("rho", -0.1), ("rho", "big"), ("layer_ratio", 0.0),
           ("layer_ratio", 1.5), ("p_min", 0.0), ("alpha_p", -1.0), ("adaptive", "yes"),
           ("perturbation_norm", "l3"), ("accumulate_grad_batches", 0),
           ("accumulate_grad_batches", 1.5), ("gradient_clip_val", -1.0),
           ("gradient_clip_algorithm", "max"), ("bn_stats", "all"), ("replay_dropout", 1),
           ("preset", "robust"), ("probability", 2.0), ("layers", "block")}  # fmt: skip


class _Reached(L.Callback):
    started = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.started = True


@pytest.mark.timeout(600)
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=True)  # fmt: skip
@given(
    method=st.sampled_from(sorted(m for m in METHODS if m != "adamw")),
    options=st.dictionaries(st.sampled_from(sorted(OPTION_VALUES)), st.integers(0, 4),
                            max_size=4),
    flags=st.dictionaries(st.sampled_from(sorted(TRAINER_VALUES)), st.integers(0, 2),
                          max_size=2),
)  # fmt: skip
def test_random_configs_train_correctly_or_fail_at_setup_naming_the_option(method, options, flags):
    kwargs = {k: OPTION_VALUES[k][i % len(OPTION_VALUES[k])] for k, i in options.items()}
    trainer_flags = {k: TRAINER_VALUES[k][i % len(TRAINER_VALUES[k])] for k, i in flags.items()}
    named = set(kwargs) | {k for k, v in trainer_flags.items() if v not in (None, 1, "32-true")}
    # Compared with their types: True == 1, but replay_dropout=True is valid and 1 is not.
    invalid = {
        k
        for k, v in kwargs.items()
        if any((k, type(v)) == (a, type(b)) and v == b for a, b in INVALID)
    }
    model = _PerSample(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.1),
                                     nn.Linear(8, 3)))  # fmt: skip
    reached = _Reached()
    try:
        callback = make_callback(method, **kwargs)
        t = trainer(callbacks=[callback, reached], max_steps=3, **trainer_flags)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t.fit(model, loader(make_data(64, indexed=64), 8))
    except Exception as err:  # what is raised is the subject of the test
        assert not reached.started, f"failed inside training: {err!r}"
        assert isinstance(err, (ValueError, TypeError)) or "Misconfiguration" in type(err).__name__
        text = str(err)
        assert any(name in text for name in named), (named, text)
        return
    assert not invalid, f"accepted invalid {invalid}"
    assert t.global_step == 3
    assert _finite(_weights(model)) and all(p.requires_grad for p in model.parameters())


# --- 7. DDP faults --------------------------------------------------------------------------


def test_ddp_divergent_masks_are_reported_by_the_debug_check():
    """With check_masks=True, a process whose layer draw diverges stops every process with
    an error naming it, before any weight changes, instead of a hang or a gloo error."""
    done = _worker("diverge", "--check-masks", timeout=180)
    assert done.returncode != 0
    assert "check_masks: at step 0 process(es) [1] drew other layers" in done.stderr
    assert "Use the same `seed` on every process" in done.stderr


def test_ddp_spawn_worker_killed_ends_the_run_with_an_error():
    """A worker SIGKILLed under ddp_spawn ends the whole run with an error, not a hang."""
    done = _worker("kill", timeout=180)
    assert done.returncode != 0
    assert "process 1 terminated with signal SIGKILL" in done.stderr


# --- 8. determinism ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", sorted(METHODS))
def test_same_seed_same_result_for_every_method(method):
    """Same seed, same machine: bit-identical weights and probabilities; another seed
    changes the run (so the comparison can fail)."""

    def run(seed):
        L.seed_everything(seed)
        model = _PerSample(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Tanh(),
                                         nn.Linear(16, 3)))  # fmt: skip
        callbacks = make_callbacks(method)
        callback = callbacks[0] if callbacks else None
        t = trainer(callbacks=callbacks, max_steps=6)
        t.fit(model, ResumableLoader(make_data(96, indexed=96), batch_size=16, shuffle=True))
        probs = getattr(callback, "probs", None) if callback else None
        return _weights(model), probs

    (w1, p1), (w2, p2), (w3, _) = run(5), run(5), run(6)
    assert all(torch.equal(w1[n], w2[n]) for n in w1)
    if p1 is not None:
        assert torch.equal(p1, p2)
    assert any(not torch.equal(w1[n], w3[n]) for n in w1)


class _WithHead(LitModel):
    def sam_head_parameters(self):
        return ["net.5.weight", "net.5.bias"]


@pytest.mark.parametrize("model_class", [LitModel, _WithHead])
def test_a_checkpoint_of_the_old_default_resumes_or_says_how(model_class, tmp_path):
    """A checkpoint of the paper's configuration (the default before 0.2.0) under today's
    default: without a fresh head the layers match, and it resumes with a warning and the
    distribution projected onto the compute budget; with one, the head rule places the head
    out of sampling, and the refusal names ``preset='paper'``, which resumes it as it was."""
    L.seed_everything(0)
    saver = ModelCheckpoint(dirpath=tmp_path, filename="paper", save_last=False)
    t = trainer(callbacks=[SparseLayerSAM(preset="paper", layer_ratio=0.4), saver],
                max_epochs=1, enable_checkpointing=True)  # fmt: skip
    t.fit(model_class(make_mlp(seed=1)), loader(make_data(64), 16))
    path, before = str(tmp_path / "paper.ckpt"), _sha(str(tmp_path / "paper.ckpt"))
    data = loader(make_data(64), 16)
    default = SparseLayerSAM(layer_ratio=0.4)
    t = trainer(callbacks=[default], max_epochs=2)
    if model_class is LitModel:
        with pytest.warns(UserWarning, match=r"budget 'count' -> 'compute'"):
            t.fit(model_class(make_mlp(seed=1)), data, ckpt_path=path)
        assert t.global_step == 8 and default.bandit.costs is not None
        costs, probs = default.bandit.costs, default.bandit.probs
        assert float((costs * probs).sum()) == pytest.approx(0.4 * float(costs.sum()))
    else:
        with pytest.raises(Exception, match=r"resume with SparseLayerSAM\(preset='paper'\)"):
            t.fit(model_class(make_mlp(seed=1)), data, ckpt_path=path)
        paper = SparseLayerSAM(preset="paper", layer_ratio=0.4)
        t = trainer(callbacks=[paper], max_epochs=2)
        t.fit(model_class(make_mlp(seed=1)), data, ckpt_path=path)
        assert t.global_step == 8
    assert _sha(path) == before
