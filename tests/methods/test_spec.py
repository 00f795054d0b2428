"""Method specifications (:mod:`lightning_slsam.methods.spec`, pure PyTorch) build the same
engine as the Lightning callbacks, and each method takes its own options only.

When the specifications were added (49ab4d2), the callbacks still built their engines
with their own code: this test showed the two equal, step for step, for every method.
The callbacks now build through the specifications; the test keeps ``make_callback`` and
``make_engine`` in step (the names, the implied options, the seeds).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp

from lightning_slsam import METHODS, make_callback, make_engine
from lightning_slsam.methods.registry import SPECS, method_spec
from lightning_slsam.methods.rst import Coin

NAMES = sorted(name for name in METHODS if name != "adamw")


class _PerSample(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_mlp(seed=0)

    def forward(self, x):
        return self.net(x)


def _train(engine, model, steps=6):
    data = make_data(96)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = data.tensors
    engine.planned_steps = steps  # ARWP's noise grows over the run
    for step in range(steps):
        xb, yb = x[16 * step : 16 * step + 16], y[16 * step : 16 * step + 16]

        def loss(index=None, xb=xb, yb=yb, step=step):
            samples = torch.arange(16 * step, 16 * step + 16)  # SAF's indices
            if index is not None:
                xb, yb, samples = xb[index], yb[index], samples[index]
            logits = model(xb)  # MESA and SAF read them
            losses = F.cross_entropy(logits, yb, reduction="none")
            return {"loss": losses, "logits": logits, "index": samples}

        engine.train_step(loss, opt, batch_size=16)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", NAMES)
def test_the_spec_builds_the_engine_the_callback_builds(name):
    options = {"seed": 3}
    torch.manual_seed(0)
    a = _PerSample()
    via_callback = make_callback(name, **options).spec.build_engine(a)
    torch.manual_seed(0)
    b = _PerSample()
    via_spec = make_engine(name, b, **options)
    wa, wb = _train(via_callback, a), _train(via_spec, b)
    assert all(torch.equal(wa[n], wb[n]) for n in wa), name
    assert torch.equal(via_callback.selection.probs, via_spec.selection.probs)
    assert torch.equal(via_callback.counts, via_spec.counts)
    assert via_callback.kind_counts == via_spec.kind_counts


def test_every_method_name_has_a_spec():
    assert set(SPECS) == set(METHODS)


def test_spec_options_are_checked_where_built():
    with pytest.raises(
        ValueError, match=r"^RandomSLSAM: `layer_ratio` must be in \(0, 1\], got 1.5\.$"
    ):
        method_spec("random_slsam", layer_ratio=1.5)
    assert method_spec("looksam", interval=2).interval == 2
    assert method_spec("rst", probability=0.25).probability == 0.25
    with pytest.raises(ValueError, match="Did you mean 'slsam'"):
        method_spec("slsamm")


#: The options each method takes beyond the common ones (MethodSpec's and the Lightning
#: shell's): no step schedule anywhere (RST, LookSAM and SL-SAM's combinations name their
#: own), the preset settings alone nowhere (examples.methods.SLSAMAblation has them).
OWN_OPTIONS = {
    "SAM": set(),
    "S2SAM": set(),
    "MomentumSAM": set(),
    "RST": {"probability"},
    "LookSAM": {"interval", "alpha"},
    "ESAM": {"weight_ratio", "data_ratio"},
    "SSAMF": {"sparsity", "fisher_samples", "mask_interval"},
    "TopSLSAM": {"layer_ratio"},
    "RandomSLSAM": {"layer_ratio", "preset"},
    "SLS2SAM": {"layer_ratio", "p_min", "preset"},
    "ARWP": {"growth", "eta", "beta"},
    "MESA": {"weight", "tau", "start", "decay"},
    "SAF": {"weight", "tau", "delay", "start_epoch"},
}  # fmt: skip
OWN_OPTIONS["SparseLayerSAM"] = OWN_OPTIONS["SLS2SAM"]
OWN_OPTIONS["SLSAMRST"] = OWN_OPTIONS["SparseLayerSAM"] | {"probability"}
OWN_OPTIONS["SLSAMLookSAM"] = OWN_OPTIONS["SparseLayerSAM"] | {"interval", "alpha"}
OWN_OPTIONS["CostAwareSLSAM"] = OWN_OPTIONS["SparseLayerSAM"] | {"depth"}


def test_each_method_takes_its_own_options_only():
    import inspect

    from lightning_slsam import SAM
    from lightning_slsam.lightning import callbacks

    common = set(inspect.signature(SAM).parameters)
    assert "schedule" not in common and "sam_probability" not in common
    helpers = {"METHODS", "callback_for", "class_path", "make_callback", "make_callbacks",
               "register_callback"}  # fmt: skip
    assert set(OWN_OPTIONS) == set(callbacks.__all__) - helpers
    for name, own in OWN_OPTIONS.items():
        cls = getattr(callbacks, name)
        assert set(inspect.signature(cls).parameters) == common | own, name
        spec = cls.spec_class
        assert set(spec.option_names()) == common - {"gradient_clip_val",
            "gradient_clip_algorithm", "accumulate_grad_batches", "plot"} | own  # fmt: skip


def test_sl_sam_on_the_schedules_of_other_methods_is_their_combination():
    assert type(method_spec("slsam_rst").parts(torch.Generator())) is Coin
    assert method_spec("slsam_looksam", interval=3).interval == 3


@pytest.mark.parametrize("name", ["sam", "slsam", "momentum_sam", "arwp"])
def test_a_spec_is_only_its_options_and_each_engine_owns_what_it_builds(name):
    import dataclasses

    spec = method_spec(name, rho=0.05)
    before = dict(vars(spec))
    first, second = (spec.build_engine(make_mlp(), seed=0) for _ in range(2))
    # Building engines leaves the spec as it was: nothing written back (layer sizes, say).
    assert vars(spec) == before
    # Each engine has its own perturbation (its backup pool holds that engine's weights).
    assert first.perturbation is not second.perturbation
    assert first.perturbation.pool is not second.perturbation.pool
    if name == "arwp":  # the drawn noise is the move: the perturbation scales nothing
        assert first.perturbation.norm == "none"
    else:
        assert abs(first.perturbation.rho) == 0.05  # Momentum-SAM moves against the momentum
    # Once checked, the options are fixed: a changed copy is another spec, checked again.
    with pytest.raises(AttributeError, match=r"fixed once checked.*dataclasses\.replace"):
        spec.rho = 0.1
    assert spec.rho == 0.05
    assert dataclasses.replace(spec, rho=0.1).rho == 0.1
    with pytest.raises(ValueError, match="`rho`"):
        dataclasses.replace(spec, rho=-1.0)


def test_the_compute_budget_reads_the_layer_sizes_from_the_partition():
    from lightning_slsam.core.partition import build_partition

    spec = method_spec("slsam", layer_ratio=0.5)  # the default preset budgets parameters
    layers = build_partition(make_mlp())
    bandit = spec.selection(layers, torch.Generator().manual_seed(0))
    assert bandit.costs.tolist() == [float(n) for n in layers.numel]
    count = method_spec("slsam_paper", layer_ratio=0.5)
    assert count.selection(layers, torch.Generator().manual_seed(0)).costs is None


@pytest.mark.parametrize("name", ["arwp", "momentum_sam", "mesa", "saf"])
def test_a_method_with_its_own_move_refuses_the_options_that_shape_the_ascent(name):
    cls = type(method_spec(name))
    assert cls.own_move is not None
    shaping = {"adaptive": True, "perturbation_norm": "layer"}
    if not cls.sized_by_rho:
        shaping["rho"] = 0.05
    for option, value in shaping.items():
        with pytest.raises(ValueError, match=f"{cls.label}: .*`{option}`.* shape SAM's ascent"):
            method_spec(name, **{option: value})
    if cls.sized_by_rho:
        assert method_spec(name, rho=0.05).rho == 0.05  # its size
