"""The single-GPU plans committed for `scripts/gpu_check.py` (benchmarks/gpu_plans/) are the ones this autoshard
makes: a cost-model change that moves their predictions must regenerate them (`gpu_check.py --make-plans`),
or the GPU check would compare measurements with stale figures."""

from pathlib import Path

import pytest

from autoshard.plans.plan import Plan
from autoshard.validation.gpu_check import GPU_CLUSTER, GPU_RUNS, PLANS_DIR, make_plans

pytestmark = pytest.mark.slow


def test_every_committed_gpu_plan_is_what_make_plans_writes_now(tmp_path):
    fresh = make_plans(GPU_RUNS, GPU_CLUSTER, tmp_path)
    assert sorted(p.name for p in fresh) == sorted(p.name for p in Path(PLANS_DIR).glob("*.json"))
    for path in fresh:
        now, committed = Plan.load(path), Plan.load(PLANS_DIR / path.name)
        assert committed.fingerprint == now.fingerprint, path.name
        assert committed.prediction.iteration_time_s == pytest.approx(now.prediction.iteration_time_s, rel=1e-9), \
            f"{path.name}: regenerate with `python scripts/gpu_check.py --make-plans`"
        assert committed.prediction.memory.total_bytes == pytest.approx(now.prediction.memory.total_bytes, rel=1e-9)
