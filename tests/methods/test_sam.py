"""The dense methods' specifications (:mod:`lightning_slsam.methods.dense`): their defaults."""

from __future__ import annotations

import pytest

from lightning_slsam import SAM, SparseLayerSAM


def test_asam_radius_and_eta_defaults():
    assert SAM().rho == 0.01 and SparseLayerSAM().rho == 0.01
    assert SAM(adaptive=True).rho == 0.5  # ASAM's reference radius
    assert SparseLayerSAM(adaptive=True).rho == 0.5
    assert SAM(rho=0.2, adaptive=True).rho == 0.2
    assert SAM(adaptive=True).perturbation.eta == 0.01
    assert SAM(adaptive=True, adaptive_eta=0.0).perturbation.eta == 0.0
    with pytest.raises(ValueError, match="adaptive_eta"):
        SAM(adaptive=True, adaptive_eta=-1.0)
