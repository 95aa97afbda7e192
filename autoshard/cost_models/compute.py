"""Compute time of one operator's kernels on one GPU: pure functions of sizes and a GPUProfile.

GEMMs follow a roofline with tile and wave quantization (NVIDIA, "Matrix Multiplication Background User's
Guide", 2023: cuBLAS computes an output in CTA tiles such as 256x128; tiles run in waves of one per SM, so
a GEMM whose tile count is just above a multiple of the SM count wastes most of a wave). The arithmetic peak
is the GPU's dense tensor-core peak times the measured large-GEMM efficiency of its profile. Everything that
is not a matmul is memory-bound: bytes moved over the achievable HBM bandwidth. Every kernel also pays a
fixed launch cost.
"""

from __future__ import annotations

import math

from autoshard.hardware_profiles.profiles import GPUProfile

__all__ = [
    "gemm_time_s", "memory_bound_time_s", "fused_attention_time_s", "gemm_efficiency",
    "ATTENTION_KERNELS", "FLASH_BACKWARD_FLOPS_FACTOR", "attention_efficiency",
]

# CTA tile shapes (rows x cols of the output) cuBLAS picks for large bf16 GEMMs on Volta..Hopper; the guide's
# figures use 256x128 and 128x128. The best of them is taken, as cuBLAS's heuristics do.
_TILES = ((256, 128), (128, 256), (128, 128))

# Fused attention kernels: "flash" (FlashAttention-2, causal or unmasked) and "masked" (PyTorch SDPA given an
# explicit mask runs the memory-efficient kernel). Their efficiencies are per GPU, in the hardware profiles.
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


def gemm_time_s(m: int, n: int, k: int, gpu: GPUProfile, *, batch: int = 1, bytes_per_elem: int = 2) -> float:
    """Time of `batch` GEMMs (m x k) @ (k x n) in 16-bit with fp32 accumulation."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    flops = 2.0 * m * n * k * batch
    eff = gpu.max_gemm_efficiency * gemm_efficiency(m, n, batch=batch, num_sms=gpu.num_sms)
    t_math = flops / (gpu.peak_tflops * 1e12 * eff)
    t_mem = (m * k + k * n + m * n) * batch * bytes_per_elem / (gpu.hbm_gbps * 1e9 * gpu.hbm_efficiency)
    return max(t_math, t_mem) + gpu.kernel_launch_us * 1e-6


def memory_bound_time_s(nbytes: float, gpu: GPUProfile, *, kernels: int = 1) -> float:
    """Time to stream `nbytes` through HBM (read + write counted in nbytes), plus launch costs."""
    if nbytes <= 0:
        return 0.0
    return nbytes / (gpu.hbm_gbps * 1e9 * gpu.hbm_efficiency) + kernels * gpu.kernel_launch_us * 1e-6


def attention_efficiency(gpu: GPUProfile, kernel: str) -> float:
    """Fraction of peak a fused attention kernel reaches; flash falls back where the GPU cannot run it."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; known: {', '.join(ATTENTION_KERNELS)}")
    if kernel == "flash" and gpu.flash_attention_efficiency is not None:
        return gpu.flash_attention_efficiency
    return gpu.memory_efficient_attention_efficiency


def fused_attention_time_s(flops: float, io_bytes: float, gpu: GPUProfile, *, kernel: str = "flash") -> float:
    """A fused attention kernel ("flash" or "masked"): compute-bound at a fraction of GEMM efficiency, never
    below its I/O."""
    if flops <= 0:
        return 0.0
    t_math = flops / (gpu.peak_tflops * 1e12 * attention_efficiency(gpu, kernel))
    t_mem = io_bytes / (gpu.hbm_gbps * 1e9 * gpu.hbm_efficiency)
    return max(t_math, t_mem) + gpu.kernel_launch_us * 1e-6
