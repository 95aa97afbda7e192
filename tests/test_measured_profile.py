"""scripts/validate_measured.py prices plans on the median of several profile rounds: one slow minute on a shared
machine moved a single round's host costs by 50-70% and every prediction with them."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import validate_measured  # noqa: E402


def _round(gemm, fsdp, curve_bw, source):
    return {"gpu": {"peak_tflops": gemm, "fsdp_us_per_module": fsdp, "gemm_tflops": [[64, 64, 64, gemm / 2]],
                    "sources": {"peak_tflops": source}},
            "intra": {"busbw_curve": {"all_reduce": [{"ranks": 2, "points": [[4096, curve_bw], [65536, 2 * curve_bw]]}]}}}


def test_profile_rounds_merge_to_the_median_of_every_number_keeping_curve_sizes_and_text():
    rounds = [_round(0.09, 800.0, 0.1, "round 1"), _round(0.08, 1300.0, 0.3, "round 2"),
              _round(0.085, 900.0, 0.2, "round 3")]
    merged = validate_measured.median_profile(rounds)
    assert merged["gpu"]["peak_tflops"] == 0.085 and merged["gpu"]["fsdp_us_per_module"] == 900.0
    assert merged["gpu"]["gemm_tflops"] == [[64, 64, 64, 0.0425]]
    points = merged["intra"]["busbw_curve"]["all_reduce"][0]["points"]
    assert [p[0] for p in points] == [4096, 65536] and points[0][1] == 0.2 and points[1][1] == pytest.approx(0.4)
    assert merged["gpu"]["sources"]["peak_tflops"] == "round 1"


def test_profile_rounds_of_different_shapes_are_refused():
    a, b = _round(0.09, 800.0, 0.1, "a"), _round(0.08, 900.0, 0.2, "b")
    b["gpu"]["gemm_tflops"].append([256, 256, 256, 0.09])
    with pytest.raises(ValueError, match="differ in shape"):
        validate_measured.median_profile([a, b])
