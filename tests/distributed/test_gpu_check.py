"""`scripts/gpu_check.py --cpu`: the one-GPU truth loop's script, run end to end on one CPU rank with tiny models,
in an environment like the GPU image's (no `pulp`, no `highspy`: measuring must not need the solver)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]


# the quick suite measures the plan the hand-written loop also runs and the MoE one; the long suite all five
QUICK = ("tiny-llama-none-mb1x2", "tiny-moe-none-mb1x2")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("only", [pytest.param(QUICK, id="two-plans"), pytest.param((), id="every-plan",
                                                                                    marks=pytest.mark.long)])
def test_gpu_check_cpu_profiles_measures_every_plan_and_times_the_hand_written_loop_without_a_solver(tmp_path, only):
    from autoshard.validation.gpu_check import CPU_RUNS

    runs = [r for r in CPU_RUNS if not only or r.name in only]

    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['pulp'] = None\nsys.modules['highspy'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--cpu", "--out", str(out),
                           *(["--only", *only] if only else []), "--trace", "tiny-llama-none-mb1x2"],
                          capture_output=True, text=True, timeout=880, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_validation.json").read_text())
    assert report["profile"]["ok"] and (out / "profile.yaml").exists()
    assert [r["run"] for r in report["plans"]] == [r.name for r in runs]
    for row in report["plans"]:
        assert row["ok"] and row["measured_s"] > 0 and row["predicted_s"] > 0 and row["profiled_predicted_s"] > 0
    assert [(r["compile"], r["ok"]) for r in report["reference"]] == [(False, True), (True, True)]
    assert report["time_mape_pct"] is not None
    text = (out / "gpu_validation.md").read_text()
    assert all(r.name in text for r in runs) and "blocks compiled" in text
    trace = json.loads((out / "trace-tiny-llama-none-mb1x2.json").read_text())  # the one plan asked to profile a step
    assert trace["top_host_ops"] and trace["wall_s"] > 0 and not (out / "trace-tiny-moe-none-mb1x2.json").exists()
