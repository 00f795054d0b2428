"""The checks a SAM callback makes at setup (:mod:`lightning_slsam.lightning.setup_checks`):
each refusal names the problem and the fix before any step."""

from __future__ import annotations

import copy
import re
import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers import LitModel, Snapshots, loader, make_data, make_mlp, trainer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_slsam import SAM, SparseLayerSAM, make_engine
from lightning_slsam.core.state import CheckpointMismatch, check_saved_layers
from lightning_slsam.lightning.setup_checks import (
    LIGHTNING_OPTIONS,
    FitWarnings,
    check_engine,
    check_fit_setup,
    check_lightning_options,
    check_one_optimizer,
)


def test_compiled_model_works_with_dense_sam_and_is_refused_for_layer_sampling():
    net = make_mlp()
    runs = []
    for compiled in (True, False):
        L.seed_everything(0)
        model = LitModel(copy.deepcopy(net))
        if compiled:
            model.net = torch.compile(model.net)
        snaps = Snapshots()
        trainer(callbacks=[SAM(rho=0.05), snaps], max_steps=3).fit(model, loader(make_data(48), 16))
        runs.append({k.replace("_orig_mod.", ""): v for k, v in snaps.after[-1].items()})
    # Inductor's fused kernels round otherwise, and AdamW's 3 steps carry it (measured 1.2e-7).
    for name, value in runs[1].items():
        torch.testing.assert_close(runs[0][name], value, rtol=0, atol=1e-5)

    model = LitModel(make_mlp())
    model.net = torch.compile(model.net)
    with pytest.raises(MisconfigurationException, match=r"torch\.compile guards on requires_grad"):
        trainer(callbacks=[SparseLayerSAM()], max_steps=1).fit(model, loader(make_data(16), 16))


# -- the checks, directly -----------------------------------------------------------------------


def _trainer(strategy, world_size: int = 1, callbacks=()) -> SimpleNamespace:
    """What the checks read of a Trainer: its strategy, world size and callbacks."""
    return SimpleNamespace(strategy=strategy, world_size=world_size, callbacks=list(callbacks))


def _named(name: str, **attributes):
    """A strategy whose class is called ``name`` (the checks go by class names)."""
    return type(name, (), attributes)()


def test_the_lightning_options_are_checked_naming_each():
    assert check_lightning_options(None, "norm", 1, True) == {
        "gradient_clip_val": None, "gradient_clip_algorithm": "norm",
        "accumulate_grad_batches": 1, "plot": True,
    }  # fmt: skip
    assert check_lightning_options(0.5, "value", 4, False)["accumulate_grad_batches"] == 4
    assert set(LIGHTNING_OPTIONS) == {"gradient_clip_val", "gradient_clip_algorithm",
                                      "accumulate_grad_batches", "plot"}  # fmt: skip
    for args, name in [((-1.0, "norm", 1, True), "gradient_clip_val"),
                       (("big", "norm", 1, True), "gradient_clip_val"),
                       ((None, "max", 1, True), "gradient_clip_algorithm"),
                       ((None, "norm", 0, True), "accumulate_grad_batches"),
                       ((None, "norm", 1, "yes"), "plot")]:  # fmt: skip
        with pytest.raises(ValueError, match=name):
            check_lightning_options(*args)


def test_fit_setup_needs_the_mixin_one_sam_callback_and_whole_tensors():
    cb, model = SAM(), LitModel(make_mlp())
    one = SingleDeviceStrategy(device=torch.device("cpu"))
    check_fit_setup(cb, _trainer(one, callbacks=[cb]), model)  # nothing to say
    check_fit_setup(cb, _trainer(DDPStrategy(), 2, [cb]), model)
    check_fit_setup(cb, _trainer(type("MyDDP", (DDPStrategy,), {})(), 2, [cb]), model)
    plain = type("Plain", (L.LightningModule,), {})()
    mixin = r"SAM needs the LightningModule to inherit SAMMixin, but Plain does not"
    with pytest.raises(MisconfigurationException, match=mixin + r".*class Plain\(SAMMixin"):
        check_fit_setup(cb, _trainer(one, callbacks=[cb]), plain)
    two = _trainer(one, callbacks=[cb, SparseLayerSAM()])
    attached = (
        "2 SAM callbacks are attached to the Trainer (SAM, SparseLayerSAM); keep exactly one."
    )
    with pytest.raises(MisconfigurationException, match=re.escape(attached)):
        check_fit_setup(cb, two, model)
    with pytest.raises(
        MisconfigurationException, match="SAM does not support SingleDeviceStrategy"
    ):
        check_fit_setup(cb, _trainer(one, 2, [cb]), model)  # several processes, not DDP
    for name in ("FSDPStrategy", "XLAStrategy"):  # refused on one device too
        with pytest.raises(MisconfigurationException, match=f"SAM does not support {name}"):
            check_fit_setup(cb, _trainer(_named(name), 1, [cb]), model)
    deepspeed = _named("DeepSpeedStrategy", config={"zero_optimization": {"stage": 2}})
    with pytest.raises(MisconfigurationException, match=r"DeepSpeedStrategy \(ZeRO stage 2\)"):
        check_fit_setup(cb, _trainer(deepspeed, 1, [cb]), model)
    check_fit_setup(cb, _trainer(_named("ModelParallelStrategy"), 2, [cb]), model)  # FSDP2


def test_one_optimizer_and_what_the_engine_needs():
    cb = SparseLayerSAM()
    check_one_optimizer(cb, SimpleNamespace(optimizers=[object()]))
    with pytest.raises(MisconfigurationException, match="SparseLayerSAM steps one optimizer, but"
                       " configure_optimizers returned 2"):  # fmt: skip
        check_one_optimizer(cb, SimpleNamespace(optimizers=[object(), object()]))
    model = LitModel(make_mlp())
    sparse, dense = make_engine("slsam", model.net, seed=0), make_engine("sam", model.net)
    single = _trainer(SingleDeviceStrategy(device=torch.device("cpu")))
    check_engine(cb, single, model, sparse)
    # ModelParallelStrategy on two processes with nothing sharded: every process alone.
    with pytest.raises(MisconfigurationException, match="needs the model sharded with FSDP2"):
        check_engine(cb, _trainer(_named("ModelParallelStrategy"), 2), model, sparse)
    model.net = torch.compile(model.net)  # compiled lazily: nothing runs here
    check_engine(SAM(), single, model, dense)  # every layer every step: compiles once
    # The engine was built before compiling: the compiled net's tensors are drawn apart.
    with pytest.raises(MisconfigurationException, match=r"compiled module\(s\) \['net'\] as sep"):
        check_engine(cb, single, model, sparse)


def test_a_checkpoint_of_other_layers_is_refused_naming_the_difference():
    owner, preset = "SparseLayerSAM", SparseLayerSAM().preset
    current = [["a.weight"], ["a.bias"], ["b.weight"]]
    check_saved_layers(owner, None, current)  # a checkpoint from before layers were saved
    check_saved_layers(owner, current, current)

    def refused(saved, saved_preset=None) -> str:
        with pytest.raises(CheckpointMismatch) as error:
            check_saved_layers(owner, saved, current, preset=preset, saved_preset=saved_preset)
        return str(error.value)

    message = refused([["a.weight"], ["c.weight"]])
    assert message.startswith(
        "The checkpoint's SparseLayerSAM state does not match this model's"
        " layers: checkpoint has 2 layers, model has 3; missing from the"
        " model: ['c.weight']; new in the model: ['a.bias', 'b.weight']."
    )
    assert "resuming without it" in message and "preset" not in message
    regrouped = refused([["a.weight", "a.bias"], ["b.weight"]])
    assert "checkpoint has 2 layers, model has 3; the same tensors are grouped into layers" \
           " differently." in regrouped  # fmt: skip
    many = refused([[f"old.{i}"] for i in range(7)])
    assert "missing from the model: ['old.0', 'old.1', 'old.2', 'old.3', 'old.4'] ..." in many
    hint = refused([["a.weight"]], saved_preset="paper")
    assert (
        "The checkpoint was trained with preset='paper' and this callback has preset='default'"
    ) in hint and "SparseLayerSAM(preset='paper')" in hint
    assert "trained with preset" not in refused([["a.weight"]], saved_preset="default")


def test_fit_warnings_are_silenced_between_add_and_remove_only():
    silenced = FitWarnings()
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        silenced.add()
        silenced.add()  # twice: still one filter each
        assert len(warnings.filters) == len(before) + 2
        warnings.warn(
            "Using ModelCheckpoint with manual optimization: a", UserWarning, stacklevel=1
        )
        warnings.warn(
            "The lr scheduler dict contains the key(s) ['monitor']", RuntimeWarning, stacklevel=1
        )
        warnings.warn(
            "Using ModelCheckpoint with manual optimization: b", RuntimeWarning, stacklevel=1
        )
        silenced.remove()
        warnings.warn(
            "Using ModelCheckpoint with manual optimization: c", UserWarning, stacklevel=1
        )
    assert [str(w.message)[-1] for w in caught] == ["b", "c"]  # other categories, and after
    assert warnings.filters == before


def test_a_key_value_cache_on_compiled_blocks_is_warned_about_with_the_fix():
    from types import SimpleNamespace

    from helpers import Stack

    from lightning_slsam.lightning.setup_checks import prepare_compiled

    for use_cache, compiled in ((True, True), (False, True), (True, False)):
        model = LitModel(Stack())
        model.net.config = SimpleNamespace(use_cache=use_cache)  # a transformers config
        if compiled:
            for block in model.net.blocks:
                block.compile(backend="aot_eager")
        warnings: list[str] = []
        prepare_compiled("SparseLayerSAM", model, True, lambda _: None, warnings.append)
        if use_cache and compiled:
            assert len(warnings) == 1 and "`net.config.use_cache` is True" in warnings[0]
            assert "set `model.config.use_cache = False`" in warnings[0]
        else:
            assert warnings == []


def test_mixin_listed_after_lightning_module_is_refused_at_setup_naming_the_fix():
    """`class M(L.LightningModule, SAMMixin)` would pass setup and fail in the first step
    with Lightning's "disable automatic optimization": it is refused at setup instead, with
    the weights untouched, and the same module with the mixin first trains."""
    from lightning_slsam import SAMMixin

    class Body:
        def __init__(self):
            super().__init__()
            self.net = make_mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Second(Body, L.LightningModule, SAMMixin):
        pass

    class Existing(Body, L.LightningModule):
        pass

    class First(Body, SAMMixin, L.LightningModule):
        pass

    model = Second()
    before = [p.detach().clone() for p in model.parameters()]
    fix = (
        r"Second\(Body, LightningModule, SAMMixin\) lists SAMMixin after LightningModule"
        r".*Put SAMMixin first: `class Second\(SAMMixin, L.LightningModule\)`"
    )
    with pytest.raises(MisconfigurationException, match=fix):
        trainer(callbacks=[SparseLayerSAM()], max_epochs=1).fit(model, loader(make_data(32), 16))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # Listed first, the mixin also runs the steps its subclass inherits from a base listed
    # after it (the step used to run unwrapped: no optimizer step, global_step stayed 0).
    for model in (First(), type("OnExisting", (SAMMixin, Existing), {})()):
        sam = SparseLayerSAM()
        trainer(callbacks=[sam], max_epochs=1).fit(model, loader(make_data(32), 16))
        assert model.trainer.global_step == 2 and sam.engine.num_steps == 2
