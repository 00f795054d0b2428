"""The option checks (:mod:`lightning_slsam.methods.options`): an option of an earlier version
that no method takes any more is refused with what replaced it (:data:`RETIRED`), naming
the class the user wrote."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_slsam import METHODS, SAM, SparseLayerSAM, make_engine
from lightning_slsam.methods.options import RETIRED, number, unknown_option
from lightning_slsam.methods.registry import SPECS, method_spec
from lightning_slsam.methods.spec import option_hint

SPEC_CLASSES = sorted({cls for cls, _ in SPECS.values() if cls is not None}, key=lambda c: c.name)


def test_a_retired_option_names_the_class_and_what_replaced_it():
    with pytest.raises(TypeError, match=r"^SparseLayerSAM has no option 'dense_warmup'; retired"
                       r" in 0\.3"):  # fmt: skip
        SparseLayerSAM(dense_warmup=2)
    with pytest.raises(TypeError, match=r"^SAM has no option 'adaptive_eta'; retired in 0\.3:"
                       r" ASAM's eta is its reference value, 0\.01\.$"):  # fmt: skip
        SAM(adaptive=True, adaptive_eta=0.0)
    with pytest.raises(TypeError, match=r"^SparseLayerSAM has no option 'bandit_loss'; decided"
                       r" by `preset`"):  # fmt: skip
        SparseLayerSAM(bandit_loss="paper")
    with pytest.raises(TypeError, match=r"^SparseLayerSAM has no option 'vectors_always_active';"
                       r" retired in 0\.3.*`always_active`"):  # fmt: skip
        SparseLayerSAM(vectors_always_active=True)


@pytest.mark.parametrize("name", sorted(RETIRED))
def test_every_spec_refuses_each_retired_option_with_its_hint(name):
    refused = 0
    for cls in SPEC_CLASSES:
        if name in cls.option_names():
            continue  # the ablation's settings, say
        hint = cls.renamed.get(name)
        expected = f"did you mean {hint!r}?" if hint else RETIRED[name]
        message = f"{cls.label} has no option {name!r}; {expected}"
        with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
            cls(**{name: 1})
        assert option_hint(cls, name) == expected
        refused += 1
    assert refused >= len(SPEC_CLASSES) - 2


@pytest.mark.parametrize("method", sorted(m for m in METHODS if m != "adamw"))
def test_each_callback_refuses_a_retired_option_naming_its_class(method):
    callback = METHODS[method][0]
    with pytest.raises(TypeError, match=rf"^{callback.__name__} has no option 'min_updates'; "):
        callback(min_updates=10)
    with pytest.raises(TypeError, match=rf"^{SPECS[method][0].label} has no option 'min_updates'"):
        method_spec(method, min_updates=10)


def test_the_run_length_is_no_option_any_more():
    # total_steps only served the retired warm-up and floor.
    with pytest.raises(TypeError, match=r"^SAM has no option 'total_steps'"):
        make_engine("sam", torch.nn.Linear(4, 2), total_steps=6)
    with pytest.raises(TypeError, match="total_steps"):
        method_spec("slsam").build_engine(torch.nn.Linear(4, 2), total_steps=6)


def test_an_unknown_option_suggests_the_closest_name_or_lists_them():
    assert str(unknown_option("SAM", "rhoo", ["rho", "seed"])) == (
        "SAM has no option 'rhoo'; did you mean 'rho'?"
    )
    assert str(unknown_option("SAM", "zzz", ["seed", "rho"])) == (
        "SAM has no option 'zzz'; valid options: rho, seed."
    )
    with pytest.raises(ValueError, match=r"^X: `k` must be an integer >= 1, got 0\.$"):
        number(1, integer=True)("k", 0, owner="X")
