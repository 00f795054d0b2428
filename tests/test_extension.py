"""A method of one's own, from outside the package: a layer-selection rule, its
specification and its callback class, trained through the same callback machinery, a
LightningCLI YAML and a plain PyTorch loop (the extension point the "Write your own
method" page documents); and what a method adds to the steps (a
:class:`~lightning_slsam.core.step.MethodParts` with its own state)."""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import lightning as L
import pytest
import torch
import yaml
from helpers import LitModel, loader, make_data, make_mlp
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_slsam import (
    LayerSelection,
    LayerSubsetSpec,
    SAMCallback,
    make_callback,
    make_engine,
)
from lightning_slsam.core.partition import LayerPartition
from lightning_slsam.core.step import MethodParts
from lightning_slsam.lightning.callbacks import callback_for, register_callback
from lightning_slsam.lightning.signatures import options_class
from lightning_slsam.methods.options import number
from lightning_slsam.methods.registry import SPECS, register_method
from lightning_slsam.methods.spec import LayerSubsetOptions, MethodSpec, option


# -- the user's method: train the even-numbered layers, then the odd ones, and so on --------
# --8<-- [start:method]
class Alternate(LayerSelection):
    """Layers 0, 2, 4, ... on even steps, 1, 3, 5, ... on odd steps."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.steps = 0

    @property
    def probs(self) -> torch.Tensor:
        return torch.full((self.num_layers,), 0.5, dtype=torch.float64)

    def sample(self) -> torch.Tensor:
        mask = torch.arange(self.num_layers) % 2 == self.steps % 2
        self.steps += 1
        return mask

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]


class AlternateSpec(LayerSubsetSpec):
    name: ClassVar[str] = "alternate"
    label: ClassVar[str] = "AlternateSAM"

    def selection(self, layers: LayerPartition, generator: torch.Generator) -> LayerSelection:
        return Alternate(layers.num_layers)


@options_class
class AlternateSAM(SAMCallback, LayerSubsetOptions):
    spec_class = AlternateSpec


# --8<-- [end:method]

# -----------------------------------------------------------------------------------------


@pytest.fixture
def registered():
    register_method(AlternateSpec)
    register_callback(AlternateSAM)  # make_callback("alternate") builds this class
    yield
    SPECS.pop("alternate")


class Masks(L.Callback):
    def __init__(self) -> None:
        self.masks: list[list[bool]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sam = next(cb for cb in trainer.callbacks if isinstance(cb, SAMCallback))
        self.masks.append(sam.active_mask.tolist())


def _fit(callback: SAMCallback, steps: int = 4) -> tuple[list[list[bool]], dict[str, Any]]:
    masks = Masks()
    model = LitModel(make_mlp())
    before = copy.deepcopy(model.state_dict())
    trainer = L.Trainer(
        max_steps=steps, callbacks=[callback, masks], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    trainer.fit(model, loader(make_data(64), 16))
    after = model.state_dict()
    return masks.masks, {k: not torch.equal(before[k], after[k]) for k in after}


def test_a_user_method_trains_through_the_callback():
    masks, changed = _fit(AlternateSAM(rho=0.05, seed=0))
    n = len(masks[0])
    even = [i % 2 == 0 for i in range(n)]
    assert masks == [even, [not e for e in even]] * 2
    assert all(changed.values())  # every layer was trained, each on every other step
    cb = AlternateSAM(layer_ratio=0.5)
    assert cb.layer_ratio == 0.5 and cb.rho == 0.01  # the shell reads the spec's options
    with pytest.raises(TypeError, match="AlternateSAM has no option 'rhoo'; did you mean 'rho'"):
        AlternateSAM(rhoo=0.1)


def test_a_registered_method_is_known_by_name(registered):
    from lightning_slsam import METHODS

    assert METHODS["alternate"][0] is AlternateSAM
    masks, _ = _fit(make_callback("alternate", seed=0), steps=2)
    assert masks[0] != masks[1]
    net = make_mlp()
    engine = make_engine("alternate", net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = make_data(16).tensors
    kinds = [
        engine.train_step(lambda: torch.nn.functional.cross_entropy(net(x), y), opt)
        for _ in range(2)
    ]
    assert [r.active_mask.tolist() for r in kinds] == masks
    with pytest.raises(ValueError, match="exists already"):
        register_method(type("Other", (AlternateSpec,), {}))


@dataclass(kw_only=True, eq=False)
class WidthSpec(LayerSubsetSpec):
    name: ClassVar[str] = "width_sam"
    label: ClassVar[str] = "WidthSAM"

    width: int = option(4, number(1, integer=True))


def test_a_spec_without_a_callback_class_gets_one_built_from_its_fields():
    cls = callback_for(WidthSpec)
    assert cls.__name__ == "WidthSAM" and callback_for(WidthSpec) is cls
    assert list(inspect.signature(cls).parameters)[-2:] == ["layer_ratio", "width"]
    assert cls(width=8).spec.width == 8 and cls().method == "width_sam"
    with pytest.raises(ValueError, match=r"^WidthSAM: `width` must be an integer >= 1, got 0"):
        cls(width=0)


def test_a_callback_class_without_its_specs_options_says_what_to_declare():
    class Bare(SAMCallback):  # neither the option dataclass nor @options_class
        spec_class = AlternateSpec

    with pytest.raises(TypeError, match=r"^Bare lacks AlternateSAM's options \['layer_ratio'\]"):
        Bare()


FITTED: list[SAMCallback] = []


class KeepSAM(L.Callback):
    """Keeps the SAM callback of a fit the CLI ran."""

    def on_fit_end(self, trainer, pl_module):
        FITTED.append(next(cb for cb in trainer.callbacks if isinstance(cb, SAMCallback)))


class TinyData(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return loader(make_data(64), 16)


def test_a_user_method_trains_from_yaml(tmp_path):
    from lightning_slsam.cli.command import main

    config = {
        "seed_everything": 0,
        "trainer": {
            "max_steps": 4, "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False, "default_root_dir": str(tmp_path),
            "callbacks": [{"class_path": f"{__name__}.AlternateSAM",
                           "init_args": {"rho": 0.05, "plot": False}},
                          {"class_path": f"{__name__}.KeepSAM"}],
        },
        "model": {"class_path": "helpers.LitModel",
                  "init_args": {"net": {"class_path": "torch.nn.Linear",
                                        "init_args": {"in_features": 8, "out_features": 3}}}},
        "data": {"class_path": f"{__name__}.TinyData"},
    }  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    FITTED.clear()
    main(["fit", "--config", str(path)])
    (sam,) = FITTED
    assert isinstance(sam, AlternateSAM)
    assert sam.rho == 0.05
    assert sam.engine.num_steps == 4
    assert sam.engine.counts.tolist() == [2, 2]  # weight and bias, alternating


# -- steps of one's own: SAM on every other step, a plain step in between -----------------
# --8<-- [start:step-kind]
class EveryOtherSAM(MethodParts):
    """SAM's two passes on every other step, one plain pass in between. The count of steps
    named is the parts' own state, saved and restored with the engine's."""

    def __init__(self) -> None:
        self.steps_run = 0

    def kind(self, step: int) -> str:
        # The engine asks once per step; the kind names the step in the counters and logs.
        kind = "sam" if self.steps_run % 2 == 0 else "plain"
        self.steps_run += 1
        return kind

    def state_dict(self, index: dict[int, int]) -> dict[str, Any]:
        return {"every_other_steps_run": self.steps_run}

    def load_state_dict(self, state: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        self.steps_run = state["every_other_steps_run"]


class EveryOtherSpec(MethodSpec):
    name: ClassVar[str] = "every_other_sam"
    label: ClassVar[str] = "EveryOtherSAM"

    def parts(self, generator: torch.Generator) -> MethodParts:
        return EveryOtherSAM()


@options_class
class EveryOtherSAMCallback(SAMCallback):
    spec_class = EveryOtherSpec


# --8<-- [end:step-kind]


class Kinds(L.Callback):
    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.passes: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sam = next(cb for cb in trainer.callbacks if isinstance(cb, SAMCallback))
        self.kinds.append(sam.engine.last_result.kind)
        self.passes.append(sam.engine.last_result.num_backward)


def _fit_every_other(epochs: int, tmp_path, ckpt_path=None, seed: int = 0):
    L.seed_everything(seed)
    kinds = Kinds()
    callback = EveryOtherSAMCallback(rho=0.05, seed=0)
    saver = ModelCheckpoint(dirpath=tmp_path, filename="every_other-{epoch}", save_top_k=-1)
    model = LitModel(make_mlp(seed=1))
    fit = L.Trainer(
        max_epochs=epochs, callbacks=[callback, kinds, saver], logger=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    # 48 samples in batches of 16: 3 steps an epoch, so an epoch ends between a SAM step
    # and a plain one on one epoch and the other way round on the next.
    fit.fit(model, loader(make_data(48), 16), ckpt_path=ckpt_path)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return weights, callback, kinds, fit


def test_a_user_step_kind_trains_and_resumes_bit_for_bit(tmp_path):
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    full, full_cb, full_kinds, _ = _fit_every_other(2, full_dir)
    # The kind alternated: SAM (2 backward passes), plain (1), SAM, ...
    assert full_kinds.kinds == ["sam", "plain", "sam", "plain", "sam", "plain"]
    assert full_kinds.passes == [2, 1, 2, 1, 2, 1]
    assert full_cb.engine.kind_counts == {"sam": 3, "plain": 3}
    # Its own state went into the checkpoint with the engine's ...
    saved = torch.load(full_dir / "every_other-epoch=0.ckpt", weights_only=False)
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("EveryOtherSAM"))
    assert _find(state, "every_other_steps_run") == 3
    # ... and a run stopped after 3 steps (SAM, plain, SAM) resumes with a plain step, to
    # the uninterrupted run's weights, bit for bit.
    _fit_every_other(1, cut_dir)
    resumed, cb, kinds, _ = _fit_every_other(
        2, cut_dir, ckpt_path=str(cut_dir / "every_other-epoch=0.ckpt")
    )
    assert kinds.kinds == ["plain", "sam", "plain"]
    assert cb.engine.parts.steps_run == 6
    for name, value in full.items():
        assert torch.equal(resumed[name], value), name


def _find(state: Any, key: str) -> Any:
    """``key``'s value anywhere in a nested checkpoint state."""
    if isinstance(state, dict):
        if key in state:
            return state[key]
        for value in state.values():
            found = _find(value, key)
            if found is not None:
                return found
    return None
