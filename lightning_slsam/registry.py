"""Every method by name: its specification class and the options the name implies.

>>> spec = method_spec("slsam", layer_ratio=0.3)
>>> type(spec).__name__, spec.layer_ratio, spec.bandit_loss
('SLSAMSpec', 0.3, 'shifted')
"""

from __future__ import annotations

import difflib
from typing import Any

from lightning_slsam.dense_specs import (
    ESAMSpec,
    LookSAMSpec,
    RSTSpec,
    S2SAMSpec,
    SAMSpec,
    SSAMFSpec,
)
from lightning_slsam.specs import MethodSpec
from lightning_slsam.subset_specs import RandomSLSAMSpec, SLS2SAMSpec, SLSAMSpec, TopSLSAMSpec

__all__ = ["SPECS", "method_spec"]

#: Method name -> (specification class or ``None`` for plain AdamW, the options the name
#: implies). The SL-SAM methods name ``preset="paper"``: comparisons and the paper's
#: recipes run the paper's SL-SAM whatever the class's default.
SPECS: dict[str, tuple[type[MethodSpec] | None, dict[str, Any]]] = {
    "adamw": (None, {}),
    "sam": (SAMSpec, {}),
    "adasam": (SAMSpec, {}),
    "slsam": (SLSAMSpec, {"preset": "paper"}),
    "random_slsam": (RandomSLSAMSpec, {}),
    "top_slsam": (TopSLSAMSpec, {}),
    "s2sam": (S2SAMSpec, {}),
    "sl_s2sam": (SLS2SAMSpec, {"preset": "paper"}),
    "rst": (RSTSpec, {}),
    "esam": (ESAMSpec, {}),
    "ssamf": (SSAMFSpec, {}),
    "looksam": (LookSAMSpec, {}),
    "slsam_rst": (SLSAMSpec, {"preset": "paper", "schedule": "random"}),
    "slsam_looksam": (SLSAMSpec, {"preset": "paper", "schedule": "interval"}),
    "slsam_depth": (SLSAMSpec, {"preset": "paper", "backprop_depth": 0.5}),
    "slsam_robust": (SLSAMSpec, {"preset": "robust"}),
}


def lookup(name: str) -> tuple[type[MethodSpec] | None, dict[str, Any]]:
    """The entry of method ``name`` (case and ``-``/``_`` insensitive), or a ValueError
    with the closest name."""
    key = name.lower().replace("-", "_")
    if key not in SPECS:
        close = difflib.get_close_matches(key, SPECS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"Unknown method {name!r}.{hint} Choose one of {sorted(SPECS)}.")
    return SPECS[key]


def method_spec(name: str, **options: Any) -> MethodSpec:
    """The validated specification of method ``name``; ``options`` override its defaults."""
    cls, implied = lookup(name)
    if cls is None:
        raise ValueError(
            f"Method {name!r} is plain AdamW: there is no SAM method to build; step the"
            " optimizer as usual."
        )
    return cls(**{**implied, **options})
