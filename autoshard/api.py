"""The entry points behind the CLI and the Python API: thin glue over models, capture, planner and runtime."""

from __future__ import annotations

from dataclasses import replace as dc_replace

from autoshard.errors import ConfigurationError, InfeasiblePlanError, require_positive
from autoshard.models.names import is_zoo_or_spec, resolve_spec
from autoshard.planner.estimate import HandConfig, estimate
from autoshard.plans.plan import graph_fields

__all__ = ["estimate_config", "resolve_cluster", "plan", "plan_with_baselines", "float8_searches", "load_graph",
           "autoparallel"]


def resolve_cluster(cluster):
    """A ClusterSpec from a ClusterSpec or its text form."""
    from autoshard.hardware_profiles import ClusterSpec

    return cluster if isinstance(cluster, ClusterSpec) else ClusterSpec.parse(cluster)


ATTENTION_CHOICES = ("auto", "eager", "flash", "sdpa")


def _explicit_attn(model) -> bool:
    return isinstance(model, str) and "attn=" in model.replace(" ", "")


def estimate_config(model, cluster, *, tp: int = 1, pp: int = 1, dp: int | None = None, micro_batch: int = 1,
                    global_batch: int, seq: int | None = None, recompute: str = "none",
                    sequence_parallel: bool | None = None, virtual_stages: int = 1, schedule: str | None = None,
                    zero: int = 0, attention: str = "auto", fused_kernels: bool = False, fused_loss: bool = False,
                    loss_parallel: bool = False, zero_impl: str = "fsdp2",
                    tp_comm_overlap: str | bool = "", allocator: str = "expandable", precision: str | None = None,
                    cp: int = 1, cp_attention: str = "allgather", ep: int = 1, ep_imbalance: float | None = None,
                    compile: bool = False, float8: str = "", check_memory: bool = True,
                    deallocate_pipeline_outputs: bool | None = None,
                    sequence_parallel_regather: bool | None = None):
    """Predict a hand-given configuration; returns (Plan with its prediction, ClusterSpec).

    `attention` for zoo and spec models: "flash" (causal FlashAttention-2, what PyTorch SDPA, Megatron-Core,
    torchtitan and llm-foundry run), "eager" (materialized scores and a softmax kernel: Megatron-LM's fused
    softmax before flash attention, Hugging Face "eager"), "sdpa" (Hugging Face's masked SDPA), or "auto":
    flash, unless the model spec names its attention (`attn=`). `fused_kernels`: each pointwise region runs as
    one kernel (Megatron-LM's fused kernels, torch.compile) that keeps only its inputs for backward, instead of
    one kernel per ATen op keeping what its derivative needs (eager PyTorch). `fused_loss`: the cross-entropy
    runs as one kernel each way over the 16-bit logits, keeping them and writing a 16-bit gradient
    (flash-attn's CrossEntropyLoss, llm-foundry's default loss), instead of torch's cross_entropy on fp32 logits.
    `loss_parallel`: the cross-entropy on each tensor-parallel rank's vocabulary shard of a column-parallel head
    (Megatron-LM's vocab_parallel_cross_entropy, torchtitan's loss_parallel), instead of the outputs gathered
    whole for the loss (autoshard's runtime).
    `zero_impl`: how ZeRO-3 gathers parameters, "fsdp2" (per block, prefetched: autoshard's runtime, FSDP,
    DeepSpeed since late 2021) or "deepspeed-2021" (per submodule, waited for, ~24 GB/s per GPU: DeepSpeed's
    ZeRO-3 before PR #1188; `cost_models/zero_impl.py`).
    `tp_comm_overlap`: tensor-parallel collectives overlap compute: "backward" (Megatron-LM's asynchronous
    tensor-parallel communication) or "all" / True (Megatron-Core --tp-comm-overlap, torchtitan's async TP), which
    runs with sequence parallelism: `sequence_parallel` None (the default) turns it on there, off elsewhere.
    `allocator`: PyTorch's CUDA allocator mode, "expandable" (expandable_segments:True, as torchtitan and
    autoshard's runtime set it) or "caching" (the default; about 15% of per-step memory lost to fragmentation).
    `precision`: another engine's (`cost_models.memory.PRECISIONS`, e.g. "bf16-mixed-16bit-grads": DeepSpeed's
    and Megatron's fp16 engines hold and reduce 16-bit gradients); default: what autoshard's runtime runs.
    `cp`: context parallelism, each sequence's tokens over cp ranks (tp x pp x dp x cp GPUs); `cp_attention`:
    how attention gets the other ranks' keys and values, "allgather" (what autoshard's runtime runs, as Llama 3
    did) or "ring" (ring attention: torch's SDPA context_parallel, Megatron-Core); cost_models/context_parallel.py.
    `ep`: expert parallelism, each MoE layer's experts over ep of the dp ranks (a divisor of dp: no GPUs of its
    own); `ep_imbalance`: the busiest rank's routed rows over the mean (default: `ep_load_imbalance`, 1.25 for
    one of 8 experts per rank);
    cost_models/expert_parallel.py.
    `compile`: every repeated block `torch.compile`d (torchtitan's --compile, the runtime's `compile=True`):
    fused pointwise kernels, host cost per compiled graph and kernel. `float8`: "tensorwise" or "rowwise",
    the block Linears in float8 (torchao; H100/H200 only); cost_models/float8.py. `deallocate_pipeline_outputs`:
    whether pipeline stages free a chunk output once sent (Megatron's schedules) or keep it until its backward
    (torch.distributed.pipelining); None: as the engine the other options describe
    (`PlanContext.pipeline_keeps_outputs`). `sequence_parallel_regather`: whether each sequence-parallel
    column Linear keeps its input's shard and gathers it again in backward (Megatron-LM) or the shard is gathered
    once for all the Linears reading it and kept (torchtitan, the runtime); None: as the engine the other options
    describe (`PlanContext.megatron_engine`).
    """
    attention = resolve_attention(model, attention)
    kw = dict(tp=tp, pp=pp, dp=dp, micro_batch=micro_batch, global_batch=global_batch, seq=seq,
              recompute=recompute, sequence_parallel=sequence_parallel, virtual_stages=virtual_stages,
              schedule=schedule, zero=zero, fused_kernels=fused_kernels, fused_loss=fused_loss,
              loss_parallel=loss_parallel, zero_impl=zero_impl, tp_comm_overlap=tp_comm_overlap, allocator=allocator,
              precision=precision,
              cp=cp, cp_attention=cp_attention, ep=ep, ep_imbalance=ep_imbalance, compile=compile, float8=float8,
              deallocate_pipeline_outputs=deallocate_pipeline_outputs,
              sequence_parallel_regather=sequence_parallel_regather)
    return _estimate(model, cluster, attn=attention, check_memory=check_memory, **kw)


def capture_ref(ref, *, seq: int | None = None, attn: str | None = None):
    """The graph of a zoo name, spec string or `module:factory`: from the graph cache without importing torch
    when it is there, else captured (`autoshard.capture.capture_ref`)."""
    from autoshard.capture.disk_cache import cached_graph

    hit = cached_graph(ref, seq=seq, attn=attn)
    if hit is not None:
        return hit
    from autoshard.capture import trace

    return trace.capture_ref(ref, seq=seq, attn=attn)


def _estimate(model, cluster, *, tp, pp, dp, micro_batch, global_batch, seq, recompute, sequence_parallel,
              virtual_stages, schedule, zero, attn, check_memory, fused_kernels, fused_loss, zero_impl,
              tp_comm_overlap, allocator, precision=None, cp=1, cp_attention="allgather", ep=1, ep_imbalance=None,
              compile=False, float8="", loss_parallel=False, deallocate_pipeline_outputs=None,
              sequence_parallel_regather=None):
    cluster = resolve_cluster(cluster)
    require_positive("cp", cp)
    if dp is None:
        if cluster.num_gpus % (tp * pp * cp):
            what = "tp x pp x cp" if cp > 1 else "tp x pp"
            raise ConfigurationError(f"{what} = {tp * pp * cp} does not divide the {cluster.num_gpus} GPUs of "
                                     f"{cluster}")
        dp = cluster.num_gpus // (tp * pp * cp)
    cfg = HandConfig(tp=tp, pp=pp, dp=dp, cp=cp, cp_attention=cp_attention, micro_batch=micro_batch,
                     global_batch=global_batch, recompute=recompute,
                     sequence_parallel=sequence_parallel, virtual_stages=virtual_stages, schedule=schedule, zero=zero,
                     fused_kernels=fused_kernels, fused_loss=fused_loss, loss_parallel=loss_parallel,
                     zero_impl=zero_impl, tp_comm_overlap=tp_comm_overlap, allocator=allocator, precision=precision, ep=ep,
                     ep_imbalance=ep_imbalance, compile=compile, float8=float8 or "",
                     deallocate_pipeline_outputs=deallocate_pipeline_outputs,
                     sequence_parallel_regather=sequence_parallel_regather)
    graph = capture_ref(model, seq=seq, attn=attn)
    if cp > 1:  # priced on the rank-local graph; the plan names the model as the user runs it
        full = graph
        if full.seq_len is None or full.seq_len % (2 * cp):
            raise ConfigurationError(f"cp={cp} cuts each sequence into {2 * cp} equal chunks (two per rank); "
                                     f"the sequence length {full.seq_len} is not a multiple of {2 * cp}",
                                     params=("cp", "seq"))
        graph = capture_ref(model, seq=full.seq_len // cp, attn=attn)
    plan, _ = estimate(graph, cluster, cfg)
    if cp > 1:
        plan = dc_replace(plan, **graph_fields(full))
    need = plan.prediction.memory.total_bytes
    if check_memory and need > cluster.device_memory_bytes:
        fixes, params = _memory_fixes(cfg, loss_bytes=_loss_buffer_bytes(graph, cfg))
        raise ConfigurationError(
            f"this configuration needs {need / 2**30:.1f} GiB per GPU but {cluster.gpu.name} has "
            f"{cluster.device_memory_text}; {fixes}", params=params)
    return plan, cluster


def _loss_buffer_bytes(graph, cfg: HandConfig) -> float:
    """The cross-entropy's buffers at the start of backward, on the whole vocabulary (`memory.loss_buffer_bytes`)."""
    from autoshard.cost_models.evaluate import has_loss
    from autoshard.cost_models.memory import loss_buffer_bytes

    numel = sum(graph.op(o).output_meta.numel for o in graph.outputs if has_loss(graph.op(o).output_meta))
    return loss_buffer_bytes(numel * cfg.micro_batch, fused=cfg.fused_loss)


def _memory_fixes(cfg: HandConfig, *, loss_bytes: float = 0.0) -> tuple[str, tuple[str, ...]]:
    """What would shrink a hand configuration that does not fit, in the order a user would try it: only the
    knobs not already at their smallest-memory setting (sequence parallelism first when tensor parallelism
    runs without it: it divides the activations outside the matmuls by tp). Under tensor parallelism a loss
    whose buffers (`loss_bytes`) reach 8 GiB names loss_parallel too: the engines that run TP compute it on
    the vocabulary shards (torchtitan, Megatron-LM), autoshard's runtime on the gathered logits."""
    fixes, params = [], []
    if cfg.tp > 1 and not cfg.sequence_parallel:
        fixes.append("add sequence_parallel")
        params.append("sequence_parallel")
    if cfg.tp > 1 and not cfg.loss_parallel and loss_bytes >= 8 * 2**30:
        fixes.append(f"add loss_parallel (the loss holds {loss_bytes / 2**30:.0f} GiB on the whole vocabulary; "
                     "torchtitan and Megatron-LM compute it on the tensor-parallel shards)")
        params.append("loss_parallel")
    if cfg.recompute != "full":
        fixes.append("use recompute='full'")
        params.append("recompute")
    if cfg.micro_batch > 1:
        fixes.append("a smaller micro_batch")
        params.append("micro_batch")
    if cfg.zero < 3 and cfg.dp > 1:
        fixes.append(f"a higher zero (now {cfg.zero})")
        params.append("zero")
    fixes.append("raise tp/pp")
    params += ["tp", "pp"]
    return ", ".join(fixes[:-1]) + (" or " if len(fixes) > 1 else "") + fixes[-1], tuple(params)


def resolve_attention(model, attention: str = "auto") -> str | None:
    """The attention implementation to build `model` with (None: the model's own). "auto" is flash for decoder
    (gpt, llama) zoo and spec models that do not name theirs: causal FlashAttention-2 is what PyTorch SDPA runs
    without a mask tensor (torchtitan, Megatron-Core, llm-foundry), and it is never slower nor larger than the
    masked or eager kernels. A module or factory runs the attention its code calls: only "auto" applies."""
    if attention not in ATTENTION_CHOICES:
        raise ConfigurationError(f"attention={attention!r}: use one of {', '.join(ATTENTION_CHOICES)}")
    if not is_zoo_or_spec(model):
        if attention != "auto":
            raise ConfigurationError(f"attention={attention!r} applies to zoo and spec models; a module or factory "
                                     "runs the attention its code calls: leave it at auto")
        return None
    if attention == "auto":
        causal = resolve_spec(model).family in ("gpt", "llama", "mixtral")  # flash is the causal kernel
        return "flash" if causal and not _explicit_attn(model) else None
    return attention


def load_graph(model, *, example_inputs=None, seq: int | None = None, attention: str = "auto"):
    """An OpGraph from a zoo name / spec / factory string, or an nn.Module with its example inputs.
    `attention`: see `resolve_attention`."""
    attn = resolve_attention(model, attention)
    if isinstance(model, str):
        return capture_ref(model, seq=seq, attn=attn)
    from torch import nn

    from autoshard.capture import capture

    if isinstance(model, nn.Module):
        if example_inputs is None:
            raise ConfigurationError("planning an nn.Module needs example_inputs=(...) (one batch of its inputs)")
        return capture(model, example_inputs, name=type(model).__name__)
    return capture_ref(model, seq=seq, attn=attn)


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
         memory_cap: float | None = None, space: str | None = None, time_limit_s: float = 20.0, progress=None,
         attention: str = "auto", compile: bool | None = None, float8: str = ""):
    """Dry run: the fastest plan for `model` on `cluster` (no GPU needed). `memory_cap` in GiB per GPU;
    `attention` the kernel priced for zoo and spec models ("auto": flash; see `resolve_attention`); `compile`
    each block where the runtime can (None: on GPU clusters), `float8` the block Linears ("tensorwise",
    "rowwise"; H100/H200): planner/search.py `Lowering`."""
    from autoshard.planner.outer import best_plan  # imported here: estimate_config runs without PuLP
    from autoshard.planner.search import parse_space

    cluster = resolve_cluster(cluster)  # every argument checked before the capture
    gb, cap, searched = _default_global_batch(cluster, global_batch), _cap_bytes(cluster, memory_cap), parse_space(space)
    require_positive("time_limit_s", time_limit_s, integer=False, unit=" of seconds")
    graph = load_graph(model, example_inputs=example_inputs, seq=seq, attention=attention)
    result, _ = best_plan(graph, cluster, global_batch=gb, space=searched, cap_bytes=cap, time_limit_s=time_limit_s,
                          progress=progress, local_graph=_local_graphs(model, attention),
                          lowering=_lowering(compile, float8))
    return result


def _lowering(compile: bool | None, float8: str | None):
    from autoshard.planner.search import Lowering

    if float8 and float8 not in ("tensorwise", "rowwise"):
        raise ConfigurationError(f"float8={float8!r}: use 'tensorwise' or 'rowwise' (or leave it off)",
                                 params=("float8",))
    return Lowering(compile=compile, float8=float8 or "")


def _local_graphs(model, attention: str):
    """seq -> the model's graph captured at seq tokens, for the planner's context-parallel search (a model
    given by reference only: a module's inputs fix its length)."""
    if not isinstance(model, str):
        return None
    return lambda seq: load_graph(model, seq=seq, attention=attention)


def plan_with_baselines(model, cluster, *, global_batch: int | None = None, seq: int | None = None,
                        memory_cap: float | None = None, space: str | None = None, time_limit_s: float = 20.0,
                        progress=None, attention: str = "auto", baselines: bool = True,
                        compile: bool | None = None, float8: str = ""):
    """(Plan, SearchResult, baselines, graph, cluster) for the CLI; `baselines=False`: no baselines ({})."""
    from autoshard.planner.baselines import compute_baselines
    from autoshard.planner.outer import best_plan
    from autoshard.planner.search import parse_space

    cluster = resolve_cluster(cluster)  # every argument checked before the capture
    gb, cap, searched = _default_global_batch(cluster, global_batch), _cap_bytes(cluster, memory_cap), parse_space(space)
    require_positive("time_limit_s", time_limit_s, integer=False, unit=" of seconds")
    graph = load_graph(model, seq=seq, attention=attention)
    the_plan, result = best_plan(graph, cluster, global_batch=gb, space=searched, cap_bytes=cap,
                                 time_limit_s=time_limit_s, progress=progress,
                                 local_graph=_local_graphs(model, attention), lowering=_lowering(compile, float8))
    priced = {}
    if baselines:
        if progress is not None:
            progress("pricing the baselines")
        priced = compute_baselines(graph, cluster, global_batch=gb, cap_bytes=cap)
    return the_plan, result, priced, graph, cluster


def float8_searches(model, graph, cluster, *, global_batch: int, memory_cap: float | None = None,
                    space: str | None = None, time_limit_s: float = 20.0, attention: str = "auto",
                    compile: bool | None = None, progress=None) -> dict:
    """Recipe -> the fastest plan with the block Linears in that float8 recipe (None where none fits): what
    `plan` offers where its own layout has no float8 offer (planner/offers.py: tensor or expert parallelism,
    which the runtime does not train in float8, or context parallelism). The search `plan --float8 RECIPE`
    runs, on the same graph, batch and memory cap, over the families of `space` the runtime trains in float8
    (not tensor or expert parallelism)."""
    from autoshard.cost_models.float8 import FLOAT8_RECIPES
    from autoshard.planner.outer import best_plan
    from autoshard.planner.search import parse_space

    cluster = resolve_cluster(cluster)
    # the families whose plans the runtime trains in float8: no tensor or expert parallelism (runtime/compile.py)
    cap, searched = _cap_bytes(cluster, memory_cap), parse_space(space) - {"tp1d", "tp2d", "tp3d", "ep"}
    out = {}
    for recipe in FLOAT8_RECIPES:
        if progress is not None:
            progress(f"searching the plans in float8 ({recipe})")
        try:
            if not searched & {"dp", "zero", "pp"}:
                raise InfeasiblePlanError("no family of the space trains in float8")
            found, _ = best_plan(graph, cluster, global_batch=global_batch, space=searched, cap_bytes=cap,
                                 time_limit_s=time_limit_s, progress=progress, local_graph=_local_graphs(model, attention),
                                 lowering=_lowering(compile, recipe))
        except (InfeasiblePlanError, ConfigurationError):  # nothing of those families fits or divides the GPUs
            found = None
        out[recipe] = found if found is not None and found.float8 == recipe else None
    return out


def autoparallel(model, cluster, *, example_inputs, global_batch: int, plan=None, space=None,
                 memory_cap: float | None = None, loss_fn=None, graph=None, timeout_s: float | None = None,
                 time_limit_s: float = 20.0, compile: bool | None = None, float8: str = ""):
    """Parallelize `model` for this rank of a `cluster` job (call on every rank, under torchrun): the runtime's
    `autoparallel` (runtime/entry.py) with the planner behind it.

    `plan=None` plans now: rank 0 captures `model` with `example_inputs` (inputs of any batch size, e.g. token
    ids (B, S)), searches the plan for `global_batch` over `space` (families as in `autoshard plan --space`;
    by default every family the runtime runs without pipeline stages) under `memory_cap` GiB per device,
    logs it and broadcasts it. A given `Plan` or plan file is checked against the model. `loss_fn(output,
    target)` is needed by pipelined plans (space with pp), which train through `train_step`. `compile`: with
    plan=None, compile the blocks where the runtime can (None: on GPUs; planner/search.py `Lowering`); with a
    plan, True / False overrides its `compile`. `float8` ("tensorwise", "rowwise"): plan the block Linears in
    float8 (needs torchao and an H100 / H200)."""
    import functools
    import logging

    from autoshard.planner.for_runtime import make_runtime_plan
    from autoshard.runtime.entry import autoparallel as apply_on_ranks

    make = None
    if plan is None:
        make = functools.partial(make_runtime_plan, global_batch=global_batch, space=space, memory_cap=memory_cap,
                                 time_limit_s=time_limit_s, lowering=_lowering(compile, float8))
    elif space is not None or memory_cap is not None:
        logging.getLogger(__name__).info("space / memory_cap steer the planner; ignored because a plan was given")
    return apply_on_ranks(model, cluster, example_inputs=example_inputs, global_batch=global_batch, plan=plan,
                          loss_fn=loss_fn, graph=graph, timeout_s=timeout_s, make_plan=make,
                          compile=compile if plan is not None else None)
