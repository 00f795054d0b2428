"""FabricSAM on one device: the Trainer path's result for every method, accumulation,
clipping, bfloat16, a stop and resume through fabric.save / fabric.load, and bad input
refused before any weight changes."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    Counting,
    LitModel,
    Stack,
    loader,
    make_data,
    make_mlp,
    per_sample_outputs,
    trainer,
)
from tolerance import within

from lightning_slsam import FabricSAM, make_callback

#: Every method of the registry, by name: the comparison's and the plugin's own.
METHODS = [
    "sam", "slsam_paper", "random_slsam", "top_slsam", "s2sam", "sl_s2sam", "rst", "esam",
    "ssamf", "looksam", "slsam_rst", "slsam_looksam", "slsam_depth", "slsam",
    "momentum_sam", "arwp", "mesa", "saf",
]  # fmt: skip
STEPS = 4
BATCH = 16


class PerSample(LitModel):
    def training_step(self, batch, batch_idx):
        return per_sample_outputs(self, batch)  # ESAM's losses, MESA's logits, SAF's indices


def _options(method: str, **extra) -> dict:
    saf = {"delay": 1, "start_epoch": 0} if method == "saf" else {}  # its term at step 2
    return {"seed": 3, **saf, **extra}


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("net."): p.detach().clone() for n, p in module.named_parameters()}


def fabric_run(method, accumulate=1, clip=None, algorithm="norm", precision="32-true",
               steps=STEPS, **options):  # fmt: skip
    """SAM through FabricSAM on one CPU device; the batches as the Trainer's loader."""
    L.seed_everything(7)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision)
    net = make_mlp(seed=5)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    model, optimizer = fabric.setup(net, optimizer)
    sam = FabricSAM(fabric, model, optimizer, method, gradient_clip_val=clip,
                    gradient_clip_algorithm=algorithm, **_options(method, **options))  # fmt: skip
    sam.engine.planned_steps = steps  # ARWP's noise grows over the run
    batches = list(loader(make_data(BATCH * steps, indexed=BATCH), BATCH // accumulate))
    results = []

    def loss_fn(batch):
        return per_sample_outputs(model, batch)

    for i in range(steps):
        results.append(sam.step(loss_fn, *batches[i * accumulate : (i + 1) * accumulate]))
    return _weights(model.module), sam, results


def trainer_run(method, accumulate=1, clip=None, algorithm="norm", precision="32-true",
                steps=STEPS, **options):  # fmt: skip
    L.seed_everything(7)
    model = PerSample(make_mlp(seed=5))
    callback = make_callback(method, accumulate_grad_batches=accumulate, gradient_clip_val=clip,
                             gradient_clip_algorithm=algorithm,
                             **_options(method, **options))  # fmt: skip
    fit = trainer(callbacks=[callback], max_steps=steps, limit_val_batches=0, precision=precision)
    fit.fit(model, loader(make_data(BATCH * steps, indexed=BATCH), BATCH // accumulate))
    return _weights(model), callback


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


@pytest.mark.parametrize("method", METHODS)
def test_fabric_equals_the_trainer_path(method):
    weights, sam, results = fabric_run(method)
    expected, callback = trainer_run(method)
    assert within(_max_diff(weights, expected), 1e-6)
    assert sam.engine.counts.tolist() == callback.engine.counts.tolist()
    assert sam.engine.num_steps == STEPS and len(results) == STEPS
    start = _weights(make_mlp(seed=5))
    assert _max_diff(weights, start) > 1e-3  # it trained


@pytest.mark.parametrize("method", ["sam", "slsam_paper", "esam"])
def test_accumulation_and_clipping_equal_the_trainer_path(method):
    for options in ({"accumulate": 2}, {"clip": 0.05}, {"clip": 0.01, "algorithm": "value"},
                    {"accumulate": 2, "clip": 0.05}):  # fmt: skip
        weights, _, _ = fabric_run(method, **options)
        expected, _ = trainer_run(method, **options)
        assert within(_max_diff(weights, expected), 1e-6), options
    unclipped, _, _ = fabric_run(method)
    assert _max_diff(fabric_run(method, clip=0.05)[0], unclipped) > 1e-4  # clipping acted


@pytest.mark.parametrize("method", ["sam", "slsam_paper", "slsam"])
def test_bfloat16_mixed_is_within_the_trainer_paths_tolerance(method):
    weights, _, _ = fabric_run(method, precision="bf16-mixed")
    full, _, _ = fabric_run(method)
    expected, _ = trainer_run(method, precision="bf16-mixed")
    assert within(_max_diff(weights, expected), 1e-6)  # the same bfloat16 arithmetic
    assert within(_max_diff(weights, full), 3e-2)  # the DDP tests' bfloat16 tolerance


def test_fabric_save_and_load_resume_bit_for_bit(tmp_path):
    steps = 6
    full, full_sam, _ = fabric_run("slsam_paper", steps=steps)

    def run(start: int, stop: int, load: bool):
        L.seed_everything(7)
        fabric = L.Fabric(accelerator="cpu", devices=1)
        net = make_mlp(seed=5)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
        model, optimizer = fabric.setup(net, optimizer)
        sam = FabricSAM(fabric, model, optimizer, "slsam_paper", seed=3)
        state = {"model": model, "optimizer": optimizer, "sam": sam}
        if load:
            fabric.load(tmp_path / "ckpt.pt", state)
        batches = list(loader(make_data(BATCH * steps), BATCH))
        for i in range(start, stop):
            x, y = batches[i]
            sam.step(lambda b: F.cross_entropy(model(b[0]), b[1], reduction="none"), (x, y))
        if not load:
            fabric.save(tmp_path / "ckpt.pt", state)
        return _weights(model.module), sam

    run(0, 3, load=False)
    resumed, sam = run(3, steps, load=True)
    assert all(torch.equal(resumed[k], full[k]) for k in full)
    assert torch.equal(sam.engine.counts, full_sam.engine.counts)
    assert torch.equal(sam.engine.selection.probs, full_sam.engine.selection.probs)


def test_bad_input_is_refused_naming_the_fix_before_any_weight_changes():
    fabric = L.Fabric(accelerator="cpu", devices=1)
    net = make_mlp(seed=5)
    before = _weights(net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    with pytest.raises(TypeError, match=r"fabric\.setup\(model, optimizer\)` first"):
        FabricSAM(fabric, net, optimizer, "slsam")
    with pytest.raises(TypeError, match=r"takes the Fabric object first"):
        FabricSAM(net, net, optimizer, "slsam")
    model, fabric_opt = fabric.setup(net, optimizer)
    with pytest.raises(TypeError, match=r"optimizer that fabric\.setup returned"):
        FabricSAM(fabric, model, optimizer, "slsam")
    with pytest.raises(ValueError, match=r"Unknown method 'slsm'.*Did you mean 'slsam'"):
        FabricSAM(fabric, model, fabric_opt, "slsm")
    with pytest.raises(ValueError, match=r"plain AdamW, which needs no FabricSAM"):
        FabricSAM(fabric, model, fabric_opt, "adamw")
    with pytest.raises(ValueError, match=r"`layer_ratio` must be in \(0, 1\], got 1\.5"):
        FabricSAM(fabric, model, fabric_opt, "slsam", layer_ratio=1.5)
    with pytest.raises(
        ValueError, match=r"`gradient_clip_algorithm` must be one of \('norm', 'value'\)"
    ):
        FabricSAM(fabric, model, fabric_opt, "slsam", gradient_clip_algorithm="l2")
    other = fabric.setup_optimizers(torch.optim.AdamW(make_mlp().parameters()))
    with pytest.raises(ValueError, match=r"not the model's parameters"):
        FabricSAM(fabric, model, other, "slsam")
    sam = FabricSAM(fabric, model, fabric_opt, "esam", seed=3)
    with pytest.raises(ValueError, match=r"per-sample"):  # ESAM without per-sample losses
        x, y = make_data(16)[:]
        sam.step(lambda b: F.cross_entropy(model(b[0]), b[1]), (x, y))
    assert all(torch.equal(before[k], v) for k, v in _weights(net).items())


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_strategies_sam_cannot_run_are_refused(strategy, monkeypatch):
    # The refusal goes by the strategy's class: stand-ins of FSDP1 and DeepSpeed.
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model, optimizer = fabric.setup(make_mlp(), torch.optim.AdamW(make_mlp().parameters()))
    name = {"fsdp": "FSDPStrategy", "deepspeed": "DeepSpeedStrategy"}[strategy]
    stand_in = type(name, (type(fabric.strategy),), {})
    monkeypatch.setattr(fabric._strategy, "__class__", stand_in)
    with pytest.raises(ValueError, match=rf"does not support {name}.*strategy='ddp'"):
        FabricSAM(fabric, model, optimizer, "slsam")


def test_float16_overflow_skips_the_step_and_backs_the_scaler_off():
    from lightning.fabric.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    fabric = L.Fabric(accelerator="cpu", devices=1,
                      plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])  # fmt: skip
    net = make_mlp(seed=5)
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    sam = FabricSAM(fabric, model, optimizer, "slsam_paper", seed=3)
    seen = []
    for step, batch in enumerate(list(loader(make_data(48), BATCH))):
        calls = []

        def loss_fn(b, step=step, calls=calls):
            calls.append(1)
            losses = F.cross_entropy(model(b[0]), b[1], reduction="none")
            overflow = step == 1 and len(calls) == 2  # step 1's second pass
            return losses * float("inf") if overflow else losses

        before = _weights(net)
        result = sam.step(loss_fn, batch)
        changed = any(not torch.equal(before[k], v) for k, v in _weights(net).items())
        seen.append((result.skipped, scaler.get_scale(), changed))
    assert seen == [(False, 2.0**10, True), (True, 2.0**9, False), (False, 2.0**9, True)]


def _fit_stack(compiled, backend=None, **options):
    L.seed_everything(7)
    fabric = L.Fabric(accelerator="cpu", devices=1)
    net = Stack()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(torch.compile(net, backend=backend) if compiled else net,
                                    optimizer)  # fmt: skip
    sam = FabricSAM(fabric, model, optimizer, "slsam_paper", seed=3, **options)

    def loss_fn(batch):
        return F.cross_entropy(model(batch[0]), batch[1], reduction="none")

    for batch in loader(make_data(96), BATCH):
        sam.step(loss_fn, batch)
    return _weights(net), sam


def test_a_model_compiled_whole_trains_sl_sam_on_its_compiled_blocks():
    torch._dynamo.reset()
    backend = Counting()
    compiled, sam = _fit_stack(True, backend)
    eager, eager_sam = _fit_stack(False, layers=[r"^(blocks\.\d+)\."])
    assert sam.partition.names[:3] == eager_sam.partition.names[:3] == [
        "blocks.0", "blocks.1", "blocks.2"]  # fmt: skip
    assert sam.engine.counts.tolist() == eager_sam.engine.counts.tolist()
    assert backend.calls == 3 * 2 * 6 and 2 <= backend.graphs <= 4  # the blocks ran compiled
    for name, value in eager.items():
        torch.testing.assert_close(compiled[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_a_model_compiled_whole_without_blocks_is_refused_under_layer_sampling():
    fabric = L.Fabric(accelerator="cpu", devices=1)
    net = make_mlp(seed=5)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(torch.compile(net, backend="aot_eager"), optimizer)
    with pytest.raises(ValueError, match=r"compiled whole without repeated blocks.*block\.compile"):
        FabricSAM(fabric, model, optimizer, "slsam")
    FabricSAM(fabric, model, optimizer, "sam")  # dense: compiles whole
