"""The entry points behind the CLI and the Python API: thin glue over models, capture, planner and runtime."""

from __future__ import annotations

from autoshard.capture import capture_model
from autoshard.errors import ConfigurationError, require_positive
from autoshard.models import load_model
from autoshard.planner.estimate import HandConfig, estimate

__all__ = ["estimate_config", "resolve_cluster", "plan", "plan_with_baselines", "load_graph"]


def resolve_cluster(cluster):
    """A ClusterSpec from a ClusterSpec or its text form."""
    from autoshard.hardware_profiles import ClusterSpec

    return cluster if isinstance(cluster, ClusterSpec) else ClusterSpec.parse(cluster)


ATTENTION_CHOICES = ("auto", "eager", "flash", "sdpa")


def _explicit_attn(model) -> bool:
    return isinstance(model, str) and "attn=" in model.replace(" ", "")


def estimate_config(model, cluster, *, tp: int = 1, pp: int = 1, dp: int | None = None, micro_batch: int = 1,
                    global_batch: int, seq: int | None = None, recompute: str = "none",
                    sequence_parallel: bool = False, virtual_stages: int = 1, schedule: str | None = None,
                    zero: int = 0, attention: str = "auto", fused_kernels: bool = False,
                    tp_comm_overlap: bool = False, allocator: str = "expandable", check_memory: bool = True):
    """Predict a hand-given configuration; returns (Plan with its prediction, ClusterSpec).

    `attention` for zoo and spec models: "flash" (causal FlashAttention-2, what PyTorch SDPA, Megatron-Core,
    torchtitan and llm-foundry run), "eager" (materialized scores and a softmax kernel: Megatron-LM's fused
    softmax before flash attention, Hugging Face "eager"), "sdpa" (Hugging Face's masked SDPA), or "auto":
    flash, unless the model spec names its attention (`attn=`). `fused_kernels`: each pointwise region runs as
    one kernel (Megatron-LM's fused kernels, torch.compile) instead of one kernel per ATen op (eager PyTorch).
    `tp_comm_overlap`: tensor-parallel collectives overlap the GEMMs (Megatron-Core --tp-comm-overlap).
    `allocator`: PyTorch's CUDA allocator mode, "expandable" (expandable_segments:True, as torchtitan and
    autoshard's runtime set it) or "caching" (the default; about 15% of per-step memory lost to fragmentation).
    """
    if attention not in ATTENTION_CHOICES:
        raise ConfigurationError(f"--attention {attention!r}: use one of {', '.join(ATTENTION_CHOICES)}")
    kw = dict(tp=tp, pp=pp, dp=dp, micro_batch=micro_batch, global_batch=global_batch, seq=seq,
              recompute=recompute, sequence_parallel=sequence_parallel, virtual_stages=virtual_stages,
              schedule=schedule, zero=zero, fused_kernels=fused_kernels, tp_comm_overlap=tp_comm_overlap,
              allocator=allocator)
    if attention == "auto":
        attention = "flash" if _zoo_or_spec(model) and not _explicit_attn(model) else None
    return _estimate(model, cluster, attn=attention, check_memory=check_memory, **kw)


def _zoo_or_spec(model) -> bool:
    if not isinstance(model, str):
        return False
    head = model.split(":", 1)[0].strip().lower()
    return ":" not in model or head in ("gpt", "llama", "bert", "vit", "mlp")


def _estimate(model, cluster, *, tp, pp, dp, micro_batch, global_batch, seq, recompute, sequence_parallel,
              virtual_stages, schedule, zero, attn, check_memory, fused_kernels, tp_comm_overlap, allocator):
    cluster = resolve_cluster(cluster)
    if dp is None:
        if cluster.num_gpus % (tp * pp):
            raise ConfigurationError(f"tp x pp = {tp * pp} does not divide the {cluster.num_gpus} GPUs of {cluster}")
        dp = cluster.num_gpus // (tp * pp)
    cfg = HandConfig(tp=tp, pp=pp, dp=dp, micro_batch=micro_batch, global_batch=global_batch, recompute=recompute,
                     sequence_parallel=sequence_parallel, virtual_stages=virtual_stages, schedule=schedule, zero=zero,
                     fused_kernels=fused_kernels, tp_comm_overlap=tp_comm_overlap, allocator=allocator)
    graph = capture_model(load_model(model, seq=seq, attn=attn))
    plan, _ = estimate(graph, cluster, cfg)
    need = plan.prediction.memory.total_bytes
    if check_memory and need > cluster.device_memory_bytes:
        raise ConfigurationError(
            f"this configuration needs {need / 2**30:.1f} GiB per GPU but {cluster.gpu.name} has "
            f"{cluster.device_memory_bytes / 2**30:.0f} GiB; raise tp/pp, use recompute='full', "
            "a smaller micro_batch or zero", params=("tp", "pp", "recompute", "micro_batch", "zero"))
    return plan, cluster




def load_graph(model, *, example_inputs=None, seq: int | None = None):
    """An OpGraph from a zoo name / spec / factory string, or an nn.Module with its example inputs."""
    from torch import nn

    from autoshard.capture import capture

    if isinstance(model, nn.Module):
        if example_inputs is None:
            raise ConfigurationError("planning an nn.Module needs example_inputs=(...) (one batch of its inputs)")
        return capture(model, example_inputs, name=type(model).__name__)
    return capture_model(load_model(model, seq=seq))


def _cap_bytes(cluster, memory_cap_gib: float | None) -> float:
    if memory_cap_gib is None:
        return cluster.device_memory_bytes
    require_positive("memory_cap", memory_cap_gib, integer=False, unit=" of GiB")
    return memory_cap_gib * 2**30


def _default_global_batch(cluster, global_batch: int | None) -> int:
    if global_batch is None:
        return 4 * cluster.num_gpus
    require_positive("global_batch", global_batch)
    return global_batch


def plan(model, cluster, *, example_inputs=None, global_batch: int | None = None, seq: int | None = None,
         memory_cap: float | None = None, space: str | None = None, time_limit_s: float = 20.0, progress=None):
    """Dry run: the fastest plan for `model` on `cluster` (no GPU needed). `memory_cap` in GiB per GPU."""
    from autoshard.planner.planning import make_plan
    from autoshard.planner.search import parse_space

    cluster = resolve_cluster(cluster)
    graph = load_graph(model, example_inputs=example_inputs, seq=seq)
    result, _ = make_plan(graph, cluster, global_batch=_default_global_batch(cluster, global_batch),
                          space=parse_space(space), cap_bytes=_cap_bytes(cluster, memory_cap),
                          time_limit_s=time_limit_s, progress=progress)
    return result


def plan_with_baselines(model, cluster, *, global_batch: int | None = None, seq: int | None = None,
                        memory_cap: float | None = None, space: str | None = None, time_limit_s: float = 20.0,
                        progress=None):
    """(Plan, SearchResult, baselines, graph, cluster) for the CLI."""
    from autoshard.planner.baselines import compute_baselines
    from autoshard.planner.planning import make_plan
    from autoshard.planner.search import parse_space

    cluster = resolve_cluster(cluster)
    graph = load_graph(model, seq=seq)
    gb = _default_global_batch(cluster, global_batch)
    cap = _cap_bytes(cluster, memory_cap)
    the_plan, result = make_plan(graph, cluster, global_batch=gb, space=parse_space(space), cap_bytes=cap,
                                 time_limit_s=time_limit_s, progress=progress)
    baselines = compute_baselines(graph, cluster, global_batch=gb, cap_bytes=cap)
    return the_plan, result, baselines, graph, cluster
