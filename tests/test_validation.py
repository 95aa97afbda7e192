"""The cost model against published training runs and memory figures (benchmarks/published_validation.md).

Two kinds of check, so that a wrong cost model fails here in either direction:
- every dev group's error and mean signed error stay within the bounds below (the figures of
  benchmarks/published_validation.md plus 1.5 points: a regression bar, not the issue's target; the note on
  issue 14 says which groups miss the target and why);
- every published configuration's predicted iteration time stays within 2% of the prediction recorded in
  benchmarks/published_validation.json, so a change that moves predictions (faster or slower) shows up and
  is reviewed by regenerating that file (`python scripts/validate_published.py`).
"""

import filecmp
import json
from pathlib import Path

import pytest

from autoshard.validation import published as vp

ROOT = Path(__file__).resolve().parent.parent

RECORDED = json.loads((ROOT / "benchmarks" / "published_validation.json").read_text())

# group -> (MAPE bound %, |mean signed error| bound %)
GROUP_BOUNDS = {
    "ptdp21_t1": (7.1, 3.4),
    "kor22_t5": (4.4, 4.3),
    "kor22": (3.7, 3.7),
    "mpt": (7.0, 5.0),
    "ttdoc_a100_llama3": (5.5, 4.3),
    "ttdoc_a100_llama2": (4.4, 4.2),
}


@pytest.fixture(scope="module")
def time_rows():
    return vp.time_rows(as_run=False)


def test_every_published_row_that_states_its_configuration_is_predicted(time_rows):
    failed = [r for r in time_rows if "failure" in r]
    assert not failed, failed
    assert {r["group"] for r in time_rows if r.get("error_pct") is not None} == set(GROUP_BOUNDS)


@pytest.mark.parametrize("group", sorted(GROUP_BOUNDS))
def test_each_dev_group_error_and_bias_stay_within_bounds(time_rows, group):
    g = vp.groups(time_rows)[group]
    max_mape, max_bias = GROUP_BOUNDS[group]
    assert g["mape"] <= max_mape, g
    assert abs(g["signed"]) <= max_bias, g


def test_predictions_of_published_configurations_match_the_recorded_ones(time_rows):
    recorded = {r["id"]: r["predicted_s"] for r in RECORDED["time"] if r.get("predicted_s")}
    got = {r["id"]: r["predicted_s"] for r in time_rows if r.get("predicted_s")}
    assert set(got) == set(recorded)
    moved = {k: f"{got[k]:.3f} s vs recorded {recorded[k]:.3f} s" for k in got
             if abs(got[k] / recorded[k] - 1) > 0.02}
    assert not moved, moved


def test_one_22b_layer_with_megatrons_engine_takes_korthikanti_table4s_forward_and_backward_time():
    """Korthikanti et al. 2022 Table 4 measured one 22B layer on 8 A100s in five recompute / sequence-parallel
    modes; priced with the engine they ran (materialized attention, fused kernels, asynchronous backward
    tensor-parallel communication) every forward and backward comes within 5% and every layer within 4%."""
    rows = [r for r in vp.table4_rows() if r["engine"] == "Megatron-LM's engine"]
    assert len(rows) == len(vp.TABLE4)
    for r in rows:
        assert abs(r["error_pct"]) <= 4.0, r
        assert r["predicted_fwd_ms"] == pytest.approx(r["published_fwd_ms"], rel=0.05), r
        assert r["predicted_bwd_ms"] == pytest.approx(r["published_bwd_ms"], rel=0.05), r


def test_published_memory_is_predicted_within_10_percent():
    rows = vp.memory_rows()
    assert len(rows) == 16
    for r in rows:
        assert abs(r["error_pct"]) <= 10.0, r


def test_vendored_tool_and_rows_are_the_shared_ones():
    shared = ROOT.parent / "shared"
    if not (shared / "tools" / "published.py").exists():
        pytest.skip("no ../shared next to this checkout (the team's reference tables and tool): the vendored "
                    "copies in references/ are not compared with them")
    assert filecmp.cmp(shared / "tools" / "published.py", vp.TOOL_PATH, shallow=False)
    assert filecmp.cmp(shared / "references" / "published_runs.csv", vp.RUNS, shallow=False)
