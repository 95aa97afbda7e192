"""`train_step`, `measure` and `profile` on ranks whose tensors are not on the default device (strict_device.py):
what a GPU machine does to them (CUDA tensors, NCCL, a CPU default), on gloo ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from dist_harness import run_world
from strict_device import ranks_off_the_default_device

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning"),
              # torch <= 2.12's AdamW makes its step counter on the default device (torch/optim/adam.py), which
              # these tests make `meta`: that is torch's, and on a GPU harmless (the default is the CPU there)
              pytest.mark.skipif(tuple(int(x) for x in __import__("torch").__version__.split(".")[:2]) < (2, 13),
                                 reason="torch < 2.13 creates AdamW's step on the default device")]

MODEL = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"


def _plan(tmp_path, name: str, *options: str) -> str:
    path = tmp_path / f"{name}.json"
    subprocess.run([sys.executable, "-m", "autoshard.cli", "estimate", MODEL, "--cluster", "1x2xcpu",
                    "--global-batch", "4", "--micro-batch", "1", *options, "-o", str(path)],
                   check=True, capture_output=True, text=True, timeout=300)
    return str(path)


def _measure(rank: int, world: int, plans: list[str]) -> list[float]:
    from autoshard.measure.step import measure_plan
    from autoshard.plans.plan import Plan

    out = []
    for path in plans:
        with ranks_off_the_default_device():
            out.append(measure_plan(Plan.load(path), cluster=f"1x{world}xcpu", steps=2, warmup=1).step.median_s)
    return out


@pytest.mark.timeout(480)
def test_measure_of_micro_batches_and_of_a_pipeline_runs_on_ranks_off_the_default_device(tmp_path):
    # dp=2: two micro-batches per rank, whose losses train_step sums; pp=2: the first stage holds no loss
    plans = [_plan(tmp_path, "dp2", "--dp", "2"), _plan(tmp_path, "pp2", "--pp", "2", "--schedule", "1f1b")]
    medians = run_world(_measure, 2, plans, timeout_s=420)[0]
    assert len(medians) == 2 and all(m > 0 for m in medians)


def _profile(rank: int, world: int) -> dict:
    from autoshard.measure.profile import profile_cluster

    with ranks_off_the_default_device():
        return profile_cluster(quick=True)


@pytest.mark.timeout(300)
def test_profile_on_one_rank_off_the_default_device_writes_a_cluster_file_with_its_built_in_links(tmp_path):
    from autoshard.hardware_profiles import ClusterSpec

    data = run_world(_profile, 1, timeout_s=280)[0]
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(data))
    cluster = ClusterSpec.parse(str(path))
    assert cluster.num_gpus == 1 and cluster.gpu.gemm_tflops
    assert cluster.gpu.overlap_slowdown == 1.0  # nothing runs beside compute on one rank
    assert (cluster.intra.name, cluster.inter.name) == ("loopback", "loopback-net")
    assert cluster.gpu.fsdp_us_per_module >= 0 and cluster.gpu.optimizer_us_per_tensor > 0
