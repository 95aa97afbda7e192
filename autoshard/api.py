"""The entry points behind the CLI and the Python API: thin glue over models, capture, planner and runtime."""

from __future__ import annotations

from autoshard.capture import capture_model
from autoshard.errors import ConfigurationError
from autoshard.models import load_model
from autoshard.planner.estimate import HandConfig, estimate

__all__ = ["estimate_config", "resolve_cluster"]


def resolve_cluster(cluster):
    """A ClusterSpec from a ClusterSpec or its text form."""
    from autoshard.hardware_profiles import ClusterSpec

    return cluster if isinstance(cluster, ClusterSpec) else ClusterSpec.parse(cluster)


def estimate_config(model, cluster, *, tp: int = 1, pp: int = 1, dp: int | None = None, micro_batch: int = 1,
                    global_batch: int, seq: int | None = None, recompute: str = "none",
                    sequence_parallel: bool = False, virtual_stages: int = 1, schedule: str | None = None,
                    zero: int = 0, check_memory: bool = True):
    """Predict a hand-given configuration; returns (Plan with its prediction, ClusterSpec)."""
    cluster = resolve_cluster(cluster)
    if dp is None:
        if cluster.num_gpus % (tp * pp):
            raise ConfigurationError(f"tp x pp = {tp * pp} does not divide the {cluster.num_gpus} GPUs of {cluster}")
        dp = cluster.num_gpus // (tp * pp)
    cfg = HandConfig(tp=tp, pp=pp, dp=dp, micro_batch=micro_batch, global_batch=global_batch, recompute=recompute,
                     sequence_parallel=sequence_parallel, virtual_stages=virtual_stages, schedule=schedule, zero=zero)
    graph = capture_model(load_model(model, seq=seq))
    plan, _ = estimate(graph, cluster, cfg)
    need = plan.prediction.memory.total_bytes
    if check_memory and need > cluster.device_memory_bytes:
        raise ConfigurationError(
            f"this configuration needs {need / 2**30:.1f} GiB per GPU but {cluster.gpu.name} has "
            f"{cluster.device_memory_bytes / 2**30:.0f} GiB; raise tp/pp, use --recompute full, "
            "a smaller --micro-batch or --zero")
    return plan, cluster


