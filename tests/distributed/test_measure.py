"""`autoshard measure` end to end: a plan file from `estimate`, run under torchrun on 2 gloo ranks with the
measured CPU profile, prints one JSON document with the measured step beside the prediction."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_harness import run_torchrun

pytestmark = [pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "benchmarks" / "measured" / "cpu2.yaml"


def test_measure_runs_a_plan_on_two_ranks_and_reports_measured_beside_predicted(tmp_path):
    plan = tmp_path / "plan.json"
    model = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"
    subprocess.run([sys.executable, "-m", "autoshard.cli", "estimate", model, "--cluster", str(PROFILE),
                    "--dp", "2", "--micro-batch", "2", "--global-batch", "4", "--zero", "3", "-o", str(plan)],
                   check=True, capture_output=True, text=True, timeout=300)
    out, logs = run_torchrun(["measure", str(plan), "--steps", "3", "--warmup", "1", "--json"], nproc=2,
                             workdir=tmp_path)
    assert out.returncode == 0, logs
    report = json.loads(out.stdout)  # only JSON on stdout, from rank 0 only
    assert report["world_size"] == 2 and report["predicted_s"] > 0
    step = report["step"]
    assert len(step["steps_s"]) == 3 and all(s > 0 for s in step["steps_s"])
    assert min(step["steps_s"]) <= step["median_s"] <= max(step["steps_s"])
    assert report["error_pct"] == (report["predicted_s"] - step["median_s"]) / step["median_s"] * 100


@pytest.mark.long
def test_profile_quick_on_two_ranks_writes_the_median_of_its_rounds_and_measures_attention_and_dtensor_costs(
        tmp_path):
    out_file = tmp_path / "cluster.yaml"
    run, logs = run_torchrun(["profile", "--quick", "--rounds", "2", "-o", str(out_file)], nproc=2, workdir=tmp_path)
    assert run.returncode == 0, logs
    from autoshard.hardware_profiles import ClusterSpec
    from autoshard.measure.profile import ATTENTION_SEQS

    cluster = ClusterSpec.parse(str(out_file))
    gpu = cluster.gpu
    assert cluster.num_gpus == 2 and gpu.device == "cpu" and gpu.gemm_tflops
    # the causal kernel measured at each --quick length, every point a fraction of peak
    assert [s for s, _ in gpu.flash_attention_by_seq] == list(ATTENTION_SEQS[("cpu", True)])
    assert all(0 < e <= 1 for _, e in gpu.flash_attention_by_seq)
    # two rounds, each number their median, and every measured figure says so
    assert all(s.endswith("(median of 2 rounds)") for s in gpu.sources.values() if s.startswith("measured"))
    assert cluster.intra.sources["busbw_curve"].endswith("(median of 2 rounds)")
    # DTensor's costs, which tensor-parallel and pipelined-SPMD plans pay: per op of a block, and per
    # redistribute kind on the 2-rank tp group
    assert gpu.dtensor_us_per_op > 0
    assert {k: [r for r, _ in v] for k, v in cluster.intra.redistribute_us.items()} == {
        "all_gather": [2], "all_reduce": [2], "reduce_scatter": [2]}
    est = subprocess.run([sys.executable, "-m", "autoshard.cli", "estimate",
                          "gpt:layers=2,hidden=64,heads=4,seq=256,vocab=128,attn=flash", "--cluster", str(out_file),
                          "--dp", "2", "--micro-batch", "1", "--global-batch", "2", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert est.returncode == 0, est.stderr[-2000:]
    assert json.loads(est.stdout)["iteration_time_s"] > 0


@pytest.mark.long
def test_a_plan_for_more_ranks_than_the_job_has_prints_its_error_once(tmp_path):
    plan = tmp_path / "plan4.json"
    subprocess.run([sys.executable, "-m", "autoshard.cli", "estimate", "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128",
                    "--cluster", "1x4xcpu", "--dp", "4", "--global-batch", "4", "-o", str(plan)],
                   check=True, capture_output=True, text=True, timeout=300)
    out, logs = run_torchrun(["measure", str(plan), "--steps", "1", "--warmup", "0"], nproc=2, workdir=tmp_path,
                             attempts=1)
    assert out.returncode != 0
    assert logs.count("the cluster has 4 devices") == 1, logs  # rank 0's one line; rank 1 says nothing
