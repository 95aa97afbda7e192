"""Plan-quality regression: no case's predicted throughput may move more than 1% from the golden file, in
either direction (a plan that got slower is a planner regression; one that got faster is a cost-model change
whose new predictions must be reviewed), and no plan may lose to a baseline.

Regenerate the golden file with `python scripts/update_golden.py` and review its diff in the commit."""

import json

import pytest

from autoshard.validation import golden as update_golden

GOLDEN = json.loads(update_golden.GOLDEN.read_text())


# the long suite's (`-m long`): the cases whose planning takes longest on two cores; `autoshard-golden --check`
# (scripts/update_golden.py) still runs every case
LONG = {"llama3-8b|8x8xH100-80GB|64|seq131072", "bert-large|2x8xA100-80GB|256", "llama3-70b|8x8xH100-80GB|512",
        "gpt3-175b|128x8xA100-80GB|1536", "gpt3-175b|16x8xA100-80GB|256", "gpt-7.5b|4x8xV100-32GB|256",
        "gpt2-xl|1x8xA100-80GB|128"}


@pytest.mark.parametrize("model,cluster,batch,seq", [
    pytest.param(*c, id=update_golden.case_key(*c),
                 marks=[pytest.mark.long] if update_golden.case_key(*c) in LONG else [])
    for c in update_golden.CASES])
def test_plan_matches_golden_throughput_and_beats_every_baseline(model, cluster, batch, seq):
    got = update_golden.run_case(model, cluster, batch, seq)
    want = GOLDEN[update_golden.case_key(model, cluster, batch, seq)]["tokens_per_s"]
    assert got["tokens_per_s"] >= 0.99 * want, f"{got['tokens_per_s']:,.0f} tokens/s < golden {want:,.0f}"
    assert got["tokens_per_s"] <= 1.01 * want, (f"{got['tokens_per_s']:,.0f} tokens/s > golden {want:,.0f}: the "
                                                "prediction moved; review it and regenerate the golden file")
    for name, tps in got["baselines"].items():
        if tps is not None:
            assert got["tokens_per_s"] >= 0.999 * tps, f"loses to baseline {name}: {tps:,.0f}"


def test_the_grid_baseline_offers_only_pipeline_schedules_the_runtime_runs():
    """A 76B GPT on 1,024 A100s at global batch 1,792 (Narayanan et al. Table 1): pp=2 x dp=128 x tp=4 with 2
    samples per micro-batch leaves 7 micro-batches, which torch's interleaved 1F1B cannot run over 2 stages
    (7 is not a multiple of 7 // 2). The planner never offers it; the grid baseline used to, and then beat the plan."""
    import re

    from autoshard.api import capture_ref
    from autoshard.hardware_profiles.cluster import ClusterSpec
    from autoshard.planner.baselines import compute_baselines
    from autoshard.plans.contract import schedule_blocker

    cluster = ClusterSpec.parse("128x8xA100-80GB")
    graph = capture_ref("gpt:layers=60,hidden=10240,heads=80,seq=2048,vocab=51200")
    grid = compute_baselines(graph, cluster, global_batch=1792, cap_bytes=cluster.device_memory_bytes,
                             names=("grid",))["grid"]
    pp = int(re.search(r"pp=(\d+)", grid.config)[1])
    m = int(re.search(r"x (\d+) micro-batch", grid.config)[1]) if " x " in grid.config.split("micro-batch")[1] \
        else 1
    schedule = "interleaved-1f1b" if "interleaved" in grid.config else "1f1b"
    assert pp == 1 or schedule_blocker(schedule, pp, m) is None, grid.config
