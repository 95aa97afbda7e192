"""`autoshard check MODEL --against plan.json`: a committed plan as a CI regression bar (autoshard/check.py)."""

import json
import subprocess
import sys

import pytest

from autoshard.check import assert_plan_holds, check_plan, parse_tolerance

MODEL = "llama:layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=1024,seq=256"
DEEPER = MODEL.replace("layers=2", "layers=6")
CLUSTER = "1x4xH100-80GB"  # planning the tiny model on 4 GPUs takes half the time of 8


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoshard.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("check") / "plan.json"
    out = _cli("plan", MODEL, "--cluster", CLUSTER, "--global-batch", "16", "-o", str(path), "--quiet")
    assert out.returncode == 0, out.stderr
    return str(path)


def test_the_unchanged_model_passes_with_exit_0_and_says_nothing_changed(committed):
    out = _cli("check", MODEL, "--against", committed)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "nothing changed in the plan" in out.stdout and "OK" in out.stdout


def test_a_model_with_more_layers_fails_with_exit_1_and_the_diff(committed):
    out = _cli("check", DEEPER, "--against", committed, "--json")
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)  # only JSON on stdout
    assert not report["ok"] and report["throughput_change"] < -0.02
    assert any("throughput" in f for f in report["failures"])
    assert any(c.startswith("ops: ") and "new" in c for c in report["changes"])  # the graph grew


def test_a_smaller_memory_cap_fails_when_the_plan_it_forces_is_slower(tmp_path):
    wide = "llama:layers=4,hidden=2048,heads=16,kv_heads=4,ffn=5632,vocab=32000,seq=2048"  # ~9.5 GiB a GPU
    path = tmp_path / "wide.json"
    assert _cli("plan", wide, "--cluster", "1x8xH100-80GB", "--global-batch", "32", "-o", str(path), "--quiet").returncode == 0
    result = check_plan(wide, path, memory_cap=3.0)
    assert result.current is not None and not result.ok
    assert result.current.prediction.memory.total_bytes <= 3.0 * 2**30 < result.committed.prediction.memory.total_bytes
    assert any(c.startswith(("micro-batch", "recompute", "strategy")) for c in result.changes())


def test_nothing_fitting_any_more_fails_and_names_the_smallest_plan(committed):
    out = _cli("check", MODEL, "--against", committed, "--memory-cap", "0.05")
    assert out.returncode == 1
    assert "no plan fits any more" in out.stdout and "the smallest plan needs" in out.stdout


def test_assert_plan_holds_raises_with_the_report_for_a_test(committed):
    assert assert_plan_holds(MODEL, committed).ok
    with pytest.raises(AssertionError, match="FAILED: predicted throughput"):
        assert_plan_holds(DEEPER, committed)


def test_a_plan_written_by_estimate_is_refused_with_the_command_that_writes_a_planner_plan(tmp_path):
    path = tmp_path / "estimated.json"
    assert _cli("estimate", MODEL, "--cluster", CLUSTER, "--global-batch", "16", "-o", str(path)).returncode == 0
    out = _cli("check", MODEL, "--against", str(path))
    assert out.returncode == 2 and "autoshard plan" in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("text,want", [("2%", 0.02), ("0.05", 0.05), ("0", 0.0)])
def test_tolerance_is_a_fraction_or_a_percentage(text, want):
    assert parse_tolerance(text) == pytest.approx(want)


def test_a_bad_tolerance_is_one_line_and_exit_2(committed):
    out = _cli("check", MODEL, "--against", committed, "--tolerance", "lots")
    assert out.returncode == 2 and "--tolerance" in out.stderr and len(out.stderr.strip().splitlines()) == 1
