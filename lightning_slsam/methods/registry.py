"""Every method by name: its specification class and the options the name implies.

``"slsam"`` is ``SparseLayerSAM()``, ``"slsam_paper"`` the SL-SAM paper's exact method.

>>> spec = method_spec("slsam", layer_ratio=0.3)
>>> type(spec).__name__, spec.layer_ratio, spec.preset
('SLSAMSpec', 0.3, 'default')
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

from lightning_slsam.methods.arwp import ARWPSpec
from lightning_slsam.methods.esam import ESAMSpec
from lightning_slsam.methods.looksam import LookSAMSpec
from lightning_slsam.methods.mesa import MESASpec
from lightning_slsam.methods.momentum_sam import MomentumSAMSpec
from lightning_slsam.methods.random_slsam import RandomSLSAMSpec
from lightning_slsam.methods.rst import RSTSpec
from lightning_slsam.methods.s2sam import S2SAMSpec
from lightning_slsam.methods.saf import SAFSpec
from lightning_slsam.methods.sl_s2sam import SLS2SAMSpec
from lightning_slsam.methods.slsam import SLSAMSpec
from lightning_slsam.methods.slsam_depth import CostAwareSLSAMSpec
from lightning_slsam.methods.slsam_looksam import SLSAMLookSAMSpec
from lightning_slsam.methods.slsam_rst import SLSAMRSTSpec
from lightning_slsam.methods.spec import MethodSpec
from lightning_slsam.methods.ssamf import SSAMFSpec
from lightning_slsam.methods.top_slsam import TopSLSAMSpec

if TYPE_CHECKING:
    import torch

    from lightning_slsam.core.engine import SAMEngine

__all__ = [
    "SPECS",
    "lookup",
    "make_engine",
    "method_spec",
    "register_method",
    "spec_from",
]

#: Method name -> (specification class or ``None`` for plain AdamW, the options the name implies).
SPECS: dict[str, tuple[type[MethodSpec] | None, dict[str, Any]]] = {
    "adamw": (None, {}),
    "sam": (MethodSpec, {}),
    "slsam": (SLSAMSpec, {}),
    "slsam_paper": (SLSAMSpec, {"preset": "paper"}),
    "random_slsam": (RandomSLSAMSpec, {}),
    "top_slsam": (TopSLSAMSpec, {}),
    "s2sam": (S2SAMSpec, {}),
    "sl_s2sam": (SLS2SAMSpec, {}),
    "rst": (RSTSpec, {}),
    "esam": (ESAMSpec, {}),
    "ssamf": (SSAMFSpec, {}),
    "looksam": (LookSAMSpec, {}),
    "slsam_rst": (SLSAMRSTSpec, {}),
    "slsam_looksam": (SLSAMLookSAMSpec, {}),
    "slsam_depth": (CostAwareSLSAMSpec, {}),
    "momentum_sam": (MomentumSAMSpec, {}),
    "arwp": (ARWPSpec, {}),
    "mesa": (MESASpec, {}),
    "saf": (SAFSpec, {}),
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
    """The validated specification of method ``name``; ``options`` override its defaults.

    Example:
        >>> spec = method_spec("rst", probability=0.25)
        >>> type(spec).__name__, spec.probability
        ('RSTSpec', 0.25)
        >>> method_spec("rst", probability=2)
        Traceback (most recent call last):
        ...
        ValueError: ...probability...
    """
    cls, implied = lookup(name)
    if cls is None:
        raise ValueError(
            f"Method {name!r} is plain AdamW: there is no SAM method to build; step the"
            " optimizer as usual."
        )
    return cls(**{**implied, **options})


def spec_from(method: str | MethodSpec, options: dict[str, Any], *, owner: str,
              instead: str) -> MethodSpec:  # fmt: skip
    """The validated specification a front-end (``owner``) runs: ``method`` is a registry
    name, with ``options`` overriding its defaults, or a specification, without options.
    ``instead``: what to do where the name is plain AdamW."""
    if isinstance(method, MethodSpec):
        if options:
            raise TypeError(
                f"{owner} takes options with a method name, not with a MethodSpec (got"
                f" {sorted(options)}): set them on the spec."
            )
        return method
    if not isinstance(method, str):
        raise TypeError(
            f"{owner}'s method must be a method name or a MethodSpec (method_spec('slsam',"
            f" rho=0.05)), got {type(method).__name__}."
        )
    spec_class, _ = lookup(method)  # a ValueError naming the closest method
    if spec_class is None:
        raise ValueError(f"Method {method!r} is plain AdamW, which needs no {owner}: {instead}")
    return method_spec(method, **options)


def make_engine(name: str, module: torch.nn.Module, **options: Any) -> SAMEngine:
    """The engine of method ``name`` (see :data:`SPECS`) for ``module``, ``options``
    overriding its defaults: what the method's callback builds, for a plain PyTorch loop.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> engine = make_engine("slsam", net, layer_ratio=0.5, seed=0)
        >>> opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        >>> x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
        >>> loss = lambda: torch.nn.functional.cross_entropy(net(x), y)
        >>> engine.train_step(loss, opt).kind
        'sam'
    """
    return method_spec(name, **options).build_engine(module)


def register_method(spec_class: type[MethodSpec], **implied: Any) -> type[MethodSpec]:
    """Add a :class:`~lightning_slsam.methods.spec.MethodSpec` subclass under
    ``spec_class.name`` for :func:`make_engine`, :func:`~lightning_slsam.make_callback` and
    :data:`~lightning_slsam.METHODS` (docs/extending.md); ``implied``: options the name sets.
    Returns ``spec_class`` (usable as a decorator).

    Example:
        SAM on a uniformly drawn half of the layers, by name:

        >>> import torch
        >>> from typing import ClassVar
        >>> from lightning_slsam.selection.rules import UniformSelection
        >>> @register_method
        ... class HalfSAMSpec(MethodSpec):
        ...     name: ClassVar[str] = "half_sam"
        ...     label: ClassVar[str] = "HalfSAM"
        ...     def selection(self, layers, generator):
        ...         return UniformSelection(layers.num_layers, 0.5, generator)
        >>> engine = make_engine("half_sam", torch.nn.Linear(4, 2), seed=0)
        >>> type(engine.selection).__name__, engine.selection.ratio
        ('UniformSelection', 0.5)
        >>> del SPECS["half_sam"]  # (this example leaves the registry as it found it)
    """
    if not (isinstance(spec_class, type) and issubclass(spec_class, MethodSpec)):
        raise TypeError(f"register_method takes a MethodSpec subclass, got {spec_class!r}.")
    name = spec_class.name
    known = SPECS.get(name)
    if known is not None and known[0] is not spec_class:
        raise ValueError(
            f"A method named {name!r} exists already ({known[0]}): give {spec_class.__name__}"
            " its own `name` (a ClassVar)."
        )
    spec_class(**implied)  # the implied options must be valid
    SPECS[name] = (spec_class, dict(implied))
    return spec_class
