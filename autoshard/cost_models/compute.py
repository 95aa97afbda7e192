"""Compute time of one operator's kernels on one GPU: pure functions of sizes and a GPUProfile.

GEMMs follow a roofline with tile and wave quantization (NVIDIA, "Matrix Multiplication Background User's
Guide", 2023: cuBLAS computes an output in CTA tiles such as 256x128; tiles run in waves of one per SM, so
a GEMM whose tile count is just above a multiple of the SM count wastes most of a wave). The arithmetic peak
is the GPU's dense tensor-core peak times the measured large-GEMM efficiency of its profile. A profile that
carries measured GEMM throughput by shape (`GPUProfile.gemm_tflops`, e.g. from `autoshard profile`) is
interpolated instead: linearly in log2(m), log2(n), log2(k) over its grid, clamped to the grid's range. Everything that
is not a matmul is memory-bound: bytes moved over the achievable HBM bandwidth. Every kernel also pays a
fixed launch cost.

Kernel benchmarks time bursts at boost clock; a training run holds a GPU at its power limit, where the SM clock
settles lower. Tensor-core work (GEMMs, fused attention: both run at the SM clock) runs at the profile's
`sustained_tensor_fraction` of its benchmarked rate, measured as the best sustained GEMM over the best burst
(H200 with all 8 GPUs busy: 698.6 against 823.9 TFLOP/s, ml-engineering compute/accelerator/benchmarks;
A100-SXM4-80GB after 10,000 warm-up iterations on random data: 256.5 against the 267.9 burst best, Azure
AI-benchmarking-guide). Memory-bound kernels keep their rate (HBM clocks do not follow the SM clock).
"""

from __future__ import annotations

import math

from autoshard.hardware_profiles.profiles import GPUProfile

__all__ = [
    "gemm_time_s", "measured_gemm_tflops", "fp8_gemm_speedup", "memory_bound_time_s", "fused_attention_time_s", "gemm_efficiency",
    "ATTENTION_KERNELS", "FLASH_BACKWARD_FLOPS_FACTOR", "attention_efficiency", "max_attention_efficiency",
]

# CTA tile shapes (rows x cols of the output) cuBLAS picks for large bf16 GEMMs on Volta..Hopper; the guide's
# figures use 256x128 and 128x128. The best of them is taken, as cuBLAS's heuristics do.
_TILES = ((256, 128), (128, 256), (128, 128))

# Fused attention kernels: "flash" (FlashAttention-2, causal or unmasked) and "masked" (PyTorch SDPA given an
# explicit mask runs the memory-efficient kernel). Their efficiencies are per GPU, in the hardware profiles.
# Convention, checked against runs and kept on purpose: an efficiency applies to the FLOPs of the full score
# matrix (capture/flops.py), causal or not, while FlashAttention's own benchmarks count half of them for a causal
# kernel. A causal kernel is so priced at half the rate its microbenchmark reports, and in-situ runs agree with
# that, not with the microbenchmark: llm-foundry's MPT-1B at 65,536 tokens on 8 GPUs, ~90% attention, ran at
# 61.6% of A100 peak / 35.1% of H100 peak in full-matrix hardware FLOPs (its README's HFU; priced 0.6 x 0.957 and
# 0.34 x 0.848). Pricing H100 with FlashAttention-2's microbenchmark bars instead (FlashAttention-3 paper,
# arXiv 2407.08608 Figs. 5-6, head dim 128: causal forward 191-335 TFLOP/s at 512-16k tokens, counted half) took
# the dev set's MPT H100 runs from -3.8% to -7.4% mean signed error (MPT-7B at 8k tokens from +9.1% to -11.4%).
ATTENTION_KERNELS = ("flash", "masked")
# Its backward recomputes the score matrix: 5 matmuls against the forward's 2, i.e. 2.5x the forward FLOPs
# where model-FLOP counting (Megatron) says 2x (Dao 2023 §3.1.2).
FLASH_BACKWARD_FLOPS_FACTOR = 2.5


def gemm_efficiency(m: int, n: int, *, batch: int, num_sms: int) -> float:
    """Useful fraction of the arithmetic issued for an (m x n) output, `batch` times: tile x wave quantization."""
    best = 0.0
    for tm, tn in _TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        waves = math.ceil(tiles / num_sms)
        useful = (m * n * batch) / (tiles * tm * tn)
        best = max(best, useful * tiles / (waves * num_sms))
    return best


def measured_gemm_tflops(table: tuple, m: float, n: float, k: float) -> float:
    """TFLOP/s at (m, n, k) from a measured grid of (m, n, k, TFLOP/s): trilinear in log2 of each dim, each
    clamped to the grid (beyond the largest size the largest measured)."""
    cache = _GRIDS.get(id(table))
    if cache is None or cache[0] is not table:
        axes = [sorted({row[i] for row in table}) for i in range(3)]
        values = {(row[0], row[1], row[2]): row[3] for row in table}
        if len(values) != math.prod(len(a) for a in axes):
            raise ValueError("gemm_tflops must be a full grid over its m, n and k values")
        cache = _GRIDS[id(table)] = (table, axes, values)
    _, axes, values = cache
    corners = [_bracket(ax, x) for ax, x in zip(axes, (m, n, k), strict=True)]
    total = 0.0
    for (m0, wm) in corners[0]:
        for (n0, wn) in corners[1]:
            for (k0, wk) in corners[2]:
                total += wm * wn * wk * math.log(values[(m0, n0, k0)])
    return math.exp(total)  # interpolated in log space: rates span orders of magnitude


_GRIDS: dict[int, tuple] = {}


def _bracket(axis: list[float], x: float) -> list[tuple[float, float]]:
    if x <= axis[0] or len(axis) == 1:
        return [(axis[0], 1.0)]
    if x >= axis[-1]:
        return [(axis[-1], 1.0)]
    hi = next(i for i, a in enumerate(axis) if a >= x)
    lo = hi - 1
    w = (math.log2(x) - math.log2(axis[lo])) / (math.log2(axis[hi]) - math.log2(axis[lo]))
    return [(axis[lo], 1.0 - w), (axis[hi], w)]


def gemm_time_s(m: int, n: int, k: int, gpu: GPUProfile, *, batch: int = 1, bytes_per_elem: int = 2,
                float8: bool = False) -> float:
    """Time of `batch` GEMMs (m x k) @ (k x n) in 16-bit with fp32 accumulation; `float8`: both operands in
    float8 on the fp8 tensor cores, one byte per input element (cost_models/float8.py), at the 16-bit rate of the
    shape times the float8 speedup of a GEMM of its size (`fp8_gemm_speedup`)."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    flops = 2.0 * m * n * k * batch
    speedup = fp8_gemm_speedup(gpu, flops / batch) if float8 else 1.0
    if gpu.gemm_tflops:  # measured by shape; a batch of GEMMs runs like one taller GEMM
        rate = measured_gemm_tflops(gpu.gemm_tflops, m * batch, n, k) * gpu.sustained_tensor_fraction * speedup
        return flops / (rate * 1e12) + gpu.kernel_launch_us * 1e-6
    eff = gpu.max_gemm_efficiency * gemm_efficiency(m, n, batch=batch, num_sms=gpu.num_sms)
    t_math = flops / (gpu.sustained_tflops * speedup * 1e12 * eff)
    in_bytes = 1 if float8 else bytes_per_elem
    t_mem = ((m * k + k * n) * in_bytes + m * n * bytes_per_elem) * batch / (gpu.hbm_gbps * 1e9 * gpu.hbm_efficiency)
    return max(t_math, t_mem) + gpu.kernel_launch_us * 1e-6


def fp8_gemm_speedup(gpu: GPUProfile, flops: float) -> float:
    """A float8 GEMM's speed over the 16-bit GEMM of the same shape at `flops` (one GEMM): the profile's measured
    curve by size (`GPUProfile.fp8_gemm_speedup_by_gflop`: linear in log(GFLOP) between its points, held beyond
    its ends), capped at `fp8_gemm_speedup`; that alone where the profile has no curve."""
    if not gpu.fp8_gemm_speedup:
        raise ValueError(f"{gpu.name} has no float8 tensor cores")
    curve = gpu.fp8_gemm_speedup_by_gflop
    if not curve:
        return gpu.fp8_gemm_speedup
    measured = dict(curve)
    return min(sum(w * measured[g] for g, w in _bracket(list(measured), flops / 1e9)), gpu.fp8_gemm_speedup)


def memory_bound_time_s(nbytes: float, gpu: GPUProfile, *, kernels: int = 1) -> float:
    """Time to stream `nbytes` through HBM (read + write counted in nbytes), plus launch costs."""
    if nbytes <= 0:
        return 0.0
    return nbytes / (gpu.hbm_gbps * 1e9 * gpu.hbm_efficiency) + kernels * gpu.kernel_launch_us * 1e-6


def attention_efficiency(gpu: GPUProfile, kernel: str, *, seq: int | None = None) -> float:
    """Fraction of peak a fused attention kernel reaches at sequence length `seq`: the profile's measured
    curve by length where it has one (flash), else its one figure; flash falls back where the GPU cannot run it."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; known: {', '.join(ATTENTION_KERNELS)}")
    if kernel == "flash" and gpu.flash_attention_efficiency is not None:
        if seq and gpu.flash_attention_by_seq:
            measured = dict(gpu.flash_attention_by_seq)
            return sum(w * measured[s] for s, w in _bracket(list(measured), seq))
        return gpu.flash_attention_efficiency
    return gpu.memory_efficient_attention_efficiency


def max_attention_efficiency(gpu: GPUProfile) -> float:
    """The best fraction of peak any fused attention kernel reaches on `gpu` at any length (for lower bounds)."""
    measured = [e for _, e in gpu.flash_attention_by_seq] if gpu.flash_attention_efficiency is not None else []
    return max([attention_efficiency(gpu, k) for k in ATTENTION_KERNELS] + measured)


def fused_attention_time_s(flops: float, io_bytes: float, gpu: GPUProfile, *, kernel: str = "flash",
                           seq: int | None = None) -> float:
    """A fused attention kernel ("flash" or "masked") over sequences of `seq` tokens: compute-bound at a
    fraction of GEMM efficiency, never below its I/O."""
    if flops <= 0:
        return 0.0
    t_math = flops / (gpu.sustained_tflops * 1e12 * attention_efficiency(gpu, kernel, seq=seq))
    t_mem = io_bytes / (gpu.hbm_gbps * 1e9 * gpu.hbm_efficiency)
    return max(t_math, t_mem) + gpu.kernel_launch_us * 1e-6
