"""The eager-against-compiled step-time benchmark (benchmarks/compile_step_time.py), run on a
tiny Llama with the aot_eager backend: every method timed both ways, the compile counted in
warm-up and none after it, the compiled layer-sampling engines drawing whole blocks."""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import compile_step_time as bench  # noqa: E402
import models  # noqa: E402

#: The paper's SL-SAM and SparseLayerSAM() (until 0.3 named "slsam" and "slsam_default").
METHODS = ["adamw", "sam", "slsam_paper", "slsam"]


def tiny_llama(count: int, device: str) -> models.Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=16, tie_word_embeddings=True,
                         use_cache=False)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 64, (4, 16), generator=gen).to(device)}
               for _ in range(count)]  # fmt: skip
    return models.Workload("tiny", LlamaForCausalLM(config).to(device).train(), batches,
                           models._causal_lm_loss, "tiny Llama (3 layers)")  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "bench"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(models.WORKLOADS, "tiny", tiny_llama)
        argv = ["--models", "tiny", "--methods", ",".join(METHODS), "--backend", "aot_eager",
                "--steps", "2", "--warmup", "4", "--threads", "1", "--out", str(out)]  # fmt: skip
        returned = bench.main(argv)
    with open(f"{out}.json") as handle:
        saved = json.load(handle)
    with open(f"{out}.md") as handle:
        table = handle.read()
    return returned, saved, table


def test_every_method_is_timed_eager_and_compiled(run):
    _, saved, _ = run
    rows = saved["models"]["tiny"]["methods"]
    assert list(rows) == METHODS
    for name, row in rows.items():
        for kind in ("eager", "compiled"):
            assert len(row[kind]["samples"]) == 2, (name, kind)
            assert row[kind]["median_s"] > 0 and len(row[kind]["warmup_s"]) == 4
        assert row["speedup"] == pytest.approx(
            row["eager"]["median_s"] / row["compiled"]["median_s"]
        )
        assert row["ratio_to_sam"]["compiled"] == pytest.approx(
            row["compiled"]["median_s"] / rows["sam"]["compiled"]["median_s"]
        )
    assert rows["sam"]["ratio_to_sam"] == {"eager": 1.0, "compiled": 1.0}
    assert saved["backend"] == "aot_eager" and saved["machine"]["cpu_threads"] == 1
    assert "--backend aot_eager" in saved["command"]


def test_graphs_are_compiled_in_warm_up_and_none_while_timed(run):
    _, saved, _ = run
    data = saved["models"]["tiny"]
    assert data["compiled_blocks"] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    for name, row in data["methods"].items():
        assert row["compiled"]["graphs_warmup"] > 0, name
        assert row["compiled"]["graphs_timed"] == 0, name
        # torch's compile timers ran within the warm-up (its wall time bounds them).
        assert 0 < row["compiled"]["compile_s"] < sum(row["compiled"]["warmup_s"]), name
    assert data["compile_timed_s"] == 0
    # A layer-sampling step meets its blocks trainable and frozen: more graph variants
    # than AdamW's single (trainable, input needs a gradient) one.
    assert data["methods"]["adamw"]["compiled"]["graphs_warmup"] == 1
    assert data["methods"]["slsam_paper"]["compiled"]["graphs_warmup"] > 1
    assert saved["recompile_limit_hits"] == []


def test_compiled_sampling_draws_whole_blocks(run):
    _, saved, _ = run
    rows = saved["models"]["tiny"]["methods"]
    assert rows["adamw"]["eager"]["layer_names"] is None
    for name in ("slsam_paper", "slsam"):
        eager, compiled = rows[name]["eager"], rows[name]["compiled"]
        assert "model.layers.0" in compiled["layer_names"], name
        assert "model.layers.0" not in eager["layer_names"]
        assert "model.layers.0.self_attn.q_proj.weight" in eager["layer_names"]
        assert compiled["num_layers"] < eager["num_layers"]
        for kind in (eager, compiled):
            assert 0 < kind["active_ratio"] < 2, name  # sparse: SAM's two full passes are 2
    for kind in ("eager", "compiled"):
        assert rows["sam"][kind]["active_ratio"] == pytest.approx(2.0)


def test_report_has_every_method_row_and_the_checks(run):
    returned, saved, table = run
    assert returned["checks"] == saved["checks"]
    for name in METHODS:
        assert f"\n| {name} | " in table
    checks = {row["check"]: row for row in saved["checks"]}
    speed = "tiny: compiled SL-SAM >= 1.2x faster than eager SL-SAM"
    ratio = "tiny: compiled SL-SAM/SAM <= eager SL-SAM/SAM + 0.05"
    row = saved["models"]["tiny"]["methods"]["slsam_paper"]
    assert checks[speed]["met"] == (row["speedup"] >= 1.2)
    r = row["ratio_to_sam"]
    assert checks[ratio]["met"] == (r["compiled"] <= r["eager"] + 0.05)
    assert f"| {speed} |" in table and f"| {ratio} |" in table
    assert "Compile time" in table and f"torch {torch.__version__}" in table
    assert "tiny: compiled SparseLayerSAM() >= 1.2x" in table


def test_a_recompile_limit_hit_is_caught_not_hidden():
    limits = bench.LimitHits()
    limits.where = "probe"
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(limits)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x * 2, backend="eager")
    try:
        with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
            for size in (2, 3, 4):  # each shape a new graph: the second one hits the limit
                fn(torch.ones(size))
    finally:
        logger.removeHandler(limits)
        torch._dynamo.reset()
    assert limits.hits and limits.hits[0].startswith("probe: torch._dynamo hit config.")
