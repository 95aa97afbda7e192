"""`autoshard estimate`: predict a hand-given Megatron / DeepSpeed configuration with the planner's cost model.

A context-parallel configuration (cp > 1) is priced on the rank-local graph, captured at seq / cp tokens, on
the mesh with cp folded into dp (`MeshSpec.folded_cp`), with cp times the sequences of that length in a
global batch; attention's own work and traffic over the cp group come from `PlanContext.cp`
(cost_models/context_parallel.py). The plan it returns carries the real mesh and sequence length.

An expert-parallel configuration (ep > 1) keeps the mesh: ep is a divisor of dp, the ranks of each ep group
consecutive dp ranks (`PlanContext.ep`, cost_models/expert_parallel.py); the plan records it as `Plan.ep`."""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.capture.ir import OpGraph, OpKind
from autoshard.cost_models.bounds import block_costs
from autoshard.cost_models.context import TP_OVERLAP, PlanContext, default_precision
from autoshard.cost_models.context_parallel import CP_ATTENTION
from autoshard.cost_models.evaluate import Evaluation, evaluate
from autoshard.cost_models.float8 import FLOAT8_RECIPES, require_fp8_tensor_cores
from autoshard.cost_models.memory import ALLOCATORS, PRECISIONS
from autoshard.cost_models.zero_impl import ZERO_IMPLS
from autoshard.errors import ConfigurationError, require_positive
from autoshard.planner.manual import megatron_assignment
from autoshard.planner.stages import balanced_stage_layers
from autoshard.plans.contract import (
    attention_head_counts,
    attention_kernel,
    kv_head_fraction,
    num_experts,
    pipeline_blocker,
    projection_head_slices,
)
from autoshard.plans.layouts import MeshSpec
from autoshard.plans.plan import (
    SCHEDULES,
    OpPlan,
    PipelineSpec,
    Plan,
    ends_as_layers_stage_layers,
    even_stage_layers,
    graph_fields,
)

__all__ = ["HandConfig", "estimate", "sequence_parallel_default", "check_batch", "check_context_parallel", "check_expert_parallel"]


def sequence_parallel_default(tp: int, tp_comm_overlap: str | bool) -> bool:
    """Whether a configuration that does not say runs sequence parallelism: where its tensor-parallel collectives
    are pipelined with their GEMMs (tp_comm_overlap "all", see `HandConfig`), the engines that do it need it."""
    return tp > 1 and tp_comm_overlap in ("all", True)


@dataclass(frozen=True, kw_only=True)
class HandConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1  # context parallel: the tokens of each sequence over cp ranks (cost_models/context_parallel.py)
    cp_attention: str = "allgather"  # how attention gets the other ranks' keys and values: allgather or ring
    # expert parallel: each MoE layer's experts over ep of the dp ranks (cost_models/expert_parallel.py), the
    # busiest rank routed ep_imbalance times the mean rows (None: the cost model's ep_load_imbalance)
    ep: int = 1
    ep_imbalance: float | None = None
    micro_batch: int = 1
    global_batch: int = 1
    recompute: str = "none"
    # tokens sharded over tp between the matmuls (Korthikanti et al. 2022); None: on where the other options
    # describe an engine that runs only with it (tp_comm_overlap "all"), else off
    sequence_parallel: bool | None = None
    virtual_stages: int = 1
    schedule: str | None = None  # default: 1f1b, or interleaved-1f1b when virtual_stages > 1
    zero: int = 0
    fused_kernels: bool = False  # pointwise regions as one kernel each (Megatron-LM, torch.compile)
    fused_loss: bool = False  # the cross-entropy as one kernel each way (flash-attn's, llm-foundry's default)
    loss_parallel: bool = False  # vocabulary-parallel cross-entropy under tensor parallelism (Megatron, torchtitan)
    zero_impl: str = "fsdp2"  # how ZeRO-3 gathers parameters (cost_models/zero_impl.py)
    # tensor-parallel collectives overlap compute: "" no (autoshard's runtime), "backward" (Megatron-LM's
    # asynchronous TP communication), "all" (Megatron-Core --tp-comm-overlap); True means "all"
    tp_comm_overlap: str | bool = ""
    allocator: str = "expandable"  # PyTorch CUDA allocator mode: expandable (segments) or caching (default)
    compile: bool = False  # every repeated block torch.compile'd (torchtitan --compile; the runtime's compile=True)
    float8: str = ""  # float8 training of the block Linears: "", "tensorwise" or "rowwise" (cost_models/float8.py)
    # pipeline stages free each chunk output once sent (Megatron) or keep it to its backward (torch pipelining);
    # None: as the engine the other options describe (PlanContext.pipeline_keeps_outputs)
    deallocate_pipeline_outputs: bool | None = None
    # sequence-parallel column Linears keep their input's shard and gather it again in backward, each its own
    # (Megatron), or the shard is gathered once for all its readers and kept (torchtitan, the runtime's `col`);
    # None: as the engine the other options describe (PlanContext.megatron_engine; planner/manual.py)
    sequence_parallel_regather: bool | None = None
    # another engine's training precision (cost_models.memory.PRECISIONS: "bf16-mixed-16bit-grads" for DeepSpeed's
    # and Megatron's fp16 engines); None: what autoshard's runtime runs on the cluster (context.default_precision)
    precision: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tp_comm_overlap, bool):
            object.__setattr__(self, "tp_comm_overlap", "all" if self.tp_comm_overlap else "")
        if self.tp_comm_overlap not in TP_OVERLAP:
            raise ConfigurationError(f"tp_comm_overlap={self.tp_comm_overlap!r}: use 'backward' or 'all' (or leave "
                                     "it off)", params=("tp_comm_overlap",))
        # "all" pipelines sequence parallelism's all-gathers and reduce-scatters with their GEMMs: Megatron-LM
        # refuses --tp-comm-overlap without --sequence-parallel (megatron/training/arguments.py), and torch's
        # micro-pipeline TP pass behind torchtitan's async TP fuses only all_gather->mm and mm->reduce_scatter
        # (torch/_inductor/fx_passes/micro_pipeline_tp.py); an all-reduce beside a GEMM is no engine's
        overlap_sp = sequence_parallel_default(self.tp, self.tp_comm_overlap)
        if self.sequence_parallel is None:
            object.__setattr__(self, "sequence_parallel", overlap_sp)
        elif overlap_sp and not self.sequence_parallel:
            raise ConfigurationError("tp_comm_overlap='all' overlaps sequence parallelism's all-gathers and "
                                     "reduce-scatters with their GEMMs (Megatron-Core and torchtitan's async TP "
                                     "run only with it): drop sequence_parallel=False, or use "
                                     "tp_comm_overlap='backward'", params=("tp_comm_overlap", "sequence_parallel"))
        for name in ("tp", "pp", "dp", "cp", "ep", "micro_batch", "global_batch", "virtual_stages"):
            require_positive(name, getattr(self, name))
        if self.virtual_stages > 1 and self.pp == 1:  # checked here: before the model is captured
            raise ConfigurationError("virtual_stages > 1 needs pp > 1", params=("virtual_stages", "pp"))
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ConfigurationError(f"precision={self.precision!r}: use one of {', '.join(PRECISIONS)}",
                                     params=("precision",))
        if self.float8 and self.float8 not in FLOAT8_RECIPES:
            raise ConfigurationError(f"float8={self.float8!r}: use one of {', '.join(FLOAT8_RECIPES)} (or leave it "
                                     "off)", params=("float8",))
        if self.recompute not in ("none", "selective", "full"):
            raise ConfigurationError(f"recompute={self.recompute!r}: use none, selective or full", params=("recompute",))
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ConfigurationError(f"schedule={self.schedule!r}: use one of {', '.join(SCHEDULES)}",
                                     params=("schedule",))
        if self.zero not in (0, 1, 2, 3):
            raise ConfigurationError(f"zero={self.zero}: use 0, 1, 2 or 3", params=("zero",))
        if self.zero_impl not in ZERO_IMPLS:
            raise ConfigurationError(f"zero_impl={self.zero_impl!r}: use one of {', '.join(ZERO_IMPLS)}",
                                     params=("zero_impl",))
        if self.zero_impl != "fsdp2" and self.zero != 3:
            raise ConfigurationError(f"zero_impl={self.zero_impl!r} prices ZeRO-3's parameter gathers: add zero=3",
                                     params=("zero_impl", "zero"))
        if self.cp_attention not in CP_ATTENTION:
            raise ConfigurationError(f"cp_attention={self.cp_attention!r}: use one of {', '.join(CP_ATTENTION)}",
                                     params=("cp_attention",))
        if self.ep > 1 and self.dp % self.ep:
            raise ConfigurationError(f"ep={self.ep} must divide dp={self.dp}: expert parallelism spreads the experts "
                                     "over ranks of the data-parallel group; pick an ep that divides dp",
                                     params=("ep", "dp"))
        if self.ep > 1 and self.cp > 1:
            raise ConfigurationError("ep > 1 with cp > 1 is not supported (the runtime runs expert parallelism on "
                                     "data-parallel ranks only); use one of them", params=("ep", "cp"))
        if self.ep_imbalance is not None and self.ep_imbalance < 1.0:
            raise ConfigurationError(f"ep_imbalance={self.ep_imbalance}: the busiest rank's rows over the mean is at "
                                     "least 1", params=("ep_imbalance",))
        if self.allocator not in ALLOCATORS:
            raise ConfigurationError(f"allocator={self.allocator!r}: use one of {', '.join(ALLOCATORS)}",
                                     params=("allocator",))

    @property
    def resolved_schedule(self) -> str:
        if self.schedule:
            return self.schedule
        return "interleaved-1f1b" if self.virtual_stages > 1 else "1f1b"


def check_batch(global_batch: int, dp: int, micro_batch: int) -> int:
    """Micro-batches per replica; the batch must split evenly."""
    if global_batch % (dp * micro_batch):
        raise ConfigurationError(
            f"global batch {global_batch} is not a multiple of dp x micro-batch = {dp} x {micro_batch}; "
            f"use a global batch divisible by {dp * micro_batch}")
    return global_batch // (dp * micro_batch)


def _validate(graph: OpGraph, cluster, cfg: HandConfig) -> None:
    n = cfg.tp * cfg.pp * cfg.dp * cfg.cp
    if n != cluster.num_gpus:
        degrees = f"{cfg.tp} x {cfg.pp} x {cfg.dp}" + (f" x {cfg.cp}" if cfg.cp > 1 else "")
        cp = f" x cp = {degrees}" if cfg.cp > 1 else f" = {degrees}"
        raise ConfigurationError(
            f"tp x pp x dp{cp} = {n}, but cluster {cluster} has {cluster.num_gpus} GPUs; choose degrees whose "
            f"product is {cluster.num_gpus}")
    require_fp8_tensor_cores(cluster.gpu, cfg.float8)
    if cfg.cp > 1:
        check_context_parallel(graph, cfg.cp)
    if cfg.ep > 1:
        check_expert_parallel(graph, cfg.ep)
    bad_heads = [h for h in attention_head_counts(graph) if h % cfg.tp]
    if bad_heads:
        raise ConfigurationError(f"tp={cfg.tp} does not divide the {' and '.join(map(str, bad_heads))} attention "
                                 "heads (query, key/value) of this model; pick a tp that divides each")
    bad_slices = {op: n for op, n in projection_head_slices(graph).items() if n % cfg.tp}
    if bad_slices:
        op, n = next(iter(bad_slices.items()))
        raise ConfigurationError(f"tp={cfg.tp} does not divide the {n} head-sized slices of {op}'s output "
                                 "(a column split must cut whole heads); pick a tp that divides it")
    blocker = pipeline_blocker(graph) if cfg.pp > 1 else None
    if blocker:
        raise ConfigurationError(f"pp={cfg.pp}: this model cannot be cut into pipeline stages: {blocker}; use pp=1",
                                 params=("pp",))
    convs = [op.name for op in graph.ops if op.kind is OpKind.CONV]
    if cfg.sequence_parallel and cfg.tp > 1 and convs:
        # the sequence dim of a 4-D tensor is an image's height, which its batch norm reduces over (a ResNet
        # under dp2 x tp2 + sequence parallel trained with wrong norm gradients)
        raise ConfigurationError(f"sequence_parallel splits token sequences; this model has convolutions "
                                 f"({convs[0]}{' and more' if len(convs) > 1 else ''}) on image tensors: drop "
                                 "sequence_parallel", params=("sequence_parallel",))


def check_context_parallel(local_graph: OpGraph, cp: int) -> None:
    """Context parallelism needs one fused attention kernel per layer (the runtime's CP attention calls
    SDPA; materialized scores would be sharded by query only) and sequences of 2 x cp equal chunks; the
    graph is the rank-local one (seq / cp tokens)."""
    if attention_kernel(local_graph) not in ("flash", "masked"):
        raise ConfigurationError(f"cp={cp} needs a fused attention kernel (scaled_dot_product_attention); this "
                                 f"model's attention is {attention_kernel(local_graph)}: drop --attention eager or "
                                 "use cp=1", params=("cp",))
    if not any(op.kind is OpKind.ATTENTION for op in local_graph.ops):
        raise ConfigurationError(f"cp={cp}: this model has no attention to split by sequence; use cp=1",
                                 params=("cp",))
    seq = local_graph.seq_len
    if seq is None or seq % 2:
        raise ConfigurationError(f"cp={cp} cuts each sequence into {2 * cp} equal chunks (two per rank, for a "
                                 f"causal mask's balance); use a sequence length divisible by {2 * cp}",
                                 params=("cp", "seq"))


def check_expert_parallel(graph: OpGraph, ep: int) -> None:
    """Expert parallelism needs MoE layers whose experts divide by ep (contract.expert_parallel_degrees)."""
    experts = num_experts(graph)
    if not experts:
        raise ConfigurationError(f"ep={ep}: this model has no mixture-of-experts layers (no grouped expert "
                                 "weights) to spread; use ep=1", params=("ep",))
    if experts % ep:
        raise ConfigurationError(f"ep={ep} does not divide the {experts} experts per layer; pick an ep that "
                                 "divides it", params=("ep",))


def _stage_layers(graph: OpGraph, pp: int, virtual_stages: int) -> tuple[tuple[int, int], ...]:
    """How the engines split a hand-given pipeline: Megatron's even split when the layers divide into the chunks;
    else, when the layers plus two do, the embedding and the head each in one layer's place
    (`ends_as_layers_stage_layers`: BLOOM's 70 layers on 12 stages as 5, 6, ..., 6, 5; Llama 3 405B's 126 on
    16 x 8 chunks with the embedding and the head alone in the first and the last); otherwise the
    cost-balanced split the planner uses (embeddings and head counted), as Megatron's
    --decoder-first/last-pipeline-num-layers set by hand would."""
    chunks = pp * virtual_stages
    if chunks == 1:
        return ()
    layers = graph.num_layers
    if layers % chunks == 0:
        return even_stage_layers(layers, chunks)
    if (layers + 2) % chunks == 0:
        return ends_as_layers_stage_layers(layers, chunks)
    if layers < chunks:
        raise ConfigurationError(f"{layers} layers cannot fill {chunks} pipeline chunks (pipeline degree "
                                 f"x virtual stages; {layers + 2} with the embedding and the head each in a chunk "
                                 "of their own); lower --pp or --virtual-stages")
    return balanced_stage_layers(layers, pp, virtual_stages, *block_costs(graph))


def estimate(graph: OpGraph, cluster, cfg: HandConfig) -> tuple[Plan, Evaluation]:
    """Price `cfg` on `cluster`; raises ConfigurationError when it cannot run (incl. not fitting memory).
    With cfg.cp > 1, `graph` is the rank-local graph (captured at seq / cp tokens)."""
    _validate(graph, cluster, cfg)
    m = check_batch(cfg.global_batch, cfg.dp, cfg.micro_batch)
    mesh = MeshSpec.of(**{a: d for a, d in (("pp", cfg.pp), ("dp", cfg.dp), ("cp", cfg.cp), ("tp", cfg.tp))
                          if d > 1})
    priced = mesh.folded_cp()
    ctx = PlanContext(mesh=priced, cluster=cluster, micro_batch=cfg.micro_batch, num_microbatches=m,
                      cp=cfg.cp, cp_attention=cfg.cp_attention, cp_kv_fraction=kv_head_fraction(graph),
                      ep=cfg.ep, ep_imbalance=cfg.ep_imbalance,
                      precision=PRECISIONS[cfg.precision] if cfg.precision else default_precision(cluster),
                      recompute=cfg.recompute, seq=graph.seq_len,
                      fused_pointwise=cfg.fused_kernels, fused_loss=cfg.fused_loss, loss_parallel=cfg.loss_parallel,
                      zero_impl=cfg.zero_impl,
                      tp_overlap=cfg.tp_comm_overlap, allocator=cfg.allocator, compile=cfg.compile,
                      float8=cfg.float8, deallocate_pipeline_outputs=cfg.deallocate_pipeline_outputs)
    assign = megatron_assignment(graph, priced, cfg.micro_batch, sequence_parallel=cfg.sequence_parallel,
                                 zero=cfg.zero,
                                 regather=ctx.megatron_engine if cfg.sequence_parallel_regather is None
                                 else cfg.sequence_parallel_regather)
    stage_layers = _stage_layers(graph, cfg.pp, cfg.virtual_stages)
    pipe = PipelineSpec(degree=cfg.pp, schedule=cfg.resolved_schedule, virtual_stages=cfg.virtual_stages,
                        stage_layers=stage_layers, layered=cfg.resolved_schedule == "looped-bfs")
    ev = evaluate(graph, assign, ctx, pipe, global_batch=cfg.global_batch * cfg.cp)
    plan = Plan(**graph_fields(graph), cluster=str(cluster), mesh=mesh,
                global_batch=cfg.global_batch, micro_batch=cfg.micro_batch,
                seq=graph.seq_len * cfg.cp if graph.seq_len else graph.seq_len,
                recompute=cfg.recompute, pipeline=pipe, prediction=ev.prediction, space=("manual",), ep=cfg.ep,
                compile=cfg.compile, float8=cfg.float8,
                attention=attention_kernel(graph),
                ops=tuple(OpPlan(op=op.name, module=op.module_path, kind=op.kind.value, layer=op.layer,
                                 inputs=op.inputs,
                                 strategy=assign[op.name], time_s=ev.op_costs[op.name].time_s,
                                 memory_bytes=ev.op_costs[op.name].state_bytes)
                          for op in graph.ops if op.name in assign))
    return plan, ev
