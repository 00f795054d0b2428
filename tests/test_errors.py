"""Bad input fails at construction or setup with a message naming the fix, losing nothing."""

from __future__ import annotations

import inspect
import re

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import LitModel, loader, make_data, make_mlp, trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_slsam import METHODS, RST, SparseLayerSAM


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rho": 0.0}, "`rho`"),
        ({"rho": -0.1}, "`rho`"),
        ({"rho": float("nan")}, "`rho`"),
        ({"layer_ratio": 0.0}, "layer_ratio"),
        ({"layer_ratio": 1.5}, "layer_ratio"),
        ({"p_min": 0.0}, "p_min"),
        ({"p_min": 1.0}, "p_min"),
        # p_min * N > s = layer_ratio * N for every N: refused before any model is seen.
        ({"p_min": 0.5, "layer_ratio": 0.2}, r"`p_min` must be at most layer_ratio=0.2"),
        ({"perturbation_norm": "tensor"}, "perturbation_norm"),
        ({"gradient_clip_val": -1.0}, "gradient_clip_val"),
        ({"gradient_clip_algorithm": "l2"}, "gradient_clip_algorithm"),
        ({"accumulate_grad_batches": 0}, "accumulate_grad_batches"),
        ({"layers": "blocks"}, "`layers`"),
        ({"seed": "a"}, "`seed`"),
    ],
)
def test_constructor_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseLayerSAM(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"alpha_p": -1.0}, "alpha_p"), ({"bandit_loss": "kl"}, "bandit_loss")]
)
def test_ablation_constructor_rejects(kwargs, match):
    # The bandit's settings are SparseLayerSAM's preset's; examples' SLSAMAblation sets each.
    from examples.methods import SLSAMAblation

    with pytest.raises(ValueError, match=match):
        SLSAMAblation(**kwargs)


#: Every method class (those METHODS names).
ALL_METHODS = sorted(
    {cls for cls, _ in METHODS.values() if cls is not None}, key=lambda cls: cls.__name__
)
#: ``Class: `option` must be <what is allowed>, got <value>.`` (optionally ``: <hint>``).
BAD_VALUE = r"^{cls}: `{option}` must be [^`]+, got {value}(: .+)?\.$"
#: ``Class has no option 'option'; <its name here, where it belongs, or the valid names>``.
UNKNOWN = r"^{cls} has no option '{option}'; .+[.?]$"


@pytest.mark.parametrize("cls", ALL_METHODS, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize(
    ("option", "value"),
    [("layer_ratio", 1.5), ("rho", -1), ("accumulate_grad_batches", 0), ("layer_ration", 0.2)],
)
def test_every_method_words_a_bad_option_the_same_way(cls, option, value):
    # One format for every method and option, from the callback and from the spec alike:
    # the class the user wrote, the option, the value and what is allowed.
    name = cls.__name__
    takes = option in inspect.signature(cls).parameters
    error, pattern = (ValueError, BAD_VALUE) if takes else (TypeError, UNKNOWN)
    expected = pattern.format(cls=name, option=option, value=re.escape(repr(value)))
    with pytest.raises(error) as raised:
        cls(**{option: value})
    assert re.match(expected, str(raised.value)), str(raised.value)
    if option in cls.spec_class.option_names() or not takes:
        with pytest.raises(error) as raised:
            cls.spec_class(**{option: value})  # the spec's message is the callback's
        assert re.match(expected, str(raised.value)), str(raised.value)


def test_a_subclass_is_named_in_its_messages():
    class MyRST(RST):
        pass

    with pytest.raises(ValueError, match=r"^MyRST: `probability` must be in \[0, 1\], got 2\.$"):
        MyRST(probability=2)
    with pytest.raises(ValueError, match=r"^MyRST: `plot` must be True or False, got 1\.$"):
        MyRST(plot=1)
    with pytest.raises(TypeError, match=r"^MyRST has no option 'probabilty'; did you mean"):
        MyRST(probabilty=0.2)


def _fit_fails(model, cb, match, **trainer_kwargs):
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(MisconfigurationException, match=match):
        trainer(callbacks=[cb], max_steps=2, **trainer_kwargs).fit(model, loader(make_data(32), 16))
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), f"{name} changed by a failed setup"


def test_callback_without_mixin():
    class Plain(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    _fit_fails(Plain(), SparseLayerSAM(), r"inherit SAMMixin.*class Plain\(SAMMixin")


def test_trainer_gradient_clip_and_accumulation_point_to_the_plugin_options():
    _fit_fails(
        LitModel(make_mlp()),
        SparseLayerSAM(),
        r"SparseLayerSAM\(gradient_clip_val=0.5",
        gradient_clip_val=0.5,
    )
    _fit_fails(
        LitModel(make_mlp()),
        SparseLayerSAM(),
        r"SparseLayerSAM\(accumulate_grad_batches=2\)",
        accumulate_grad_batches=2,
    )


def test_the_options_advice_names_the_callback_in_use():
    from lightning_slsam import SAM

    _fit_fails(LitModel(make_mlp()), SAM(), r"Set `SAM\(gradient_clip_val=0.5",
               gradient_clip_val=0.5)  # fmt: skip


def test_esam_without_per_sample_losses_is_refused_before_any_backward():
    # The first pass's loss shape is checked as soon as training_step returns: no
    # gradient, no weight, no optimizer state has changed.
    from lightning_slsam import ESAM

    model = LitModel(make_mlp())  # returns the batch's mean loss
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    t = trainer(callbacks=[ESAM()], max_steps=2)
    with pytest.raises(
        MisconfigurationException, match=r"needs per-sample losses.*reduction='none'"
    ):
        t.fit(model, loader(make_data()))
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
        assert param.grad is None, name
    assert not t.optimizers[0].state
    assert t.global_step == 0


def test_no_trainable_parameters():
    model = LitModel(make_mlp())
    model.requires_grad_(False)

    class Opt(LitModel):
        def configure_optimizers(self):
            return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    model = Opt(make_mlp())
    model.net.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        trainer(callbacks=[SparseLayerSAM()], max_steps=1).fit(model, loader(make_data(16), 16))


def test_two_optimizers_refused():
    class Two(LitModel):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                    torch.optim.SGD(self.net[3].parameters(), lr=0.1)]  # fmt: skip

    _fit_fails(Two(make_mlp()), SparseLayerSAM(), "one optimizer")


def test_training_step_without_loss():
    class NoLoss(LitModel):
        def training_step(self, batch, batch_idx):
            super().training_step(batch, batch_idx)
            return None

    with pytest.raises(MisconfigurationException, match="must return the loss"):
        trainer(callbacks=[SparseLayerSAM()], max_steps=1).fit(
            NoLoss(make_mlp()), loader(make_data(16), 16)
        )


def test_setting_automatic_optimization_is_refused():
    class Manual(LitModel):
        def __init__(self):
            super().__init__(make_mlp())
            self.automatic_optimization = False

    with pytest.raises(AttributeError, match="chooses the optimization mode itself"):
        Manual()


def test_non_finite_loss_in_training_skips_with_warning():
    class Spiky(LitModel):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if batch_idx == 1 else loss

    model = Spiky(make_mlp())
    cb = SparseLayerSAM(layer_ratio=0.5)
    snapshots = []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            snapshots.append(
                (
                    [p.detach().clone() for p in pl_module.parameters()],
                    cb.probs.clone(),
                    {
                        k: v.clone()
                        for k, v in trainer.optimizers[0]
                        .state[next(iter(pl_module.parameters()))]
                        .items()
                    }
                    if trainer.optimizers[0].state
                    else {},
                )
            )

    with pytest.warns(RuntimeWarning, match="skipped step 1"):
        t = trainer(callbacks=[cb, Watch()], max_steps=3)
        t.fit(model, loader(make_data(48), 16))
    assert t.global_step == 3  # a skipped step still counts, as under automatic AMP
    assert cb.engine.num_skipped == 1
    (w0, p0, _), (w1, p1, _) = snapshots[0], snapshots[1]
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert torch.equal(p0, p1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_sharded_strategies_are_refused_with_what_works():
    from types import SimpleNamespace

    class FSDPStrategy:  # stands in for any non-DDP multi-process strategy
        pass

    stub = SimpleNamespace(world_size=2, strategy=FSDPStrategy(), callbacks=[], precision="32-true")
    with pytest.raises(MisconfigurationException, match=r"does not support FSDPStrategy.*'ddp'"):
        SparseLayerSAM().setup(stub, LitModel(make_mlp()), "fit")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_is_refused_naming_the_stage_and_fsdp2(stage):
    # Lightning runs DeepSpeedStrategy on CUDA only; the callback's setup is called as
    # Lightning would, with a stand-in holding the strategy's config.
    from types import SimpleNamespace

    class DeepSpeedStrategy:
        config = {"zero_optimization": {"stage": stage}}

    stub = SimpleNamespace(world_size=2, strategy=DeepSpeedStrategy(), callbacks=[])
    with pytest.raises(MisconfigurationException, match=rf"ZeRO stage {stage}\).*ModelParallel"):
        SparseLayerSAM().setup(stub, LitModel(make_mlp()), "fit")
