"""Hardware profiles (one YAML file per GPU and per interconnect, every number with its source) and ClusterSpec."""

from __future__ import annotations

from autoshard.hardware_profiles.cluster import ClusterSpec
from autoshard.hardware_profiles.profiles import (
    GPUProfile,
    LinkProfile,
    gpu_names,
    link_names,
    load_gpu,
    load_link,
)

__all__ = [
    "ClusterSpec",
    "GPUProfile",
    "LinkProfile",
    "load_gpu",
    "load_link",
    "gpu_names",
    "link_names",
    "hardware_table",
]


def hardware_table() -> dict:
    """What `autoshard hardware` lists: one row per GPU profile and per link profile, plain JSON types."""
    gpus = []
    for name in gpu_names():
        gpu = load_gpu(name)
        gpus.append(
            {
                "name": gpu.name,
                "peak_tflops": gpu.peak_tflops,
                # the best large GEMM at the clock the GPU sustains in training (burst x sustained fraction)
                "gemm_tflops_sustained": round(gpu.sustained_tflops * gpu.best_gemm_efficiency, 1),
                "hbm_gbps": gpu.hbm_gbps,
                "memory_gib": gpu.memory_gib,
                "gpus_per_node": gpu.gpus_per_node,
                "intra_node": gpu.intra_node,
                "inter_node": gpu.inter_node,
            }
        )
    links = []
    for name in link_names():
        link = load_link(name)
        links.append(
            {
                "name": link.name,
                "scope": link.scope,
                "all_reduce_busbw_gbps": link.busbw_gbps["all_reduce"],
                "latency_us": link.latency_us,
            }
        )
    return {"gpus": gpus, "links": links}
