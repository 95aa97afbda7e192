"""What Inductor's micro-pipelined tensor parallelism (torchtitan's async TP) runs beyond the collective and the
GEMM it fuses: `estimate --tp-comm-overlap all --compile`.

Inductor's micro-pipeline TP pass (torch/_inductor/fx_passes/micro_pipeline_tp.py, inside compiled graphs only)
replaces an all-gather feeding matmuls by `symm_mem.fused_all_gather_matmul` and a matmul feeding a
reduce-scatter by `symm_mem.fused_matmul_reduce_scatter`. Both are written out in
torch/distributed/_symmetric_memory/__init__.py (read in the installed torch 2.13):

- **The GEMM runs in tp row chunks.** `_fused_all_gather_matmul_impl` calls its matmul once per gathered shard
  (`shard_consumer(shard, rank)`, M/tp rows each); `_fused_matmul_reduce_scatter_impl` once per output chunk
  (`chunk_producer(rank, out)` over `A.chunk(group_size)`). tp GEMMs of M/tp rows run slower than one of M rows
  where the GEMM is small (tile and wave quantization, or the profile's measured rate by shape:
  `compute.gemm_time_s`): `chunked_gemm_extra_s`.
- **The all-gather stages its own shard first.** `_pipelined_multi_all_gather_and_consume` copies the local shard
  into the symmetric-memory buffer and waits on a barrier before the first consumer: "we are giving up the chance
  to overlap 'mv' and 'b' with the first shard_consumer for now" (its comment). A copy of the shard (read and
  write) and the barrier kernel, exposed: `staged_shard_s`.
- **The reduce-scatter sums the partials itself.** The chunks land in a (tp x M/tp) x N `stacked_partials`
  buffer, pulled from the peers by copies, and `reduce_fn` (`torch.sum(..., dim=0)`) adds the tp partials in a
  kernel of its own after the pipeline, where NCCL's reduce-scatter reduces inside its collective: one more pass
  reading M x N and writing M/tp x N, exposed: `partials_sum_s`.

The collective itself is priced by the overlap in evaluate.py (`_beside_gemms`); Megatron-Core's userbuffers
overlap (Transformer Engine) is another engine and not priced here.
"""

from __future__ import annotations

from autoshard.cost_models.compute import gemm_time_s, memory_bound_time_s
from autoshard.hardware_profiles.profiles import GPUProfile

__all__ = ["chunked_gemm_extra_s", "staged_shard_s", "partials_sum_s", "BARRIER_KERNELS"]

# symm_mem.barrier(channel=...) is one kernel on the current stream (the barrier before the first consumer)
BARRIER_KERNELS = 1


def chunked_gemm_extra_s(m: int, n: int, k: int, tp: int, gpu: GPUProfile, *, float8: bool = False,
                         bytes_per_elem: int = 2) -> float:
    """Seconds that tp GEMMs of (m/tp x k) @ (k x n) take beyond one GEMM of m rows (never negative: a chunk
    that the measured grid rates faster than its whole is taken at the whole's rate)."""
    if tp <= 1 or m <= 0:
        return 0.0
    chunk = max(1, m // tp)
    whole = gemm_time_s(m, n, k, gpu, bytes_per_elem=bytes_per_elem, float8=float8)
    parts = tp * gemm_time_s(chunk, n, k, gpu, bytes_per_elem=bytes_per_elem, float8=float8)
    return max(0.0, parts - whole)


def staged_shard_s(shard_bytes: float, gpu: GPUProfile) -> float:
    """Seconds a fused all-gather spends before its first GEMM: its own shard of `shard_bytes` copied into the
    symmetric-memory buffer (read and written) and the barrier after it."""
    if shard_bytes <= 0:
        return 0.0
    return memory_bound_time_s(2 * shard_bytes, gpu, kernels=1 + BARRIER_KERNELS)


def partials_sum_s(output_bytes: float, tp: int, gpu: GPUProfile) -> float:
    """Seconds of a fused reduce-scatter's own sum of the tp partial outputs: reads the whole M x N output
    (`output_bytes`) and writes its 1/tp."""
    if tp <= 1 or output_bytes <= 0:
        return 0.0
    return memory_bound_time_s(output_bytes * (1 + 1 / tp), gpu, kernels=1)
