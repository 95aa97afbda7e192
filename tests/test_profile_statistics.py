"""`autoshard profile` reports what a step pays on average: the mean of repeated calls, not their median."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from autoshard.measure import profile as prof


def test_timed_is_the_mean_of_bimodal_calls_because_a_step_adds_its_operations_times(one_rank, monkeypatch):
    # a collective that takes 1 ms twice and then a 7 ms scheduler tick: a step pays 3 ms per call on average;
    # the median (1 ms) would miss the tick entirely
    clock = [0.0]
    durations = itertools.cycle([1e-3, 1e-3, 7e-3])
    monkeypatch.setattr(prof.time, "perf_counter", lambda: clock[0])

    def call():
        clock[0] += next(durations)

    c = prof._Ctx(torch.device("cpu"), True, None)
    assert c.timed(call, reps=9) == pytest.approx(3e-3)


def test_timed_repeats_at_least_min_reps_even_when_one_call_fills_the_budget(one_rank, monkeypatch):
    clock, calls = [0.0], [0]
    monkeypatch.setattr(prof.time, "perf_counter", lambda: clock[0])

    def slow_call():
        calls[0] += 1
        clock[0] += 1.0  # 20x the quick budget per measured point

    prof._Ctx(torch.device("cpu"), True, None).timed(slow_call)
    assert calls[0] == 2 + prof.MIN_REPS  # warm-up, the sizing call, then the repetitions


def test_profile_times_float8_gemms_against_bf16_by_size_and_writes_the_curve_the_cost_model_reads(one_rank):
    from autoshard.hardware_profiles.profiles import load_gpu

    c = prof._Ctx(torch.device("cpu"), True, None)  # torch._scaled_mm runs on CPU too: the code path, not figures
    curve = prof.fp8_gemm_speedups(c, shapes=((64, 32, 48), (64, 48, 32), (128, 64, 64)))
    assert [g for g, _ in curve] == [0.000197, 0.00105] and all(x > 0 for _, x in curve)  # one size measured twice: averaged
    h200 = load_gpu("H200-141GB")
    fields = prof.fp8_fields(curve, h200, "measured here")
    assert fields["fp8_gemm_speedup"] == h200.fp8_gemm_speedup  # the cap: the built-in profile's
    assert prof.fp8_fields(curve, None, "measured here")["fp8_gemm_speedup"] == max(x for _, x in curve)
    assert prof.fp8_fields([], h200, "measured here") == {}  # no fp8 tensor cores: no float8 on the profile
    sources = fields.pop("sources")
    profile = dataclasses.replace(h200, **fields)  # what the written file loads as
    assert profile.fp8_gemm_speedup_by_gflop == tuple((g, x) for g, x in curve) and set(sources) == set(fields)
