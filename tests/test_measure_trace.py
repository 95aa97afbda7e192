"""`autoshard measure --trace`: one profiled step summarized (how busy the device was, what took the host's time)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from autoshard.measure.step import trace_summary


def test_a_trace_summary_ranks_host_ops_by_their_own_time_and_counts_no_kernels_on_cpu():
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(512, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            lin(x).relu().sum().backward()
    summary = trace_summary(prof, wall_s=0.5)
    times = [row["self_host_s"] for row in summary["top_host_ops"]]
    assert times == sorted(times, reverse=True) and times[0] > 0
    assert any(row["name"] == "aten::addmm" and row["calls"] == 3 for row in summary["top_host_ops"])
    assert summary["device_kernels"] == 0 and summary["device_busy_fraction"] is None  # no device: no kernels
    assert summary["wall_s"] == 0.5 and summary["host_events"] >= 3 * 4
