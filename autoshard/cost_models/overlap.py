"""Communication that runs beside compute: how much of it the step still waits for.

A phase (one micro-batch's forward, or its backward) does `compute_s` of kernels while `comm_s` of
collectives run beside them on their own stream, issued in `units` pieces (one FSDP unit / gradient bucket
per block). The first piece has nothing to hide behind (FSDP's first all-gather, the last block's
reduce-scatter); the rest overlap compute. Overlap is not free: NCCL kernels take SMs and memory bandwidth
from the compute kernels beside them, so compute runs `slowdown` times slower while a collective runs
(the profile's `overlap_slowdown`; GPUs: GEMMs and attention run 18.9% slower on average, at most 40%, while
collectives overlap them in GPT and LLaMA training on A100 and H100, arXiv 2507.03114; NCCL issue #1428 shows
1.76x on one A100 GEMM). Hence

    rest    = comm_s - comm_s / units
    exposed = comm_s / units + max(rest - compute_s, rest * (1 - 1 / slowdown))

the second term being the communication that outlasts compute, or else the time compute lost to it.
`planner/ilp.py` writes the same expression as linear constraints.
"""

from __future__ import annotations

__all__ = ["exposed_comm_s", "exposed_beside_s"]


def exposed_comm_s(compute_s: float, comm_s: float, *, units: int, slowdown: float) -> float:
    """Seconds a phase takes beyond `compute_s` because of `comm_s` of overlapped communication."""
    if comm_s <= 0:
        return 0.0
    if units < 1 or slowdown < 1:
        raise ValueError(f"units must be >= 1 and slowdown >= 1, got {units}, {slowdown}")
    first = comm_s / units
    rest = comm_s - first
    return first + max(rest - compute_s, rest * (1.0 - 1.0 / slowdown))


def exposed_beside_s(compute_s: float, comm_s: float, *, slowdown: float) -> float:
    """Seconds beyond `compute_s` of `comm_s` issued at the same moment as `compute_s` of kernels it can run
    beside (nothing to wait for first): Megatron-LM's asynchronous tensor-parallel all-reduce of a
    column-parallel linear's input gradient, launched before its weight-gradient GEMM
    (megatron/core/tensor_parallel/layers.py, LinearWithGradAccumulationAndAsyncCommunication)."""
    if comm_s <= 0:
        return 0.0
    if slowdown < 1:
        raise ValueError(f"slowdown must be >= 1, got {slowdown}")
    return max(comm_s - compute_s, comm_s * (1.0 - 1.0 / slowdown))
