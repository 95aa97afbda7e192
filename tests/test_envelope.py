"""Predictions beyond what published runs reached are flagged beside the figure (REFERENCES.md §8)."""

import json
import subprocess
import sys

from autoshard.planner.envelope import (
    LARGEST_SHARDED_RUN,
    LONG_SEQUENCE,
    PUBLISHED_MFU,
    ceiling,
    envelope_warnings,
    gpu_family,
    sequence_warnings,
    sharding_warnings,
)


def test_mfu_above_the_best_published_run_on_its_gpu_is_flagged_and_names_the_run():
    (line,) = envelope_warnings(0.677, "A100-80GB")
    assert "67.7%" in line and "64.2%" in line and "MPT-7B" in line
    assert envelope_warnings(ceiling("A100").mfu, "A100-40GB") == []
    assert envelope_warnings(0.50, "H100-80GB") and not envelope_warnings(0.45, "H100-80GB")


def test_the_ceiling_is_the_best_published_run_on_at_least_as_many_gpus():
    assert envelope_warnings(0.62, "A100-80GB", 8) == []  # MPT-7B's 64.2% on 8 A100s
    (line,) = envelope_warnings(0.62, "A100-80GB", 64)  # torchtitan's 61.1% on 64
    assert "61.1%" in line and "on 64 GPUs or more" in line
    (line,) = envelope_warnings(0.60, "A100-80GB", 1024)  # MegaScale's 55.2% on 12,288
    assert "55.2%" in line and "MegaScale" in line
    assert envelope_warnings(0.56, "A100-80GB", 20000)  # beyond the largest run: the largest run
    assert envelope_warnings(0.45, "H100-80GB", 96) == [] and envelope_warnings(0.45, "H100-80GB", 1024)
    # each tier is the best on at least its count: MFU falls as the count grows
    for runs in PUBLISHED_MFU.values():
        assert [c.gpus for c in runs] == sorted(c.gpus for c in runs)
        assert [c.mfu for c in runs] == sorted((c.mfu for c in runs), reverse=True)


def test_h200_is_bounded_by_h100_runs_and_gpus_without_published_runs_get_no_warning():
    assert gpu_family("H200-141GB") == "H100"
    assert envelope_warnings(0.9, "cpu") == [] and envelope_warnings(0.9, "RTX5000-16GB") == []


def test_fused_attention_at_long_sequences_is_flagged_where_published_runs_were_missed():
    (line,) = sequence_warnings(32768, "H100-80GB", "flash")
    assert "32,768 tokens" in line and "pessimistic" in line and "published_validation.md" in line
    assert sequence_warnings(LONG_SEQUENCE, "A100-80GB", "masked")
    assert sequence_warnings(LONG_SEQUENCE - 1, "A100-80GB", "flash") == []
    assert sequence_warnings(32768, "A100-80GB", "eager") == []  # materialized scores: not what the sweep ran
    assert sequence_warnings(32768, "cpu", "flash") == [] and sequence_warnings(None, "A100-80GB", "flash") == []
    # a profile that measured the kernel over sequence lengths prices this length from its own curve
    assert sequence_warnings(32768, "A100-80GB", "flash", measured_curve=True) == []


def test_zero3_over_more_ranks_than_any_checked_sharded_run_is_flagged():
    from autoshard.api import estimate_config

    def hand(nodes, zero):
        plan, _ = estimate_config("gpt:layers=2,hidden=256,heads=4,seq=128,vocab=512", f"{nodes}x8xA100-80GB",
                                  micro_batch=1, global_batch=nodes * 8, zero=zero)
        return plan

    (line,) = sharding_warnings(hand(2 * LARGEST_SHARDED_RUN // 8, 3), "A100-80GB")
    assert f"{2 * LARGEST_SHARDED_RUN:,} data-parallel ranks" in line and "DeepSpeed" in line
    assert sharding_warnings(hand(LARGEST_SHARDED_RUN // 8, 3), "A100-80GB") == []  # the checked scale
    assert sharding_warnings(hand(2 * LARGEST_SHARDED_RUN // 8, 1), "A100-80GB") == []  # parameters replicated
    assert sharding_warnings(hand(2 * LARGEST_SHARDED_RUN // 8, 3), "cpu") == []


def test_estimate_prints_the_warning_in_text_and_json():
    args = ["estimate", "gpt:layers=24,hidden=2304,heads=24,seq=2048,vocab=51200", "--cluster", "4x8xA100-80GB",
            "--dp", "32", "--micro-batch", "8", "--global-batch", "512"]
    text = subprocess.run([sys.executable, "-m", "autoshard.cli", *args], capture_output=True, text=True,
                          timeout=300)
    assert text.returncode == 0, text.stderr
    out = subprocess.run([sys.executable, "-m", "autoshard.cli", *args, "--json"], capture_output=True, text=True,
                         timeout=300)
    data = json.loads(out.stdout)
    assert data["mfu"] > ceiling("A100", 32).mfu
    assert data["warnings"] and "caution          " + data["warnings"][0] in text.stdout


def test_a_plan_that_fits_as_priced_but_not_with_the_allocators_measured_reserve_is_flagged():
    from autoshard.hardware_profiles import ClusterSpec
    from autoshard.planner.envelope import RESERVED_OVER_ALLOCATED, memory_warnings

    h100 = ClusterSpec.parse("1x8xH100-80GB")
    usable = h100.device_memory_bytes
    low = RESERVED_OVER_ALLOCATED[0]
    (line,) = memory_warnings(usable * 0.9, h100)  # fits as priced, not with 16% reserved on top
    assert "79.65 GiB" in line and "90%" in line and "may run out of memory" in line
    assert memory_warnings(usable / low * 0.99, h100) == []  # room for the smallest reserve measured
    assert memory_warnings(usable * 0.9, ClusterSpec.parse("1x2xcpu")) == []  # CPU ranks: no caching allocator
