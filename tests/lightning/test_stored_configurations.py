"""Each SAM callback configuration of the committed result configs trains what it trained.

``tests/fixtures/saved_configs.pt`` holds, for each distinct SAM callback entry of the
committed configs, what the code of commit f94ff83 trained on a small MLP
(``tests/fixtures/make_saved_config_runs.py``, made on another machine);
``stored_configurations.json`` (beside this file) holds each entry as today's options
write it. Today's callback must draw the same layers (the counts exactly) and train to the
same weights up to the rounding of this machine's kernels (tests/tolerance.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_mlp
from tolerance import STORED_PROBS, assert_matches_stored, load_stored, plain, stored_run_tolerance

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))

from make_saved_config_runs import FIXTURE, train  # noqa: E402

pytestmark = pytest.mark.kernels  # stored references: run again under other kernels

RUNS = load_stored(FIXTURE, weights_only=False)
TODAY = json.loads((Path(__file__).parent / "stored_configurations.json").read_text())


def test_every_stored_configuration_has_its_entry_of_today():
    assert len(TODAY) == 40 and set(TODAY) <= set(RUNS)


@pytest.mark.parametrize("name", sorted(TODAY), ids=lambda k: TODAY[k]["file"])
def test_a_configuration_trains_what_it_trained(name):
    run, entry = RUNS[name], TODAY[name]["entry"]
    got = train(entry)
    assert torch.equal(got["counts"], run["counts"]), run["file"]  # the same draws, exactly
    # Weights within 1e-5 + 1e-4 * |w| (LookSAM: 1e-4 + 1e-3 * |w|), probabilities within
    # 1e-7: the rounding of another machine's kernels (measured in tests/tolerance.py).
    tolerance = stored_run_tolerance(entry["class_path"])
    assert_matches_stored(got["weights"], run["weights"], **tolerance, what=run["file"])
    assert_matches_stored(got["probs"], run["probs"], **STORED_PROBS, what=run["file"])
    # The comparison can fail: the run moved its weights 10 times farther than the tolerance.
    start = dict(make_mlp(seed=0).named_parameters())
    moved = max(float((plain(w) - start[n.removeprefix("net.")]).abs().max())
                for n, w in run["weights"].items())  # fmt: skip
    assert moved > 10 * tolerance["atol"], run["file"]
