"""`autoshard profile --rounds N` and scripts/validate_measured.py write the median of several profile rounds: one
slow minute on a shared machine moved a single round's host costs by 50-70% and every prediction with them."""

import subprocess
import sys

import pytest

from autoshard.measure.profile import median_profile


def _round(gemm, fsdp, curve_bw, source):
    return {"gpu": {"peak_tflops": gemm, "fsdp_us_per_module": fsdp, "gemm_tflops": [[64, 64, 64, gemm / 2]],
                    "sources": {"peak_tflops": source}},
            "intra": {"busbw_curve": {"all_reduce": [{"ranks": 2, "points": [[4096, curve_bw], [65536, 2 * curve_bw]]}]}}}


def test_profile_rounds_merge_to_the_median_of_every_number_keeping_curve_sizes_and_text():
    rounds = [_round(0.09, 800.0, 0.1, "round 1"), _round(0.08, 1300.0, 0.3, "round 2"),
              _round(0.085, 900.0, 0.2, "round 3")]
    merged = median_profile(rounds)
    assert merged["gpu"]["peak_tflops"] == 0.085 and merged["gpu"]["fsdp_us_per_module"] == 900.0
    assert merged["gpu"]["gemm_tflops"] == [[64, 64, 64, 0.0425]]
    points = merged["intra"]["busbw_curve"]["all_reduce"][0]["points"]
    assert [p[0] for p in points] == [4096, 65536] and points[0][1] == 0.2 and points[1][1] == pytest.approx(0.4)
    assert merged["gpu"]["sources"]["peak_tflops"] == "round 1"
    # whole numbers stay whole with an even number of rounds (a cluster file's node count is an int)
    assert median_profile([{"nodes": 1, "x": 1.0}, {"nodes": 1, "x": 2.0}]) == {"nodes": 1, "x": 1.5}
    assert isinstance(median_profile([{"n": 2}, {"n": 4}])["n"], int)


def test_profile_rounds_of_different_shapes_are_refused():
    a, b = _round(0.09, 800.0, 0.1, "a"), _round(0.08, 900.0, 0.2, "b")
    b["gpu"]["gemm_tflops"].append([256, 256, 256, 0.09])
    with pytest.raises(ValueError, match="differ in shape"):
        median_profile([a, b])


def test_profile_rounds_must_be_positive_and_say_so_before_anything_runs(tmp_path):
    out = subprocess.run([sys.executable, "-m", "autoshard.cli", "profile", "-o", str(tmp_path / "c.yaml"),
                          "--rounds", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == "autoshard: error: --rounds must be a positive integer, got 0"
    assert not (tmp_path / "c.yaml").exists()
