"""Plan-quality regression: no case's predicted throughput may move more than 1% from the golden file, in
either direction (a plan that got slower is a planner regression; one that got faster is a cost-model change
whose new predictions must be reviewed), and no plan may lose to a baseline.

Regenerate the golden file with `python scripts/update_golden.py` and review its diff in the commit."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import update_golden  # noqa: E402

GOLDEN = json.loads(update_golden.GOLDEN.read_text())


@pytest.mark.parametrize("model,cluster,batch", update_golden.CASES,
                         ids=[update_golden.case_key(*c) for c in update_golden.CASES])
def test_plan_matches_golden_throughput_and_beats_every_baseline(model, cluster, batch):
    got = update_golden.run_case(model, cluster, batch)
    want = GOLDEN[update_golden.case_key(model, cluster, batch)]["tokens_per_s"]
    assert got["tokens_per_s"] >= 0.99 * want, f"{got['tokens_per_s']:,.0f} tokens/s < golden {want:,.0f}"
    assert got["tokens_per_s"] <= 1.01 * want, (f"{got['tokens_per_s']:,.0f} tokens/s > golden {want:,.0f}: the "
                                                "prediction moved; review it and regenerate the golden file")
    for name, tps in got["baselines"].items():
        if tps is not None:
            assert got["tokens_per_s"] >= 0.999 * tps, f"loses to baseline {name}: {tps:,.0f}"
