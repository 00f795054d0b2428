"""FSDP2 (``fully_shard``) on CPU with two gloo processes: the engine in a plain loop, and
every method through Lightning's ModelParallelStrategy.

The runs happen in ``fsdp2_worker.py`` (plain loop) and ``fsdp2_lightning_worker.py``
(Lightning); each rank writes what it saw, and the tests compare the ranks with each other
and the sharded weights with a one-process run on the same global batches.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import launch, make_mlp, two_ranks
from tolerance import BF16_CHANGES, BF16_UPDATE_GAP, update_gap, within

from lightning_slsam.methods.ssamf import _sample_sources
from lightning_slsam.parallel.shards import WHOLE, FSDP2Shards, shards_of, top_coordinates

#: The workers stay in tests/ (run by path), one folder above this file.
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(TESTS, "fsdp2_worker.py")
EXACT = [
    "sam", "asam", "sam_layer_norm", "slsam_paper", "slsam", "random_slsam", "top_slsam",
    "s2sam", "sl_s2sam", "rst", "looksam", "slsam_rst", "slsam_looksam", "slsam_depth", "ssamf",
    "momentum_sam", "arwp", "mesa", "saf",
]  # fmt: skip


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return two_ranks(WORKER, tmp_path_factory.mktemp("fsdp2"))


@pytest.mark.parametrize("case", EXACT)
def test_sharded_training_equals_one_process(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["sharded"] and r1["sharded"]
    # Every step: the gathered shards equal the one-process weights.
    assert within(max(r0["diff"]), 1e-5), r0["diff"]
    assert r0["kinds"] == r1["kinds"]
    assert all(torch.equal(a, b) for a, b in zip(r0["masks"], r1["masks"]))


@pytest.mark.parametrize("case", ["sam", "slsam_paper", "sl_s2sam"])
def test_an_evaluation_between_steps_changes_nothing_in_the_plain_loop(ranks, case):
    # A forward under no_grad leaves FSDP2's root (which owns the head here) unsharded;
    # the engine trains the sharded tensors all the same, and equals one process.
    plain, evaluated = ranks[0][case], ranks[0][f"{case}_evaluated"]
    assert evaluated["sharded"] and within(max(evaluated["diff"]), 1e-5), evaluated["diff"]
    assert evaluated["kinds"] == plain["kinds"]
    assert all(torch.equal(a, b) for a, b in zip(evaluated["masks"], plain["masks"]))


def test_sparse_methods_freeze_layers_under_fsdp2(ranks):
    # The sharded run really trains subsets (the equality above is not all-dense).
    masks = ranks[0]["slsam_paper"]["masks"]
    assert any(not bool(m.all()) for m in masks)
    assert ranks[0]["top_slsam"]["masks"][0].sum() == 3  # round(0.5 * 6)
    assert ranks[0]["looksam"]["kinds"] == ["sam", "reuse", "sam", "reuse", "sam"]
    assert ranks[0]["s2sam"]["kinds"][0] == "plain"


def test_esam_draws_the_same_layers_on_every_rank(ranks):
    # ESAM ranks each process's own samples (as under DDP), so it is not the one-process
    # run; the draws and step kinds must still agree.
    r0, r1 = ranks[0]["esam"], ranks[1]["esam"]
    assert all(torch.equal(a, b) for a, b in zip(r0["masks"], r1["masks"]))
    assert r0["kinds"] == r1["kinds"] == ["sam"] * 5


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("local_first_pass", ["sync_first_pass=False", "FSDP2"]),
        ("built_before_sharding", ["replaced", "build the engine after sharding"]),
    ],
)
def test_what_fsdp2_cannot_do_is_refused_naming_why(ranks, case, words):
    message = ranks[0]["refused"][case]
    for word in words:
        assert word in message, message


def test_without_a_process_group_nothing_changes():
    tensors = [torch.ones(3), torch.zeros(2)]
    assert shards_of(tensors, None) is WHOLE  # nothing is sharded
    seam = FSDP2Shards([])  # the FSDP2 seam itself, outside a process group
    assert all(a is b for a, b in zip(seam.local(tensors), tensors))
    values = torch.tensor([1.0, 2.0])
    assert seam.sums(values, tensors) is values


@pytest.mark.parametrize("keep", [0, 1, 7, 13, 20])
def test_top_coordinates_keeps_the_largest_with_ties_by_position(keep):
    # SSAM-F's mask (the same code on one process and on shards): exactly `keep` kept, every
    # kept value >= every dropped one, ties taken in position order; NaN counts as largest.
    torch.manual_seed(0)
    values = [torch.randint(0, 4, (3, 4)).float() * 0.25, torch.randint(0, 4, (8,)).float()]
    values[1][2] = float("nan")
    masks = top_coordinates(values, keep, None)
    flat = torch.cat([v.reshape(-1) for v in values]).nan_to_num(nan=float("inf"))
    chosen = torch.cat([m.reshape(-1) for m in masks])
    assert int(chosen.sum()) == keep
    order = sorted(range(len(flat)), key=lambda i: (-float(flat[i]), i))
    assert chosen.nonzero().reshape(-1).tolist() == sorted(order[:keep])


def test_top_coordinates_orders_float_magnitudes_exactly():
    values = [torch.tensor([1e-30, 3.0, 2.9999998, 0.0, 1e30, 7e-45])]
    (mask,) = top_coordinates(values, 3, None)
    assert mask.tolist() == [False, True, True, False, True, False]


def test_ssamf_under_fsdp2_needs_a_loss_scale_argument():
    # Refused before any collective, naming the argument.
    with pytest.raises(ValueError, match="loss_scale"):
        _sample_sources(lambda subsets=None, backward=True: None, None, 4, torch.device("cpu"))


# -- through Lightning: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
# fully_shard in configure_model ------------------------------------------------------------
LIGHTNING_WORKER = os.path.join(TESTS, "fsdp2_lightning_worker.py")
LIGHTNING_METHODS = [
    "sam", "slsam_paper", "random_slsam", "top_slsam", "s2sam", "sl_s2sam", "rst", "looksam",
    "slsam_rst", "slsam_looksam", "slsam", "esam", "ssamf", "slsam_depth",
    "momentum_sam", "arwp", "mesa", "saf",
]  # fmt: skip
#: The bfloat16 runs: every method.
BFLOAT16_METHODS = LIGHTNING_METHODS


def _lightning(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, LIGHTNING_WORKER, *args], capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


VALIDATED = ["sam", "slsam_paper", "slsam", "sl_s2sam", "ssamf"]
VARIANTS = {  # tag -> worker arguments (sam and slsam_paper, on 2 processes and on 1)
    "acc2": ["--accumulate", "2"],
    "clip": ["--clip", "0.05", "--tag", "_clip"],
}
#: What ModelParallelStrategy accepts besides 32-true. (It refuses 16-mixed and 64-true
#: itself; 16-true trains float16 weights without a loss scaler, where AdamW fails on its
#: own: its second moment underflows.)
BFLOAT16 = ["bf16-mixed", "bf16-true"]
RESUMED = [
    "sam",
    "slsam_paper",
    "s2sam",
    "sl_s2sam",
    "looksam",
    "ssamf",
    "momentum_sam",
    "arwp",
    "mesa",
    "saf",
]
CROSSED = ["slsam_paper", "s2sam", "looksam"]
#: form of torch.compile (after fully_shard, in configure_model) -> the methods it trains
COMPILED = {
    "blocks": ["slsam_paper", "slsam", "top_slsam", "esam"],
    "whole": ["slsam_paper", "sam"],
}


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    """Every fit through the strategy, in three launches of the worker: the one-process
    runs, the sharded ones (the subprocess launcher re-runs the script for rank 1, so one
    launch holds runs of one device count), and a one-process resume from a sharded run."""
    out = tmp_path_factory.mktemp("fsdp2_lightning")
    methods, crossed = ",".join(LIGHTNING_METHODS), ",".join(CROSSED)
    one = ["--devices", "1"]
    launch(LIGHTNING_WORKER, [
        ["--methods", methods, *one],
        *(["--methods", "sam,slsam_paper", *one, *args] for args in VARIANTS.values()),
        # A checkpoint moves between one device and FSDP2: from step 4 of 8, both ways.
        ["--methods", crossed, *one, "--steps", "8", "--resume-at", "4"],
        *(["--methods", ",".join(m), *one, "--compile", form, "--steps", "8"]
          for form, m in COMPILED.items()),
    ], out)  # fmt: skip
    two = ["--devices", "2"]
    launch(LIGHTNING_WORKER, [
        ["--methods", methods, *two],
        # Lightning's default sanity check (2 batches) before the first step, then a
        # validation loop after every training step.
        ["--methods", ",".join(VALIDATED), *two, "--validate"],
        *(["--methods", "sam,slsam_paper", *two, *args] for args in VARIANTS.values()),
        ["--methods", "sam,slsam_paper", *two, "--check-masks", "--tag", "_check"],
        *(["--methods", ",".join(BFLOAT16_METHODS), *two, "--precision", p] for p in BFLOAT16),
        # 8 steps (two epochs of 4 batches), checkpointed every step; a fresh fit resumes
        # from the checkpoint of step 4. Sharded (distributed) and full checkpoints.
        *(["--methods", ",".join(RESUMED), *two, "--steps", "8", "--resume-at", "4", *extra]
          for extra in ([], ["--full-checkpoint", "--tag", "_full"])),
        ["--methods", crossed, *two, "--steps", "8", "--tag", "_from1",
         "--resume-from", str(out / "{method}_1_checkpoints" / "epoch=0-step=4.ckpt")],
        # Compiled after sharding: the blocks, or the network whole (the callback hands a
        # whole compile under layer sampling to the blocks).
        *(["--methods", ",".join(m), *two, "--compile", form, "--steps", "8"]
          for form, m in COMPILED.items()),
    ], out, timeout=1500)  # fmt: skip
    sharded = out / "{method}_2_full_checkpoints" / "epoch=0-step=4.ckpt"
    launch(LIGHTNING_WORKER, [["--methods", crossed, *one, "--steps", "8", "--tag", "_from2",
                               "--resume-from", str(sharded)]], out)  # fmt: skip
    return lambda tag: torch.load(out / f"{tag}.pt", weights_only=False)


@pytest.mark.parametrize("method", LIGHTNING_METHODS)
def test_model_parallel_strategy_equals_one_process(fits, method):
    r0, r1, one = fits(f"{method}_2_rank0"), fits(f"{method}_2_rank1"), fits(f"{method}_1_rank0")
    assert r0["sharded"] and not one["sharded"]
    assert r0["global_step"] == one["global_step"] == 3
    assert all(torch.equal(a, b) for a, b in zip(r0["masks"], r1["masks"]))
    assert all(torch.equal(a, b) for a, b in zip(r0["masks"], one["masks"]))
    diff = max((r0["weights"][k] - one["weights"][k]).abs().max().item() for k in one["weights"])
    if method == "esam":
        # Each process ranks its own samples, as under DDP: another run than one process's
        # (an update gap of 0.23 measured), its weights not held to it.
        assert diff > 0
    else:
        assert within(diff, 1e-5)


@pytest.mark.parametrize("method", VALIDATED)
def test_validation_before_and_between_steps_under_fsdp2(fits, method):
    # FSDP2 leaves the root's parameters unsharded after a forward without backward: the
    # run still trains the sharded tensors, and equals the run without validation exactly.
    plain = fits(f"{method}_2_rank0")
    for rank in (0, 1):
        run = fits(f"{method}_2_val_rank{rank}")
        assert run["sharded"] and run["global_step"] == 3
        assert run["validations"] == 4  # the sanity check, then one after each step
        assert [m.tolist() for m in run["masks"]] == [m.tolist() for m in plain["masks"]]
        for name, weight in plain["weights"].items():
            assert torch.equal(run["weights"][name], weight), name


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--methods", "slsam", "--no-shard"], ["fully_shard in configure_model"]),
    ],
)
def test_model_parallel_strategy_refuses_what_it_cannot_do(tmp_path, args, words):
    done = _lightning(*args, "--devices", "2", "--out", str(tmp_path))
    assert done.returncode != 0
    for word in words:
        assert word in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("method", ["sam", "slsam_paper"])
@pytest.mark.parametrize(("tag", "tolerance"), [("acc2", 1e-5), ("clip", 1e-5)])
def test_model_parallel_strategy_with_training_features(fits, method, tag, tolerance):
    r0, one = fits(f"{method}_2_{tag}_rank0"), fits(f"{method}_1_{tag}_rank0")
    assert r0["sharded"] and r0["global_step"] == one["global_step"] == 3
    assert all(torch.equal(a, b) for a, b in zip(r0["masks"], one["masks"]))
    diff = max((r0["weights"][k] - one["weights"][k]).abs().max().item() for k in one["weights"])
    assert within(diff, tolerance)
    if tag == "clip":  # the clipping acted (0.05 is below the gradients' norms)
        plain = fits(f"{method}_2_rank0")
        assert max((r0["weights"][k] - plain["weights"][k]).abs().max().item() for k in
                   one["weights"]) > 1e-3  # fmt: skip


@pytest.mark.parametrize("precision", BFLOAT16)
@pytest.mark.parametrize("method", BFLOAT16_METHODS)
def test_every_method_in_bfloat16_under_fsdp2(fits, method, precision):
    # The same layers on both ranks and as in float32, and float32's weights up to bfloat16.
    r0, r1 = fits(f"{method}_2_{precision}_rank0"), fits(f"{method}_2_{precision}_rank1")
    full = fits(f"{method}_2_rank0")
    assert r0["sharded"] and r0["global_step"] == 3
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert all(w.dtype == dtype for w in r0["weights"].values())
    assert all(torch.equal(a, b) for a, b in zip(r0["masks"], r1["masks"]))
    assert all(torch.equal(a, b) for a, b in zip(r0["masks"], full["masks"]))
    # float32's update up to bfloat16's rounding of it (tests/tolerance.py)
    if method not in BF16_CHANGES:
        gap = update_gap(r0["weights"], full["weights"], dict(make_mlp(seed=5).named_parameters()))
        assert within(gap, BF16_UPDATE_GAP[precision])


@pytest.mark.parametrize("method", ["sam", "slsam_paper"])
def test_check_masks_under_model_parallel_strategy(fits, method):
    # The debug mode's collective runs beside FSDP2's and changes nothing.
    checked, plain = fits(f"{method}_2_check_rank0"), fits(f"{method}_2_rank0")
    for name, weight in plain["weights"].items():
        assert torch.equal(checked["weights"][name], weight)


@pytest.mark.parametrize("checkpoint", ["", "_full"])
@pytest.mark.parametrize("method", RESUMED)
def test_resuming_under_fsdp2_equals_the_uninterrupted_run(fits, method, checkpoint):
    # S2-SAM's and LookSAM's per-tensor state is saved whole and resharded on load.
    whole = fits(f"{method}_2{checkpoint}_uninterrupted_rank0")
    for rank in (0, 1):
        again = fits(f"{method}_2{checkpoint}_resumed_rank{rank}")
        assert again["global_step"] == 8
        assert [m.tolist() for m in again["masks"]] == [m.tolist() for m in whole["masks"][4:]]
        for name, weight in whole["weights"].items():
            assert torch.equal(again["weights"][name], weight), name


@pytest.mark.parametrize(("source", "target"), [("1", "2"), ("2", "1")])
@pytest.mark.parametrize("method", CROSSED)
def test_a_checkpoint_moves_between_one_device_and_fsdp2(fits, method, source, target):
    # FSDP2's side: the resumed runs' full checkpoints.
    whole = fits(f"{method}_{source}{'_full' if source == '2' else ''}_uninterrupted_rank0")
    again = fits(f"{method}_{target}_from{source}_rank0")
    assert again["sharded"] == (target == "2") and again["global_step"] == 8
    assert [m.tolist() for m in again["masks"]] == [m.tolist() for m in whole["masks"][4:]]
    diff = max((again["weights"][k] - whole["weights"][k]).abs().max().item() for k in
               whole["weights"])  # fmt: skip
    assert within(diff, 1e-5)  # the same run, summed in another order


@pytest.mark.parametrize(
    ("form", "method"), [(form, m) for form, methods in COMPILED.items() for m in methods]
)
def test_compiled_models_under_fsdp2_match_one_process_without_recompiles(fits, form, method):
    # 8 steps, the last 4 under fail_on_recompile (the worker): no graph was traced after
    # warm-up; the compiled graphs ran in both passes of every step, as on one process.
    tag = f"{method}_{{}}_compiled_{form}_rank{{}}"
    r0, r1, one = fits(tag.format(2, 0)), fits(tag.format(2, 1)), fits(tag.format(1, 0))
    assert r0["sharded"] and not one["sharded"] and r0["global_step"] == one["global_step"] == 8
    assert all(torch.equal(a, b) for a, b in zip(r0["masks"], r1["masks"], strict=True))
    for name, weight in r0["weights"].items():  # the gathered shards, alike on both ranks
        assert torch.equal(r1["weights"][name], weight), name
    if method == "sam":  # dense: FSDP2's hooks split the whole network's graph
        assert r0["compiled_calls"] >= 2 * 8 and r0["graphs"] <= 4
    else:  # each block one layer: 3 blocks, 2 passes, 8 steps, at most 4 variants a block
        # (ESAM: a third forward for the samples' losses, and 8: its batch size varies)
        assert r0["layer_names"][:3] == ["net.blocks.0", "net.blocks.1", "net.blocks.2"]
        assert r0["compiled_calls"] == (3 * 3 * 8 if method == "esam" else 3 * 2 * 8)
        assert r0["graphs"] <= (8 if method == "esam" else 4)
        if method != "esam":
            assert (one["compiled_calls"], one["graphs"]) == (r0["compiled_calls"], r0["graphs"])
    if method != "esam":  # ESAM ranks each process's own samples: equal to DDP's (below)
        assert method == "sam" or sum(not bool(m.all()) for m in r0["masks"]) >= 4
        assert all(torch.equal(a, b) for a, b in zip(r0["masks"], one["masks"], strict=True))
        diff = max((r0["weights"][k] - one["weights"][k]).abs().max().item() for k in
                   one["weights"])  # fmt: skip
        assert within(diff, 1e-5)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_fault_on_one_rank_ends_every_rank(tmp_path, rank):
    # The rank raises inside the second pass of step 2, while the other waits in FSDP2's
    # collectives: both must end (a hang would hit the timeout) with the fault reported.
    done = _lightning("--methods", "slsam", "--devices", "2", "--steps", "6",
                      "--fail-rank", str(rank), "--out", str(tmp_path), timeout=240)  # fmt: skip
    assert done.returncode != 0
    assert f"a fault on rank {rank}" in done.stderr


def test_esam_under_fsdp2_equals_esam_under_ddp(fits, tmp_path):
    # ESAM ranks each process's own samples: the run to equal is DDP's on the same data
    # (both workers: the same model, seeds, 16-sample global batches split the same way),
    # eager and on compiled blocks.
    fork = ["--methods", "esam", "--devices", "2", "--strategy", "ddp_fork"]
    launch(os.path.join(TESTS, "ddp_worker.py"),
           [fork, [*fork, "--compile", "--steps", "8"]], tmp_path)  # fmt: skip
    for fsdp2_tag, ddp_tag in (("esam_2", "esam_ddp_fork_2"),
                               ("esam_2_compiled_blocks", "esam_ddp_fork_2_compiled")):  # fmt: skip
        fsdp2 = fits(f"{fsdp2_tag}_rank0")
        reference = torch.load(tmp_path / f"{ddp_tag}_rank0.pt", weights_only=False)
        assert [m.tolist() for m in fsdp2["masks"]] == [m.tolist() for m in reference["masks"]]
        assert len(fsdp2["masks"]) == reference["global_step"]
        for name, weight in reference["weights"].items():
            assert within((fsdp2["weights"][name] - weight).abs().max(), 1e-5), name
