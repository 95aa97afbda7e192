"""The cost model against published training runs and memory figures (benchmarks/published_validation.md)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import validate_published as vp  # noqa: E402


@pytest.fixture(scope="module")
def time_rows():
    return vp.time_rows(("ptdp21_t1_", "kor22_", "mpt_"))


def test_published_runs_are_predicted_within_10_percent_mape(time_rows):
    assert all(r.get("error_pct") is not None for r in time_rows), [r for r in time_rows if "failure" in r]
    assert vp.mape(time_rows) <= 10.0


def test_megatron_runs_are_predicted_within_8_percent_mape(time_rows):
    assert vp.mape(time_rows, "ptdp21_t1_") <= 8.0 and vp.mape(time_rows, "kor22_") <= 8.0


def test_published_memory_is_predicted_within_10_percent():
    rows = vp.memory_rows()
    assert len(rows) == 16
    for r in rows:
        assert abs(r["error_pct"]) <= 10.0, r


def test_row_conversion_agrees_with_the_shared_tool():
    shared = ROOT.parent / "shared" / "tools" / "published.py"
    if not shared.exists():
        pytest.skip("shared/tools/published.py is not beside this checkout")
    spec = importlib.util.spec_from_file_location("published_tool", shared)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    import csv

    for row in csv.DictReader(vp.RUNS.open()):
        try:
            want = (tool.measured_seconds(row), tool.estimate_args(row))
        except ValueError:
            continue
        assert (vp.measured_seconds(row), vp.estimate_args(row)) == want
