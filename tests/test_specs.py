"""Method specifications (pure PyTorch) build the same engine as the Lightning callbacks.

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
    for step in range(steps):
        xb, yb = x[16 * step : 16 * step + 16], y[16 * step : 16 * step + 16]

        def loss(index=None, xb=xb, yb=yb):
            if index is not None:
                xb, yb = xb[index], yb[index]
            return F.cross_entropy(model(xb), yb, reduction="none")

        engine.train_step(loss, opt, batch_size=16)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", NAMES)
def test_the_spec_builds_the_engine_the_callback_builds(name):
    options = {"seed": 3, "dense_warmup": 2} if name == "slsam_robust" else {"seed": 3}
    torch.manual_seed(0)
    a = _PerSample()
    via_callback = make_callback(name, **options).build_engine(a, total_steps=6)
    torch.manual_seed(0)
    b = _PerSample()
    via_spec = make_engine(name, b, total_steps=6, **options)
    wa, wb = _train(via_callback, a), _train(via_spec, b)
    assert all(torch.equal(wa[n], wb[n]) for n in wa), name
    assert torch.equal(via_callback.selection.probs, via_spec.selection.probs)
    assert torch.equal(via_callback.counts, via_spec.counts)
    assert via_callback.kind_counts == via_spec.kind_counts


def test_every_method_name_has_a_spec():
    assert set(SPECS) == set(METHODS)


def test_spec_options_are_checked_where_built():
    with pytest.raises(ValueError, match=r"`layer_ratio` must be in \(0, 1\], got 1.5"):
        method_spec("random_slsam", layer_ratio=1.5)
    with pytest.raises(ValueError, match="LookSAM fixes schedule='interval'"):
        method_spec("looksam", schedule="random")
    with pytest.raises(TypeError):
        method_spec("looksam", sam_interval=2)  # LookSAM's option is `interval`
    assert method_spec("looksam", interval=2).sam_interval == 2
    assert method_spec("rst", probability=0.25).sam_probability == 0.25
    assert method_spec("slsam_robust").bandit_loss == "rank"
    with pytest.raises(ValueError, match="Did you mean 'slsam'"):
        method_spec("slsamm")


def test_a_method_that_renames_a_common_option_names_its_own():
    from lightning_slsam import RST, LookSAM

    with pytest.raises(
        TypeError, match=r"^LookSAM has no option 'sam_interval'; did you mean 'interval'"
    ):
        LookSAM(sam_interval=2)
    with pytest.raises(TypeError, match=r"^RST has no option 'sam_probability'; did you mean"):
        RST(sam_probability=0.2)
    assert (LookSAM(interval=2).sam_interval, RST(probability=0.25).sam_probability) == (2, 0.25)
