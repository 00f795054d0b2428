"""The option checks (:mod:`lightning_slsam.methods.options`): an option a method does not
take is refused naming the class the user wrote and the closest valid option."""

from __future__ import annotations

import pytest
import torch

from lightning_slsam import METHODS, make_engine
from lightning_slsam.methods.options import number, unknown_option
from lightning_slsam.methods.registry import SPECS, method_spec


@pytest.mark.parametrize("method", sorted(m for m in METHODS if m != "adamw"))
def test_each_callback_refuses_an_unknown_option_naming_its_class(method):
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
