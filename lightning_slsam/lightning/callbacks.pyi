"""Type stub of :mod:`lightning_slsam.lightning.callbacks`: each method class's options,
typed and with their defaults, for type checkers and IDEs.

At run time each ``__init__`` is built from the method's specification (its fields) and
the Lightning options (``SAMCallback.__init_subclass__``); ``tests/test_typing.py`` keeps
every ``__init__`` here equal to that one (``signatures.stub_init(cls)`` prints it).
"""

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_slsam.core.partition import LayerSpec
from lightning_slsam.lightning.callback import SAMCallback
from lightning_slsam.methods.spec import Preset
from lightning_slsam.selection.bandit import LayerBandit

class SAM(SAMCallback):
    def __init__(
        self,
        *,
        rho: float = 0.01,
        adaptive: bool = False,
        perturbation_norm: str = "global",
        layers: LayerSpec = "tensor",
        always_active: Sequence[str] = (),
        always_frozen: Sequence[str] = (),
        seed: int | None = None,
        bn_stats: str = "first",
        replay_dropout: bool = False,
        sync_first_pass: bool = True,
        check_masks: bool = False,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        accumulate_grad_batches: int = 1,
        plot: bool = True,
    ) -> None: ...

class SparseLayerSAM(SAMCallback):
    def __init__(
        self,
        *,
        rho: float = 0.01,
        adaptive: bool = False,
        perturbation_norm: str = "global",
        layers: LayerSpec = "tensor",
        always_active: Sequence[str] = (),
        always_frozen: Sequence[str] = (),
        seed: int | None = None,
        bn_stats: str = "first",
        replay_dropout: bool = False,
        sync_first_pass: bool = True,
        check_masks: bool = False,
        layer_ratio: float = 0.2,
        p_min: float = 0.001,
        preset: Preset = "default",
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        accumulate_grad_batches: int = 1,
        plot: bool = True,
    ) -> None: ...
    @property
    def bandit(self) -> LayerBandit: ...
    def selection_metrics(self) -> dict[str, float]: ...

class RandomSLSAM(SAMCallback):
    def __init__(
        self,
        *,
        rho: float = 0.01,
        adaptive: bool = False,
        perturbation_norm: str = "global",
        layers: LayerSpec = "tensor",
        always_active: Sequence[str] = (),
        always_frozen: Sequence[str] = (),
        seed: int | None = None,
        bn_stats: str = "first",
        replay_dropout: bool = False,
        sync_first_pass: bool = True,
        check_masks: bool = False,
        layer_ratio: float = 0.2,
        preset: Preset = "paper",
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        accumulate_grad_batches: int = 1,
        plot: bool = True,
    ) -> None: ...

class TopSLSAM(SAMCallback):
    def __init__(
        self,
        *,
        rho: float = 0.01,
        adaptive: bool = False,
        perturbation_norm: str = "global",
        layers: LayerSpec = "tensor",
        always_active: Sequence[str] = (),
        always_frozen: Sequence[str] = (),
        seed: int | None = None,
        bn_stats: str = "first",
        replay_dropout: bool = False,
        sync_first_pass: bool = True,
        check_masks: bool = False,
        layer_ratio: float = 0.2,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        accumulate_grad_batches: int = 1,
        plot: bool = True,
    ) -> None: ...

class S2SAM(SAM):
    def __init__(
        self,
        *,
        rho: float = 0.01,
        adaptive: bool = False,
        perturbation_norm: str = "global",
        layers: LayerSpec = "tensor",
        always_active: Sequence[str] = (),
        always_frozen: Sequence[str] = (),
        seed: int | None = None,
        bn_stats: str = "first",
        replay_dropout: bool = False,
        sync_first_pass: bool = True,
        check_masks: bool = False,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        accumulate_grad_batches: int = 1,
        plot: bool = True,
    ) -> None: ...

class MomentumSAM(SAM):
    def __init__(
        self,
        *,
        rho: float = 1.0,
        adaptive: bool = False,
        perturbation_norm: str = "global",
        layers: LayerSpec = "tensor",
        always_active: Sequence[str] = (),
        always_frozen: Sequence[str] = (),
        seed: int | None = None,
        bn_stats: str = "first",
        replay_dropout: bool = False,
        sync_first_pass: bool = True,
        check_masks: bool = False,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        accumulate_grad_batches: int = 1,
        plot: bool = True,
    ) -> None: ...

class SLS2SAM(SparseLayerSAM):
    def __init__(
        self,
        *,
        rho: float = 0.01,
        adaptive: bool = False,
        perturbation_norm: str = "global",
        layers: LayerSpec = "tensor",
        always_active: Sequence[str] = (),
        always_frozen: Sequence[str] = (),
        seed: int | None = None,
        bn_stats: str = "first",
        replay_dropout: bool = False,
        sync_first_pass: bool = True,
        check_masks: bool = False,
        layer_ratio: float = 0.2,
        p_min: float = 0.001,
        preset: Preset = "paper",
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        accumulate_grad_batches: int = 1,
        plot: bool = True,
    ) -> None: ...

class RST(SAM):
    def __init__(
        self,
        *,
        rho: float = 0.01,
        adaptive: bool = False,
        perturbation_norm: str = "global",
        layers: LayerSpec = "tensor",
        always_active: Sequence[str] = (),
        always_frozen: Sequence[str] = (),
        seed: int | None = None,
        bn_stats: str = "first",
        replay_dropout: bool = False,
        sync_first_pass: bool = True,
        check_masks: bool = False,
        probability: float = 0.5,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        accumulate_grad_batches: int = 1,
        plot: bool = True,
    ) -> None: ...

class LookSAM(SAM):
    def __init__(
        self,
        *,
        rho: float = 0.01,
        adaptive: bool = False,
        perturbation_norm: str = "global",
        layers: LayerSpec = "tensor",
        always_active: Sequence[str] = (),
        always_frozen: Sequence[str] = (),
        seed: int | None = None,
        bn_stats: str = "first",
        replay_dropout: bool = False,
        sync_first_pass: bool = True,
        check_masks: bool = False,
        interval: int = 5,
        alpha: float = 0.7,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        accumulate_grad_batches: int = 1,
        plot: bool = True,
    ) -> None: ...

class ESAM(SAMCallback):
    def __init__(
        self,
        *,
        rho: float = 0.01,
        adaptive: bool = False,
        perturbation_norm: str = "global",
        layers: LayerSpec = "tensor",
        always_active: Sequence[str] = (),
        always_frozen: Sequence[str] = (),
        seed: int | None = None,
        bn_stats: str = "first",
        replay_dropout: bool = False,
        sync_first_pass: bool = True,
        check_masks: bool = False,
        weight_ratio: float = 0.5,
        data_ratio: float = 0.5,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        accumulate_grad_batches: int = 1,
        plot: bool = True,
    ) -> None: ...

class SSAMF(SAMCallback):
    def __init__(
        self,
        *,
        rho: float = 0.01,
        adaptive: bool = False,
        perturbation_norm: str = "global",
        layers: LayerSpec = "tensor",
        always_active: Sequence[str] = (),
        always_frozen: Sequence[str] = (),
        seed: int | None = None,
        bn_stats: str = "first",
        replay_dropout: bool = False,
        sync_first_pass: bool = True,
        check_masks: bool = False,
        sparsity: float = 0.5,
        fisher_samples: int = 16,
        mask_interval: int = 100,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        accumulate_grad_batches: int = 1,
        plot: bool = True,
    ) -> None: ...

class SLSAMRST(SparseLayerSAM):
    def __init__(
        self,
        *,
        rho: float = 0.01,
        adaptive: bool = False,
        perturbation_norm: str = "global",
        layers: LayerSpec = "tensor",
        always_active: Sequence[str] = (),
        always_frozen: Sequence[str] = (),
        seed: int | None = None,
        bn_stats: str = "first",
        replay_dropout: bool = False,
        sync_first_pass: bool = True,
        check_masks: bool = False,
        probability: float = 0.5,
        layer_ratio: float = 0.2,
        p_min: float = 0.001,
        preset: Preset = "default",
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        accumulate_grad_batches: int = 1,
        plot: bool = True,
    ) -> None: ...

class SLSAMLookSAM(SparseLayerSAM):
    def __init__(
        self,
        *,
        rho: float = 0.01,
        adaptive: bool = False,
        perturbation_norm: str = "global",
        layers: LayerSpec = "tensor",
        always_active: Sequence[str] = (),
        always_frozen: Sequence[str] = (),
        seed: int | None = None,
        bn_stats: str = "first",
        replay_dropout: bool = False,
        sync_first_pass: bool = True,
        check_masks: bool = False,
        interval: int = 5,
        alpha: float = 0.7,
        layer_ratio: float = 0.2,
        p_min: float = 0.001,
        preset: Preset = "default",
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        accumulate_grad_batches: int = 1,
        plot: bool = True,
    ) -> None: ...

class CostAwareSLSAM(SparseLayerSAM):
    def __init__(
        self,
        *,
        rho: float = 0.01,
        adaptive: bool = False,
        perturbation_norm: str = "global",
        layers: LayerSpec = "tensor",
        always_active: Sequence[str] = (),
        always_frozen: Sequence[str] = (),
        seed: int | None = None,
        bn_stats: str = "first",
        replay_dropout: bool = False,
        sync_first_pass: bool = True,
        check_masks: bool = False,
        layer_ratio: float = 0.2,
        p_min: float = 0.001,
        preset: Preset = "default",
        depth: float = 0.5,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        accumulate_grad_batches: int = 1,
        plot: bool = True,
    ) -> None: ...

class SLSAMAblation(SparseLayerSAM):
    def __init__(
        self,
        *,
        rho: float = 0.01,
        adaptive: bool = False,
        perturbation_norm: str = "global",
        layers: LayerSpec = "tensor",
        always_active: Sequence[str] = (),
        always_frozen: Sequence[str] = (),
        seed: int | None = None,
        bn_stats: str = "first",
        replay_dropout: bool = False,
        sync_first_pass: bool = True,
        check_masks: bool = False,
        layer_ratio: float = 0.2,
        p_min: float = 0.001,
        preset: Preset = "default",
        budget: str | None = None,
        bandit_loss: str | None = None,
        alpha_p: float | None = None,
        head_always_active: bool | None = None,
        max_update_scale: float | None = None,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        accumulate_grad_batches: int = 1,
        plot: bool = True,
    ) -> None: ...

METHODS: Mapping[str, tuple[type[SAMCallback] | None, dict[str, Any]]]

def class_path(cls: type[SAMCallback]) -> str: ...
def make_callback(name: str, **kwargs: Any) -> SAMCallback: ...
def make_callbacks(name: str, **kwargs: Any) -> list[SAMCallback]: ...

__all__ = [
    "ESAM",
    "METHODS",
    "RST",
    "S2SAM",
    "SAM",
    "SLS2SAM",
    "SLSAMRST",
    "SSAMF",
    "CostAwareSLSAM",
    "LookSAM",
    "MomentumSAM",
    "RandomSLSAM",
    "SLSAMAblation",
    "SLSAMLookSAM",
    "SparseLayerSAM",
    "TopSLSAM",
    "class_path",
    "make_callback",
    "make_callbacks",
]
