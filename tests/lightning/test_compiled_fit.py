"""Layer sampling on a compiled model, through a Trainer: both forms users write (the model
compiled whole, its blocks compiled), every method that samples layers, resume, and the
dense method it must equal at layer_ratio=1 -- each with no recompile after warm-up and
equal to eager with the same grouping (each compiled block one layer)."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import Counting, LitModel, ResumableLoader, Stack, loader, make_data, trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_slsam import SAM, SparseLayerSAM, make_callback

#: Eager SL-SAM with each block drawn as one layer: what compiled SL-SAM must equal.
BLOCKS = [r"^(net\.blocks\.\d+)\."]
#: The registry's methods that draw a different set of layers each step.
SAMPLING = [
    "slsam_paper", "random_slsam", "top_slsam", "sl_s2sam", "esam", "slsam_rst", "slsam_looksam",
    "slsam_depth", "slsam", ]  # fmt: skip
#: One backend for the tests that compile blocks themselves: its graphs are traced once
#: (by the first test that needs a state) and reused by the others.
SHARED = Counting()


class PerSample(LitModel):
    """Per-sample losses (ESAM chooses samples by them; the other methods take the mean)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y, reduction="none")


class NoRecompileAfter(L.Callback):
    """From step ``warmup`` on, any recompile raises (``fail_on_recompile``), and hitting the
    recompile limit raises instead of running uncompiled."""

    def __init__(self, warmup: int, backend: Counting) -> None:
        self.warmup, self.backend = warmup, backend
        self.calls_after_warmup = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.warmup:
            torch.compiler.set_stance("fail_on_recompile")
            self.calls_after_warmup = -self.backend.calls

    def on_train_end(self, trainer, pl_module):
        torch.compiler.set_stance("default")
        self.calls_after_warmup += self.backend.calls


@pytest.fixture(autouse=True)
def _strict_recompiles():
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            yield
    finally:
        torch.compiler.set_stance("default")


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace("_orig_mod.", ""): p.detach().clone() for n, p in model.named_parameters()}


def _fit(model, callbacks, steps=12, data=None, ckpt_path=None, **kwargs):
    L.seed_everything(0)
    fit_model = model
    t = trainer(callbacks=callbacks, max_steps=steps, limit_val_batches=0, **kwargs)
    t.fit(fit_model, data or loader(make_data(192, dim=8), 16), ckpt_path=ckpt_path)
    return t


def _eager(name: str, steps: int = 12, precision: str = "32-true", **options):
    callback = make_callback(name, **options, layers=BLOCKS)
    model = PerSample(Stack())
    _fit(model, [callback], steps, precision=precision)
    return _weights(model), callback


def _compiled_blocks(name: str, precision: str = "32-true"):
    """SL-SAM-like ``name`` on a Stack whose blocks are compiled (a fresh counting backend),
    12 steps, recompiles failing from step 6: the model, callback, guard and backend."""
    torch._dynamo.reset()
    backend = Counting()
    model = PerSample(Stack())
    for block in model.net.blocks:
        block.compile(backend=backend)
    callback = make_callback(name, seed=3)
    guard = NoRecompileAfter(6, backend)
    _fit(model, [callback, guard], precision=precision)
    return model, callback, guard, backend


def _assert_equal(compiled: dict, eager: dict) -> None:
    for name, value in eager.items():
        torch.testing.assert_close(compiled[name], value, rtol=1e-5, atol=1e-5, msg=name)
    start = _weights(PerSample(Stack()))
    assert any(not torch.equal(start[name], value) for name, value in eager.items())


@pytest.mark.parametrize("form", ["trainer", "inner", "in_place"])
def test_a_model_compiled_whole_trains_sl_sam_on_its_blocks(form, caplog):
    """``trainer.fit(torch.compile(model))``, ``model.net = torch.compile(net)`` and
    ``net.compile()``: the callback runs the compiled region eagerly and compiles its blocks
    with the same backend; every step after the 6th runs without a recompile."""
    torch._dynamo.reset()
    backend = Counting()
    model = PerSample(Stack())
    fit_model = model
    if form == "trainer":
        fit_model = torch.compile(model, backend=backend)
    elif form == "inner":
        model.net = torch.compile(model.net, backend=backend)
    else:
        model.net.compile(backend=backend)
    callback = SparseLayerSAM(layer_ratio=0.4, rho=0.05, preset="paper", seed=3)
    guard = NoRecompileAfter(6, backend)
    with caplog.at_level(logging.INFO):
        _fit(fit_model, [callback, guard])
    prefix = "net._orig_mod." if form == "inner" else "net."
    assert callback.layer_names[:3] == [f"{prefix}blocks.{i}" for i in range(3)]
    assert "blocks (" in caplog.text and "are compiled instead" in caplog.text
    # Only the blocks run compiled: 3 blocks x 2 passes x 12 steps, from at most 4 graphs
    # (the block trained or frozen, times whether its input needs a gradient).
    assert backend.calls == 3 * 2 * 12 and guard.calls_after_warmup == 3 * 2 * 6
    assert 2 <= backend.graphs <= 4
    assert model._compiler_ctx is None  # Lightning's whole-model compile was handed back
    counts = callback.engine.counts[:3].tolist()
    assert all(0 < c < 12 for c in counts)  # each block both trained and frozen
    eager, eager_cb = _eager("slsam_paper", layer_ratio=0.4, rho=0.05, seed=3)
    assert eager_cb.engine.counts.tolist() == callback.engine.counts.tolist()
    _assert_equal(_weights(model), eager)


def test_a_model_compiled_whole_without_repeated_blocks_is_refused(tmp_path):
    """Nothing to compile regionally (a plain MLP): the refusal names the fix."""
    from helpers import make_mlp
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    model = PerSample(make_mlp())
    before = _weights(model)
    with pytest.raises(MisconfigurationException, match=r"Compile its repeated blocks instead"):
        _fit(torch.compile(model, backend="aot_eager"), [SparseLayerSAM()], steps=1)
    assert all(torch.equal(before[n], p) for n, p in _weights(model).items())  # untouched


@pytest.mark.parametrize("name", SAMPLING)
def test_every_layer_sampling_method_compiles_once_and_equals_eager(name):
    model, callback, guard, backend = _compiled_blocks(name)
    assert callback.layer_names[:3] == [f"net.blocks.{i}" for i in range(3)]
    # Compiled graphs ran in every step after warm-up (SL-S2-SAM and LookSAM's reuse steps
    # run one pass), from a bounded set of graphs.
    assert guard.calls_after_warmup >= 3 * 6 and backend.calls >= 3 * 12
    # The block trained or frozen, times whether its input needs a gradient; ESAM's choice
    # of samples changes the batch size, which traces the dynamic-shape variants once more.
    assert 3 <= backend.graphs <= (8 if name == "esam" else 4)
    eager, _ = _eager(name, seed=3)
    _assert_equal(_weights(model), eager)


def test_compiled_sl_sam_at_layer_ratio_one_equals_compiled_sam():
    runs = []
    for callback in (SparseLayerSAM(preset="paper", layer_ratio=1.0, rho=0.05), SAM(rho=0.05)):
        model = PerSample(Stack())
        for block in model.net.blocks:
            block.compile(backend=SHARED)
        _fit(model, [callback, NoRecompileAfter(6, SHARED)])
        runs.append(_weights(model))
    _assert_equal(*runs)


def test_resuming_compiled_sl_sam_equals_the_uninterrupted_run(tmp_path):
    data = make_data(192, dim=8)

    def run(steps, ckpt_path=None, callbacks=()):
        model = PerSample(Stack())
        for block in model.net.blocks:
            block.compile(backend=SHARED)
        callback = SparseLayerSAM(layer_ratio=0.4, seed=3)
        _fit(model, [callback, *callbacks], steps, ResumableLoader(data, batch_size=16),
             ckpt_path, enable_checkpointing=True)  # fmt: skip
        return _weights(model), callback

    full, full_cb = run(12)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=6, save_top_k=-1)
    run(6, callbacks=[saver])
    resumed, resumed_cb = run(12, str(tmp_path / "epoch=0-step=6.ckpt"),
                              [NoRecompileAfter(7, SHARED)])  # fmt: skip
    assert torch.equal(full_cb.engine.counts, resumed_cb.engine.counts)
    assert torch.equal(full_cb.probs, resumed_cb.probs)
    for name, value in full.items():
        assert torch.equal(resumed[name], value), name


def test_dense_sam_on_the_trainers_compiled_module_compiles_the_forward_once():
    """Lightning compiles ``training_step`` too; the callback runs it eagerly (the SAM step's
    logic between passes is not traced) and the model's forward stays one compiled graph."""
    torch._dynamo.reset()
    backend = Counting()
    model = PerSample(Stack())
    guard = NoRecompileAfter(4, backend)
    _fit(torch.compile(model, backend=backend), [SAM(rho=0.05), guard])
    assert backend.graphs == 1 and backend.calls == 2 * 12  # every pass of every step
    assert model._compiler_ctx is not None  # the forward is still Lightning's compiled one
    eager = PerSample(Stack())
    _fit(eager, [SAM(rho=0.05)])
    _assert_equal(_weights(model), _weights(eager))


@pytest.mark.parametrize("name", ["slsam_paper", "slsam"])
def test_compiled_blocks_in_bf16_mixed_compile_once_and_follow_eager(name):
    """Autocast traced into the blocks' graphs: each layer drawn as often as in eager
    bf16-mixed, no recompile after warm-up, and eager's weights (the backend runs eager's
    kernels)."""
    model, callback, guard, backend = _compiled_blocks(name, precision="bf16-mixed")
    assert guard.calls_after_warmup >= 3 * 6 and 3 <= backend.graphs <= 4
    eager, eager_cb = _eager(name, precision="bf16-mixed", seed=3)
    assert eager_cb.engine.counts.tolist() == callback.engine.counts.tolist()
    _assert_equal(_weights(model), eager)
