"""Price a complete assignment (a strategy per operator, a pipeline, micro-batching): the one cost model.

The ILP optimizes the same per-op and per-edge costs (`opcost.py`); this module adds what is not linear in
them — pipeline schedules, overlap of data-parallel traffic with compute, the per-stage memory peak — and
produces the `Prediction` every command reports.

Iteration time, with m micro-batches per replica, p stages, v chunks per stage, t = the slowest stage's
forward + backward time per micro-batch (compute, tensor-parallel communication, exposed ZeRO traffic):
    no pipeline:               m·t
    gpipe, 1f1b:               (m + p − 1)·t                       (Narayanan et al. 2021 §2.2)
    interleaved-1f1b:          (m + (p − 1)/v)·t, p2p traffic ×v   (ibid. §2.2.2)
    looped-bfs (layered):      (m + (p − 1)/v)·t, ZeRO gathers and reductions once per step, not per
                               micro-batch (Lamy-Poirier 2021 §3-4)
plus the exposed part of the once-per-step data-parallel traffic and the optimizer step. t includes the
pipeline receives the stage waits for (`_boundaries`: a received chunk's hidden states, a sent chunk's
gradient; two transfers per chunk on inner stages, one on the first and last).

Overlap (`cost_models/overlap.py`): ZeRO gathers of a micro-batch's forward overlap its forward compute only,
its backward gathers and gradient reduce-scatters its backward compute only (a backward collective cannot
start before the backward does), one FSDP unit per block, compute slowed by the GPU's `overlap_slowdown`
while they run; the once-per-step traffic overlaps the last micro-batch's backward (gradient all-reduce,
ZeRO-1's reduce-scatter) or the first one's forward (ZeRO-1 and -2's parameter gather) the same way, sharing
the link with that phase's own traffic (`iteration_sync_s`).
On a GPU each phase (a micro-batch's forward, its backward with recompute) takes the longer of its kernels and
its host issuing them (`cost_models/host.py`, `_wait_for_host`); the optimizer step the longer of its kernels
and its per-tensor host work. Full recompute runs a block's forward again up to where torch's checkpoint stops
(`recompute_stops_before`).
Tensor-parallel collectives are on the critical path (the runtime's). `PlanContext.tp_overlap` prices other
engines (`estimate` only: the runtime cannot): "backward", Megatron-LM's asynchronous tensor-parallel
communication, where the collective of a linear's input gradient runs beside that linear's weight-gradient
GEMM (`_beside_wgrad`); "all", Megatron-Core's --tp-comm-overlap and torchtitan's async TP, where each
collective is pipelined with the GEMM it feeds or is fed by (`_beside_gemms`); under `compile` (Inductor's
fused ops, inside compiled blocks only) with the chunked GEMMs, staged shards and partial sums those ops run
(`_fused_tp_kernels_s`, cost_models/async_tp.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autoshard.capture.cache import graph_cache
from autoshard.capture.ir import OpGraph, OpKind, TensorMeta
from autoshard.cost_models.async_tp import chunked_gemm_extra_s, partials_sum_s, staged_shard_s
from autoshard.cost_models.compute import memory_bound_time_s
from autoshard.cost_models.context import PlanContext
from autoshard.cost_models.float8 import cast_bytes_per_elem, float8_linear
from autoshard.cost_models.host import compiled_host_s, optimizer_host_s, separate_host
from autoshard.cost_models.memory import (
    OPTIMIZER_PASSES,
    framework_overhead_bytes,
    loss_buffer_bytes,
    loss_saved_bytes,
    optimizer_step_bytes,
    tensor_bytes,
)
from autoshard.cost_models.opcost import (
    EdgeCost,
    OpCost,
    edge_cost,
    float8_input_cast_on_edge,
    grad_partial_axes,
    linear_gemm,
    op_cost,
    score_shaped,
)
from autoshard.cost_models.overlap import exposed_beside_s, exposed_comm_s
from autoshard.cost_models.template import planned_edges, stage_of, template_for
from autoshard.plans.breakdown import MemoryBreakdown, TimeBreakdown
from autoshard.plans.contract import expert_roles
from autoshard.plans.layouts import BATCH, FEAT, SEQ, Layout
from autoshard.plans.plan import OpStrategy, PipelineSpec, Prediction
from autoshard.plans.strategies import same_strategy

__all__ = ["cached_chunk_outputs_bytes", "cached_logits_bytes", "held_loss_bytes", "has_loss", "held_per_stage", "keeps_chunk_outputs", "recv_buffer_bytes", "chunk_sends_bytes", "compiled_graphs_host_s", "Evaluation", "evaluate", "stage_of", "sink_layout", "block_inputs", "inflight_microbatches", "op_sites",
           "dp_units", "stage_exposed_s",
           "pipeline_fill",
           "stage_units", "recompute_stops_before", "optimizer_s", "optimizer_step_host_s", "edge_step_s", "edge_time_s",
           "optimizer_s_per_state_byte"]


@dataclass(frozen=True)
class Evaluation:
    prediction: Prediction
    op_costs: dict[str, OpCost]
    edge_costs: dict[tuple[str, str, int], EdgeCost]  # template (producer, consumer, input index) -> cost
    output_costs: dict[str, EdgeCost]  # template output op -> gathering its output for the caller
    stage_memory: tuple[MemoryBreakdown, ...]
    stage_time_s: tuple[float, ...]  # per micro-batch, per stage


def sink_layout(ctx: PlanContext, produced: Layout | None = None) -> Layout:
    """Outputs leave the model batch-sharded over dp and whole on every tensor-parallel rank; under
    `ctx.loss_parallel` a vocabulary-sharded output (`produced` sharded on its last dim) stays so."""
    dp = (("dp", BATCH),) if "dp" in ctx.mesh.names else ()
    if ctx.loss_parallel and produced is not None:
        return Layout(dp + tuple((a, p) for a, p in produced.items if p == FEAT and a in ctx.mesh.tp_axes))
    return Layout(dp)


def vocab_shards(produced: Layout, ctx: PlanContext) -> int:
    """Over how many ranks the loss of an output laid out as `produced` runs: its last dim's tensor-parallel
    shards under `ctx.loss_parallel`, else 1 (the loss runs on the whole output on every rank)."""
    if not ctx.loss_parallel:
        return 1
    return math.prod(ctx.mesh.degree(a) for a, p in produced.items if p == FEAT and a in ctx.mesh.tp_axes)


def block_inputs(graph: OpGraph) -> dict[str, TensorMeta]:
    """First op of each repeated block -> the block input it keeps under full recompute."""
    out = {}
    for group in graph.blocks:
        for names in group.op_names:
            first = graph.op(names[0])
            if first.input_meta:
                out[first.name] = first.input_meta[0]
    return out


def dp_units(graph: OpGraph) -> dict[str, float]:
    """Op in a repeated block -> parameters of its block instance: the FSDP unit whose collectives it shares
    (ops outside blocks are units of their own and are absent). A MoE layer's grouped expert matmuls are a unit
    of their own, the experts module (runtime/data_parallel.py), and not part of their block's."""
    cache = graph_cache(graph)
    if "dp_units" not in cache:
        experts = {n: r for n, r in expert_roles(graph).items() if r.unit_numel and graph.op(n).params}
        out = {n: float(r.unit_numel) for n, r in experts.items()}
        for group in graph.blocks:
            for names in group.op_names:
                plain = [n for n in names if n not in experts]
                total = float(sum(graph.op(n).param_numel for n in plain))
                out.update({n: total for n in plain})
        cache["dp_units"] = out
    return cache["dp_units"]


def selective_keeps(graph: OpGraph) -> dict[str, bool]:
    """Block op -> whether selective recompute keeps its output, for graphs with a fused attention kernel
    (torchtitan's op-level policy, runtime/recompute.py: the attention kernel and every other matmul of a
    block, in execution order, are kept; the rest recomputed). Empty for graphs with materialized scores,
    where selective recompute drops the score tensors instead (Korthikanti et al. 2022)."""
    cache = graph_cache(graph)
    if "sac" not in cache:
        out: dict[str, bool] = {}
        if not any(score_shaped(t, graph.seq_len) for op in graph.ops for t in op.saved):
            for group in graph.blocks:
                for names in group.op_names:
                    mm = 0
                    for name in names:
                        op = graph.op(name)
                        if op.kind in (OpKind.LINEAR, OpKind.MATMUL):
                            mm += 1
                        out[name] = op.kind is OpKind.ATTENTION or (op.kind in (OpKind.LINEAR, OpKind.MATMUL)
                                                                    and mm % 2 == 1)
        cache["sac"] = out
    return cache["sac"]


def with_stage_copies(graph: OpGraph, pipe: PipelineSpec) -> OpGraph:
    """`graph` with every shared parameter also owned by its first user on each other pipeline stage: a tied
    embedding and head on the first and last stage are two copies there, each held, gathered, reduced over dp and
    stepped by its stage, their gradients summed between the stages (runtime/pipeline.py TiedSync, as
    Megatron-LM's embedding group does). Measured on gloo ranks: GPT-2's last stage (pp 2 x dp 2, ZeRO-2) gathers
    and reduce-scatters its copy of the word embedding with the rest of its parameters
    (tests/distributed/test_pipeline.py). Without a pipeline, `graph` itself."""
    if pipe.degree == 1 or not graph.tied_params:
        return graph
    cache = graph_cache(graph)
    key = ("stage_copies", pipe.degree, pipe.virtual_stages, pipe.stage_layers)
    if key not in cache:
        rank = {name: c % pipe.degree for name, c in stage_of(graph, pipe).items()}
        held = {(p.name, rank[op.name]) for op in graph.ops for p in op.params if p.owner}
        ops = []
        for op in graph.ops:
            copies = [p for p in op.params if not p.owner and (p.name, rank[op.name]) not in held]
            held |= {(p.name, rank[op.name]) for p in copies}
            ops.append(replace(op, params=tuple(replace(p, owner=True) if p in copies else p for p in op.params))
                       if copies else op)
        changed = any(a is not b for a, b in zip(ops, graph.ops, strict=True))
        cache[key] = replace(graph, ops=tuple(ops)) if changed else graph
    return cache[key]


def pointwise_region_inputs(graph: OpGraph) -> dict[str, tuple[TensorMeta, ...]]:
    """Block elementwise op -> its inputs made by another elementwise op of the same block (SwiGLU's
    `act_fn(gate) * up`: the product's first input). In a compiled block such a chain is one fused region,
    and the backward recomputes those inputs from the region's own instead of saving them (`opcost._saved_bytes`)."""
    cache = graph_cache(graph)
    if "region_inputs" not in cache:
        out = {}
        for op in graph.ops:
            if op.layer is None or op.kind is not OpKind.ELEMENTWISE:
                continue
            fed = tuple(meta for src, meta in zip(op.inputs, op.input_meta, strict=False)
                        if graph.op(src).kind is OpKind.ELEMENTWISE and graph.op(src).layer == op.layer)
            if fed:
                out[op.name] = fed
        cache["region_inputs"] = out
    return cache["region_inputs"]


def op_sites(graph: OpGraph) -> dict[str, dict]:
    """`op_cost` keyword arguments per op: the block input it keeps under full recompute, its FSDP unit,
    whether selective recompute keeps its output, its place in a MoE layer, whether full recompute stops
    before it, the inputs a compiled block's fused region recomputes."""
    cache = graph_cache(graph)
    if "op_sites" not in cache:
        firsts, units, keeps = block_inputs(graph), dp_units(graph), selective_keeps(graph)
        experts, skipped = expert_roles(graph), recompute_stops_before(graph)
        regions = pointwise_region_inputs(graph)
        cache["op_sites"] = {op.name: {"block_input": firsts.get(op.name), "unit_numel": units.get(op.name),
                                       "selective_keep": keeps.get(op.name), "expert": experts.get(op.name),
                                       "not_recomputed": op.name in skipped,
                                       "region_inputs": regions.get(op.name, ())}
                             for op in graph.ops}
    return cache["op_sites"]


def recompute_stops_before(graph: OpGraph) -> set[str]:
    """Block ops full recompute does not run again: the runtime's checkpoint (torch's non-reentrant one,
    runtime/recompute.py) stops as soon as the last tensor the block's backward needs is saved again
    (`torch.utils.checkpoint`'s early stop). That is the block's last op keeping a tensor for backward: the ops
    after it (the closing residual add) are never recomputed, nor is that op's own kernel where it keeps only
    its inputs, which autograd saves before running the kernel: a matmul's (Llama's down_proj, GPT-2's
    c_proj, whose row-parallel all-reduce is not replayed either: tests/distributed, stop 38)."""
    cache = graph_cache(graph)
    if "recompute_stops" not in cache:
        last: dict[int, int] = {}
        for i, op in enumerate(graph.ops):
            if op.layer is not None and op.saved:
                last[op.layer] = i
        out = set()
        for i, op in enumerate(graph.ops):
            keeper = last.get(op.layer, len(graph.ops)) if op.layer is not None else len(graph.ops)
            if i > keeper or (i == keeper and op.kind in (OpKind.LINEAR, OpKind.MATMUL)):
                out.add(op.name)
        cache["recompute_stops"] = out
    return cache["recompute_stops"]


def pipeline_fill(pipe: PipelineSpec, m: int) -> float:
    """Micro-batch slots the schedule leaves idle with m micro-batches: p - 1 for GPipe and 1F1B (a rank's chunks
    run back to back), (p - 1)/v for interleaved 1F1B and looped BFS (Narayanan et al. 2021 §2.2.2; Lamy-Poirier
    2021 §4) when a round has at least p micro-batches. With m < p a micro-batch comes back to a stage after p
    chunk-times, of which the stage spends m on the round: the v·p chunk forwards (and backwards) of the first
    micro-batch run in turn, the others trail by one chunk each, (v·p + m - 1) chunk-times where m·v are work:
    p - m + (m - 1)/v, which is p - 1 at m = 1, as 1F1B (torch's `ScheduleInterleaved1F1B` runs one micro-batch
    through a rank's chunks one after the other)."""
    p, v = pipe.degree, pipe.virtual_stages
    if p == 1:
        return 0.0
    if pipe.schedule in ("interleaved-1f1b", "looped-bfs"):
        if m < p:
            return p - m + (m - 1) / v
        return (p - 1) / v
    return float(p - 1)


def inflight_microbatches(stage: int, pipe: PipelineSpec, m: int) -> float:
    """Micro-batches (of all the stage's layers) whose activations a stage holds at its peak (Korthikanti et al.
    2022 §4.2.3). Interleaved 1F1B runs (v - 1)·r + 2·(p - 1 - stage) chunk forwards before its first backward,
    r micro-batches per round (torch.distributed.pipelining's `_get_warmup_ops`, Megatron-LM's
    get_forward_backward_func with r = p), then holds one more: p + (p - 1)/v on the first stage."""
    p, v = pipe.degree, pipe.virtual_stages
    if p == 1:
        return float(m) if pipe.layered else 1.0
    if pipe.schedule == "gpipe" or pipe.layered:
        return float(m)
    if pipe.schedule == "interleaved-1f1b":
        per_round = m / max(1, m // p)
        warmup = min((v - 1) * per_round + 2 * (p - 1 - stage), m * v)
        return min(m * v, warmup + 1) / v
    return float(min(m, p - stage))


@dataclass
class _Stage:
    fwd: float = 0.0
    bwd: float = 0.0  # backward and recompute kernels
    tp: float = 0.0
    dp_fwd: float = 0.0  # ZeRO gathers before each micro-batch's forward
    dp_bwd: float = 0.0  # ZeRO gathers and gradient reduce-scatters in each micro-batch's backward
    dp_sync: float = 0.0  # ZeRO-3 gathers the micro-batch waits for (an implementation that does not prefetch)
    dp_iter: float = 0.0  # once per step after the last backward: ZeRO-0's all-reduce, ZeRO-1's reduce-scatter
    dp_iter_fwd: float = 0.0  # once per step in the first forward: ZeRO-1 and -2's parameter all-gather
    units: int = 0
    memory: MemoryBreakdown = MemoryBreakdown()
    params: float = 0.0  # local parameter count (optimizer step)
    param_tensors: int = 0  # parameter tensors the optimizer steps through (its per-tensor host cost)
    saved: float = 0.0
    transient: float = 0.0
    loss_bytes: float = 0.0  # cross-entropy buffers at the start of backward (last stage)
    recompute_peak: float = 0.0  # one block's activations, re-materialized in its backward
    p2p: float = 0.0  # seconds it waits for pipeline receives per micro-batch (`_boundaries`)
    cached: float = 0.0  # bytes of its chunks' outputs the schedule keeps per micro-batch (`_boundaries`)
    # bytes of the model's outputs it keeps for backward and the loss's saved tensors of the other micro-batches in
    # flight (`cached_logits_bytes`, `held_loss_bytes`)
    logits: float = 0.0
    recv_buffers: float = 0.0  # the schedule's receive buffers, every micro-batch's (`recv_buffer_bytes`)
    tp_hidden: float = 0.0  # of `tp`, what runs beside GEMMs (tp_overlap: `_beside_wgrad`, `_beside_gemms`)
    host_fwd: float = 0.0  # GPUs: host seconds issuing a micro-batch's forward (cost_models/host.py)
    host_bwd: float = 0.0  # ... and its backward with recompute
    host_wait: float = 0.0  # of fwd + bwd, what the GPU waits for its host per micro-batch (`_wait_for_host`)


def _template_costs(graph: OpGraph, assign: dict[str, OpStrategy], ctx: PlanContext, tg):
    """Costs of template ops and template edges (every block instance shares its template's strategy)."""
    sites = op_sites(graph)
    op_costs = {op.name: op_cost(op, assign[op.name], ctx, **sites[op.name]) for op in tg.ops}
    edges = {}
    for e in tg.edges:
        d_st = assign[e.dst]
        edges[(e.src, e.dst, e.index)] = edge_cost(
            e.meta, assign[e.src].output, d_st.inputs[e.index],
            grad_partial_axes(d_st) if e.index == 0 else frozenset(), ctx,
            regather=d_st.save_sharded_input and e.index == 0, **e.shares,
            gather_bytes_per_elem=_float8_gather(graph.op(e.dst), ctx),
            input_cast_bytes_per_elem=_float8_input_cast(graph.op(e.dst), ctx))
    outs = {name: edge_cost(graph.op(name).output_meta, assign[name].output, sink_layout(ctx, assign[name].output),
                            frozenset(), ctx)
            for name in tg.outputs}
    return op_costs, edges, outs


def _float8_gather(consumer, ctx: PlanContext) -> float | None:
    """1 byte per element where a tensorwise float8 Linear gathers its input (opcost.edge_cost), else None."""
    return 1.0 if ctx.float8 == "tensorwise" and float8_linear(consumer) else None


def _float8_input_cast(consumer, ctx: PlanContext) -> float:
    """Bytes per element of a float8 Linear's input cast where the edge into it runs it
    (opcost.float8_input_cast_on_edge), else 0."""
    if not (float8_linear(consumer) and float8_input_cast_on_edge(ctx)):
        return 0.0
    return cast_bytes_per_elem(ctx.float8, "fwd", "x", compiled=ctx.compiled(consumer))


def _accumulate(graph, assign, ctx, pipe, tg, op_costs, edges, outs, stage) -> list[_Stage]:
    stages = [_Stage() for _ in range(pipe.degree)]
    for op in tg.ops:
        c = op_costs[op.name]
        for k, n in enumerate(tg.per_stage[op.name]):
            if not n:
                continue
            st = stages[k]
            st.fwd += n * c.fwd_s
            st.bwd += n * (c.bwd_s + c.recompute_s)
            st.host_fwd += n * c.host_fwd_s
            st.host_bwd += n * c.host_bwd_s
            st.tp += n * (c.tp_fwd_s + c.tp_bwd_s)
            # an op's own collectives (a float8 cast's amax all-reduce, which its GEMMs wait for; a sequence-parallel
            # norm's weight-gradient all-reduce) run beside no GEMM under any overlap: only the collectives on
            # edges, into and out of the Linears, do (`_beside_wgrad`, `_beside_gemms`)
            st.dp_fwd += n * c.dp_fwd_s
            st.dp_bwd += n * c.dp_bwd_s
            st.dp_sync += n * c.dp_sync_s
            st.dp_iter += n * c.dp_iter_s
            st.dp_iter_fwd += n * c.dp_iter_fwd_s
            st.params += n * c.optim_bytes / _optim_bytes_per_param(ctx)  # the step runs on the shard
            st.param_tensors += n * sum(1 for p in op.params if p.owner)
            st.memory = st.memory + MemoryBreakdown(params_bytes=n * c.param_bytes, grads_bytes=n * c.grad_bytes,
                                                    optimizer_bytes=n * c.optim_bytes)
            st.saved += n * c.saved_bytes
            st.transient = max(st.transient, c.transient_bytes)
            st.recompute_peak += c.recompute_peak_bytes  # once: one block is recomputed at a time
    readers = input_readers(tg)
    for e in tg.edges:
        c = edges[(e.src, e.dst, e.index)]
        t = edge_step_s(c, e.in_block, ctx)
        hidden = _beside_wgrad(c.bwd_s, e.dst, op_costs, graph, ctx)
        replays = 2 if ctx.recompute == "full" and e.in_block else 1  # the recomputed forward's again, beside its GEMM
        shared = e.fanout > 1 and not (assign[e.dst].save_sharded_input and e.index == 0)  # one gather, q k v
        group = readers.get(e.src) if shared else None
        hidden += _beside_gemms(c.fwd_s, c.bwd_s, e.dst, e.src, op_costs, graph, ctx, replays=replays,
                                readers=group, share=e.shares["share"])
        fused_fwd, fused_bwd = _fused_tp_kernels_s(e, c, graph, assign, ctx, readers=group, share=e.shares["share"])
        for k, n in enumerate(e.per_stage):
            stages[k].tp += n * t
            stages[k].tp_hidden += n * hidden
            stages[k].fwd += n * (c.fwd_compute_s + fused_fwd)
            stages[k].bwd += n * ((c.fwd_compute_s + fused_fwd) * (replays - 1) + fused_bwd)  # recomputed in backward
    for name, c in outs.items():
        stages[stage[name]].tp += c.time_s
    loss_time, loss_bytes = loss_per_stage(graph, tg.outputs, stage, ctx, pipe.degree, assign)
    logits = [a + b for a, b in zip(cached_logits_bytes(graph, tg.outputs, stage, ctx, pipe, assign),
                                    held_loss_bytes(graph, tg.outputs, stage, ctx, pipe, assign), strict=True)]
    for k, st in enumerate(stages):
        st.fwd += loss_time[k]
        st.bwd += loss_time[k]
        st.loss_bytes, st.logits = loss_bytes[k], logits[k]
    units = stage_units(graph, pipe, stage)
    for k, st in enumerate(stages):
        st.units = units[k]
        graphs = compiled_graphs_host_s(tg, ctx, k)
        st.host_fwd, st.host_bwd = st.host_fwd + graphs, st.host_bwd + graphs
        _wait_for_host(st)
    _boundaries(graph, assign, ctx, pipe, stages)
    return stages


def compiled_graphs_host_s(tg, ctx: PlanContext, k: int) -> float:
    """Host seconds per micro-batch phase of stage k's compiled graph calls (cost_models/host.py): one forward
    graph and one backward graph per compiled block (a recomputed block's forward runs inside its backward
    graph); 0 without `compile` or where the host is the device."""
    if not ctx.compile or not separate_host(ctx.gpu):
        return 0.0
    first: dict[int, str] = {}
    for op in tg.ops:  # one template op per block type stands for its blocks
        if op.layer is not None:
            first.setdefault(op.layer, op.name)
    return compiled_host_s(0, graphs=sum(tg.per_stage[name][k] for name in first.values()))


def _wait_for_host(st: _Stage) -> None:
    """A phase takes the longer of its kernels and the host issuing them (cost_models/host.py): `fwd` and `bwd`
    become that, and `host_wait` keeps what the GPU idles (0 on CPU ranks and datasheet profiles without a host
    cost)."""
    st.host_wait = max(0.0, st.host_fwd - st.fwd) + max(0.0, st.host_bwd - st.bwd)
    st.fwd, st.bwd = max(st.fwd, st.host_fwd), max(st.bwd, st.host_bwd)


def _beside_wgrad(comm_s: float, name: str, op_costs, graph: OpGraph, ctx: PlanContext) -> float:
    """Of `comm_s` of backward tensor-parallel communication feeding op `name`'s input gradient, the seconds
    that run beside that op's weight-gradient GEMM (half its backward) under tp_overlap "backward": Megatron-LM
    launches the collective asynchronously before the weight-gradient GEMM. 0 for ops without weights."""
    if ctx.tp_overlap != "backward" or comm_s <= 0:
        return 0.0
    op = graph.op(name)
    if op.kind not in (OpKind.LINEAR, OpKind.MATMUL) or not op.params:  # a tied weight's gradient too
        return 0.0
    return comm_s - exposed_beside_s(op_costs[name].bwd_s / 2, comm_s, slowdown=ctx.gpu.overlap_slowdown)


def _gemm_op(name: str | None, graph: OpGraph) -> bool:
    op = graph.op(name) if name is not None else None
    return op is not None and op.kind in (OpKind.LINEAR, OpKind.MATMUL) and bool(op.params)


def _gemm_readers(readers: list[str] | None, graph: OpGraph) -> list[str]:
    """Of the ops reading one gathered input, the GEMMs (q, k and v; gate and up): what one gather feeds."""
    return [r for r in readers or () if _gemm_op(r, graph)]


def input_readers(tg) -> dict[str, list[str]]:
    """Template op -> the ops reading its output as their first input: the consumers one redistribution of that
    output feeds (q, k and v reading one norm output; gate and up)."""
    readers: dict[str, list[str]] = {}
    for e in tg.edges:
        if e.index == 0:
            readers.setdefault(e.src, []).append(e.dst)
    return readers


def _beside_gemms(fwd_comm_s: float, bwd_comm_s: float, consumer: str, producer: str | None, op_costs,
                  graph: OpGraph, ctx: PlanContext, *, replays: int = 1, readers: list[str] | None = None,
                  share: float = 1.0) -> float:
    """Of a tensor-parallel collective's forward and backward seconds, those hidden under tp_overlap "all": the
    collective is cut into chunks pipelined with the GEMM it feeds or is fed by (a column-parallel Linear's input
    all-gather with its GEMM, a row-parallel Linear's output reduce-scatter with its; in backward the gradient's
    collective with the data-gradient GEMM, half the backward): Megatron-Core's --tp-comm-overlap (Transformer
    Engine's userbuffers: chunked all-gather / reduce-scatter GEMM overlap) and torchtitan's async TP
    (micro-pipelined `fused_all_gather_matmul` / `fused_matmul_reduce_scatter`, torch/distributed/
    _symmetric_memory). What outlasts that GEMM stays exposed (`exposed_beside_s`): a collective beside no GEMM
    (a norm's statistics) hides nothing. The PyTorch team reports ~20% forward and ~8% end-to-end gains for
    Llama 3 70B from async TP ("Introducing Async Tensor Parallelism in PyTorch", discuss.pytorch.org, 2024):
    an overlap bounded by the GEMMs beside the collectives, not the whole step's compute. `replays`: forwards
    run per micro-batch (2 where full recompute runs the collective and its GEMM again).

    A gathered input several GEMMs read (`readers`, the consumers of the producer's output; this edge's `share`
    of the one redistribution): the all-gather is pipelined with all of them (Inductor's
    `fuse_all_gather_matmul` takes every matmul consuming the gathered tensor; Megatron-Core fuses q, k and v,
    and gate and up, into one GEMM), so it hides beside their sum. Their summed input gradient's reduce-scatter
    hides only where one GEMM produces it: Megatron-Core's fused GEMM; Inductor fuses a reduce-scatter with
    its producer only when that is a matmul (micro_pipeline_tp.py `_find_producer_matmul`), not the sum of
    separate q, k and v (or gate and up) data gradients, as torchtitan's compiled Linears make it: exposed."""
    if ctx.tp_overlap != "all" or fwd_comm_s + bwd_comm_s <= 0:
        return 0.0
    name = consumer if _gemm_op(consumer, graph) else producer if _gemm_op(producer, graph) else None
    if name is None or (ctx.compile and not ctx.compiled(graph.op(name))):
        return 0.0  # Inductor fuses only inside compiled blocks: torchtitan's output Linear gathers by NCCL
    slow, gemms, part = ctx.gpu.overlap_slowdown, [name], 1.0
    grouped = _gemm_readers(readers, graph) if name == consumer else []
    if len(grouped) > 1:
        gemms, part = grouped, share
    fwd_gemm = sum(op_costs[g].fwd_s for g in gemms)
    bwd_gemm = sum(op_costs[g].bwd_s for g in gemms) / 2
    fwd = fwd_comm_s - part * exposed_beside_s(fwd_gemm, fwd_comm_s / part, slowdown=slow)
    if len(gemms) > 1 and not ctx.megatron_engine:
        return replays * fwd  # the summed gradient's reduce-scatter has no one GEMM to pipeline with
    return replays * fwd + bwd_comm_s - part * exposed_beside_s(bwd_gemm, bwd_comm_s / part, slowdown=slow)


def _fused_tp_kernels_s(e, c, graph: OpGraph, assign: dict[str, OpStrategy], ctx: PlanContext, *,
                        readers: list[str] | None = None, share: float = 1.0) -> tuple[float, float]:
    """(forward, backward) seconds of kernels Inductor's fused collective-matmul ops run beyond the GEMM and the
    collective they replace (cost_models/async_tp.py), for edge `e` under torchtitan's async TP
    (`--tp-comm-overlap all --compile`), inside compiled blocks. A forward all-gather into a Linear
    (`fused_all_gather_matmul`): the Linear's GEMM in tp row chunks and the staged local shard (its `share` of
    one gather several readers take); the reduce-scatter of its input gradient, fused only where one Linear reads
    the gathered input (`_beside_gemms`): the data-gradient GEMM in chunks and the sum of the partials. A
    forward reduce-scatter of a Linear's output (`fused_matmul_reduce_scatter`): the same on the other side."""
    if ctx.tp_overlap != "all" or not ctx.compile or c.fwd_s + c.bwd_s <= 0:
        return 0.0, 0.0
    kinds = {kind for kind, _ in c.fwd_comm}
    if _gemm_op(e.dst, graph) and ctx.compiled(graph.op(e.dst)) and kinds == {"all_gather"}:
        name, gather_first = e.dst, True
    elif _gemm_op(e.src, graph) and ctx.compiled(graph.op(e.src)) and kinds == {"reduce_scatter"}:
        name, gather_first = e.src, False
    else:
        return 0.0, 0.0
    dims = linear_gemm(graph.op(name), assign[name], ctx)
    if dims is None:
        return 0.0, 0.0
    m, n, k, f8 = dims
    tp, gpu, ab = ctx.mesh.degree("tp"), ctx.gpu, ctx.precision.act_bytes
    fwd = chunked_gemm_extra_s(m, n, k, tp, gpu, float8=f8, bytes_per_elem=ab)
    bwd = chunked_gemm_extra_s(m, k, n, tp, gpu, float8=f8, bytes_per_elem=ab)
    if gather_first:
        x_bytes = 1 if f8 and float8_input_cast_on_edge(ctx) else ab  # gathered in float8 where cast on the shard
        fwd += share * staged_shard_s(m // tp * k * x_bytes, gpu)
        if len(_gemm_readers(readers, graph)) > 1:
            return fwd, 0.0  # the summed input gradient's reduce-scatter is NCCL's (`_beside_gemms`)
        return fwd, bwd + partials_sum_s(m * k * ab, tp, gpu)
    return fwd + partials_sum_s(m * n * ab, tp, gpu), bwd + staged_shard_s(m // tp * n * ab, gpu)


def _optim_bytes_per_param(ctx: PlanContext) -> float:
    return ctx.precision.master_bytes + ctx.precision.optim_bytes


def loss_s(output: TensorMeta, ctx: PlanContext) -> float:
    """Seconds of the training loss on one micro-batch's output, each way. Eager cross-entropy over logits is
    log_softmax then nll_loss in fp32 (the logits upcast first), about three fp32 passes each way and four
    kernels. A fused cross-entropy kernel (`ctx.fused_loss`) reads the 16-bit logits once forward, reads them
    and writes their gradient backward: half of those three passes each way, one kernel. Outputs without a
    batch dim or that are not floating point cost nothing."""
    if not has_loss(output):
        return 0.0
    if ctx.fused_loss:
        return memory_bound_time_s(1.5 * output.numel * ctx.micro_batch * ctx.precision.act_bytes, ctx.gpu)
    return memory_bound_time_s(3 * output.numel * ctx.micro_batch * 4, ctx.gpu, kernels=4)


def has_loss(output: TensorMeta) -> bool:
    """A model output the training loss is computed on: floating point, with a batch dim."""
    return bool(output.batch_dims) and output.dtype.startswith(("float", "bfloat"))


def loss_per_stage(graph: OpGraph, outputs, stage: dict[str, int], ctx: PlanContext,
                   degree: int, assign: dict[str, OpStrategy] | None = None) -> tuple[list[float], list[float]]:
    """Per pipeline stage: seconds of the loss each way (`loss_s`) and bytes it holds at the start of
    backward (`loss_buffer_bytes`), on the stage that computes the model's outputs.

    Under `ctx.loss_parallel` (vocabulary-parallel cross-entropy: Megatron-LM's `vocab_parallel_cross_entropy`,
    Shoeybi et al. 2019 §3; torch's `loss_parallel`, which torchtitan runs under tensor parallelism) each rank
    computes the loss on its vocabulary shard of the outputs `assign` leaves sharded, and all-reduces three fp32
    values per token (the max logit, the sum of exponentials, the target's logit) in forward."""
    secs, nbytes = [0.0] * degree, [0.0] * degree
    for name in outputs:
        meta = graph.op(name).output_meta
        shards = vocab_shards(assign[name].output, ctx) if assign is not None else 1
        secs[stage[name]] += loss_s(meta, ctx) / shards
        if has_loss(meta):
            nbytes[stage[name]] += loss_buffer_bytes(meta.numel * ctx.micro_batch / shards, fused=ctx.fused_loss,
                                                     act_bytes=ctx.precision.act_bytes)
            if shards > 1:
                axes = tuple(a for a, p in assign[name].output.items if p == FEAT and a in ctx.mesh.tp_axes)
                tokens = meta.numel / max(1, meta.shape[-1]) * ctx.micro_batch
                # forward only: `secs` is charged each way, so half of it each way
                secs[stage[name]] += 3 * ctx.redistribute_s("all_reduce", 4 * tokens, axes) / 2
    return secs, nbytes


def cached_logits_bytes(graph: OpGraph, outputs, stage: dict[str, int], ctx: PlanContext, pipe: PipelineSpec,
                        assign: dict[str, OpStrategy] | None = None) -> list[float]:
    """Per stage, bytes of the model's outputs (the logits the loss reads) the last stage keeps for backward: as
    any chunk output (`cached_chunk_outputs_bytes`), for each micro-batch whose last chunk has run forward and not
    yet backward: all m under GPipe and layered accumulation, one under 1F1B (its backward follows at once). At
    the outputs' precision, on each rank's vocabulary shard under `loss_parallel`. Measured with the chunk
    outputs (tests/distributed/test_pipeline.py: GPipe's last stage 8 x, 1F1B's 1 x the logits). Not the loss's
    own buffers (`loss_per_stage`, `held_loss_bytes`)."""
    out = [0.0] * pipe.degree
    if not keeps_chunk_outputs(ctx, pipe):
        return out
    inflight = _loss_inflight(ctx, pipe)
    for name, meta, shards in _loss_outputs(graph, outputs, ctx, assign):
        out[stage[name]] += inflight * meta.numel * ctx.micro_batch * ctx.precision.act_bytes / shards
    return out


def held_loss_bytes(graph: OpGraph, outputs, stage: dict[str, int], ctx: PlanContext, pipe: PipelineSpec,
                    assign: dict[str, OpStrategy] | None = None, *, first: bool = False) -> list[float]:
    """Per stage, bytes of the loss's own saved tensors (`memory.loss_saved_bytes`: the fp32 log-probabilities)
    for the micro-batches whose loss has run forward and not yet backward beside the one `loss_per_stage`
    prices at the start of backward: m - 1 under GPipe and layered accumulation, on one rank or across pipeline
    stages (every micro-batch's loss graph lives until the backward phase), none under 1F1B and interleaving (a
    micro-batch's backward follows its last chunk's forward). `first`: count that one too (the bytes at their
    peak, as tests/distributed/test_pipeline.py measures them). On each rank's vocabulary shard under
    `loss_parallel`."""
    out = [0.0] * pipe.degree
    count = _loss_inflight(ctx, pipe) - (0 if first else 1)
    if not count:
        return out
    for name, meta, shards in _loss_outputs(graph, outputs, ctx, assign):
        numel = meta.numel * ctx.micro_batch
        rows = numel / max(1, meta.shape[-1])
        out[stage[name]] += count * loss_saved_bytes(numel / shards, rows, fused=ctx.fused_loss)
    return out


def _loss_inflight(ctx: PlanContext, pipe: PipelineSpec) -> int:
    """Micro-batches whose last chunk (and loss) has run forward and not yet backward at the peak: all m under
    GPipe across stages and under layered accumulation (every forward first), else 1."""
    return ctx.num_microbatches if pipe.layered or (pipe.degree > 1 and pipe.schedule == "gpipe") else 1


def _loss_outputs(graph: OpGraph, outputs, ctx: PlanContext, assign: dict[str, OpStrategy] | None):
    """(name, meta, vocabulary shards) of each model output the loss is computed on (`has_loss`)."""
    for name in outputs:
        meta = graph.op(name).output_meta
        if has_loss(meta):
            yield name, meta, vocab_shards(assign[name].output, ctx) if assign is not None else 1


def stage_units(graph: OpGraph, pipe: PipelineSpec, stage: dict[str, int]) -> list[int]:
    """Blocks per stage: the granularity at which communication can be overlapped."""
    cache = graph_cache(graph)
    key = ("units", pipe.degree, pipe.virtual_stages, pipe.stage_layers)
    if key not in cache:
        cache[key] = [max(1, len({op.layer for op in graph.ops if op.layer is not None and stage[op.name] == k}))
                      for k in range(pipe.degree)]
    return cache[key]


def _boundary_edges(graph: OpGraph, pipe: PipelineSpec):
    """(producer, its chunk, consumer's chunk, meta) of every edge between chunks."""
    cache = graph_cache(graph)
    key = ("cuts", pipe.degree, pipe.virtual_stages, pipe.stage_layers)
    if key not in cache:
        chunk = stage_of(graph, pipe)
        cache[key] = [(src, chunk[src], chunk[dst], meta) for src, dst, _, meta in planned_edges(graph)
                      if chunk[src] != chunk[dst]]
    return cache[key]


def cut_sends(graph: OpGraph, assign: dict[str, OpStrategy], ctx: PlanContext,
              pipe: PipelineSpec) -> list[tuple[float, float, tuple[str, ...]]]:
    """Per cut between consecutive chunks (cut c: chunk c -> c + 1), per micro-batch: (bytes one rank sends
    across it, bytes of the hidden states it hands over, the tensor-parallel axes the receiver all-gathers
    them on). The hidden states are the largest activation chunk c hands to chunk c + 1 (the runtime sends
    only those; what later chunks need from before the blocks, rotary tables, masks, they compute again in
    the model's own forward), for this data-parallel replica's micro-batch. With tensor parallelism across a
    pipeline (degree > 1) each tensor-parallel rank sends only its 1/t slice of the sequence: sequence
    parallelism leaves them sharded so already; when the producer leaves them replicated over the
    tensor-parallel group (1D without sequence parallelism), the sender keeps its slice and the receiver
    all-gathers the rest over the group's fast links (Megatron-LM's scatter/gather of pipeline sends,
    Narayanan et al. 2021 §4.1), their gradient the same way back. Other layouts go as the producer shards
    the sequence. runtime/pipeline.py `_SPMDBoundary` sends exactly this (measured in
    tests/distributed/test_pipeline.py). A sequence the tensor-parallel degree does not divide goes whole."""
    chunks = pipe.degree * pipe.virtual_stages
    out: list[tuple[float, float, tuple[str, ...]]] = [(0.0, 0.0, ())] * max(0, chunks - 1)
    if chunks == 1:
        return out
    to_t = template_for(graph, pipe)[0].to_template
    tp_axes = tuple(a for a in ctx.mesh.tp_axes if ctx.mesh.degree(a) > 1) if pipe.degree > 1 else ()
    t = math.prod(ctx.mesh.degree(a) for a in tp_axes)
    for src, c_src, c_dst, meta in _boundary_edges(graph, pipe):
        if c_dst != c_src + 1:
            continue
        lay = (assign.get(src) or assign[to_t[src]]).output
        planned = tuple(a for a, p in lay.items if p == SEQ and a != "dp")
        whole = tensor_bytes(meta, ctx.precision, samples=ctx.micro_batch)
        replicated = not any(a in tp_axes for a, _ in lay.items)
        if t > 1 and replicated and len(meta.shape) >= 2 and meta.shape[1] % t == 0:
            sent = (whole / t, whole, tp_axes)
        else:
            sent = (whole / math.prod(ctx.mesh.degree(a) for a in planned), whole, ())
        if sent[0] > out[c_src][0]:
            out[c_src] = sent
    return out


def cut_bytes(graph: OpGraph, assign: dict[str, OpStrategy], ctx: PlanContext, pipe: PipelineSpec) -> list[float]:
    """Bytes one rank sends across each cut per micro-batch (`cut_sends`); the gradient comes back across
    the same cut in backward."""
    return [sent for sent, _, _ in cut_sends(graph, assign, ctx, pipe)]


def cached_chunk_outputs_bytes(graph: OpGraph, ctx: PlanContext, pipe: PipelineSpec) -> list[float]:
    """Per stage, bytes of its chunks' outputs torch.distributed.pipelining keeps per micro-batch in flight: a
    stage holds each chunk forward's output until that micro-batch's backward (stage.py `fwd_cache`, which keeps
    the output tuple for the backward's `torch.autograd.backward(outputs, grads)`), an activation no op of the
    chunk saves (the last block's residual sum). What one rank holds is what it sends (`cut_sends`: the
    tensor-parallel rank's slice, taken as a copy); without an assignment, as here for the ILP's constant rows,
    the hidden states / the tensor-parallel degree, what 1D sends with or without sequence parallelism. With v
    chunks per stage, `inflight_microbatches` counts v chunk forwards per micro-batch, and at the peak those in
    flight are of the stage's earlier chunks (the warm-up runs them first; the last chunk's forward is followed by
    its backward at once): each counts as the stage's largest send, v times it per micro-batch. Measured on 4 gloo
    ranks (tests/distributed/test_pipeline.py): 1F1B, GPipe and interleaved 1F1B, with 1D tensor parallelism.
    Layered accumulation on one rank (degree 1, v chunks, looped BFS) keeps every chunk's output but the last for
    all m micro-batches (every forward runs first), whole where nothing is sent (an upper bound here: sequence
    parallelism holds 1/t of it). Not here: the last chunk's output (the logits): `cached_logits_bytes`."""
    if not keeps_chunk_outputs(ctx, pipe):
        return [0.0] * pipe.degree
    return held_per_stage(chunk_sends_bytes(graph, ctx, pipe), pipe)


def chunk_sends_bytes(graph: OpGraph, ctx: PlanContext, pipe: PipelineSpec) -> list[float]:
    """Per cut, bytes one rank sends per micro-batch without an assignment (the ILP's constant rows): the
    hidden states / the tensor-parallel degree across stages, what 1D sends with or without sequence
    parallelism (`cut_sends`); whole on one rank."""
    tp = ctx.mesh.tp_degree if pipe.degree > 1 else 1
    return [max((tensor_bytes(meta, ctx.precision, samples=ctx.micro_batch) / tp
                 for _, c_src, c_dst, meta in _boundary_edges(graph, pipe) if c_src == c and c_dst == c + 1),
                default=0.0) for c in range(pipe.degree * pipe.virtual_stages - 1)]


def recv_buffer_bytes(sends: list[float], ctx: PlanContext, pipe: PipelineSpec) -> list[float]:
    """Per stage, bytes of the receive buffers torch.distributed.pipelining allocates once for every micro-batch
    of the step and keeps (stage.py `_prepare_forward_infra` / `_setup_backward_recv_info`: a `_RecvInfo` buffer
    per micro-batch): for each cut c (`sends[c]` bytes per micro-batch, chunk c -> c + 1), m buffers of the
    hidden states on the chunk that receives them and m of their gradient on the chunk that sent them; on one
    rank too (layered accumulation). Measured to the byte on 4 gloo ranks (tests/distributed/test_pipeline.py:
    1F1B, GPipe, interleaved, layered, 1D). Megatron's schedules allocate per transfer: none. The in-flight
    micro-batches' received hidden states are also the saved input of their chunk's first op, counted there
    again (at most p micro-batches' hidden states over)."""
    out = [0.0] * pipe.degree
    if not keeps_chunk_outputs(ctx, pipe):
        return out
    m = ctx.num_microbatches
    for c, sent in enumerate(sends):
        out[c % pipe.degree] += m * sent  # the gradient coming back to what chunk c sent
        out[(c + 1) % pipe.degree] += m * sent  # the hidden states chunk c + 1 receives
    return out


def keeps_chunk_outputs(ctx: PlanContext, pipe: PipelineSpec) -> bool:
    """Whether the schedule's stages keep chunk outputs for backward: torch.distributed.pipelining's
    (`PlanContext.pipeline_keeps_outputs`) across pipeline stages, or on one rank under layered accumulation."""
    return ctx.pipeline_keeps_outputs and (pipe.degree > 1 or pipe.layered)


def held_per_stage(sends: list[float], pipe: PipelineSpec) -> list[float]:
    """Per stage, cached chunk-output bytes per micro-batch in flight from each cut's send (chunk c -> c + 1,
    sent by stage c mod p): v times the stage's largest (`cached_chunk_outputs_bytes`); on one rank (layered
    accumulation), their sum."""
    out = [0.0] * pipe.degree
    if pipe.degree == 1:  # layered on one rank: each cut's sender is this rank, every output alive at once
        return [float(sum(sends))]
    for c, sent in enumerate(sends):
        out[c % pipe.degree] = max(out[c % pipe.degree], pipe.virtual_stages * sent)
    return out


def _boundaries(graph, assign, ctx, pipe, stages) -> None:
    """What a stage waits for at chunk boundaries, per micro-batch: the hidden states of each chunk it holds
    arriving across the cut before it (forward) and their gradient across the cut after it (backward); its own
    sends are asynchronous (`isend`) and cost it nothing, a receive blocks until the data is there
    (torch.distributed.pipelining posts and waits each receive right before the compute that needs it). So
    inner stages wait for two transfers per chunk, the first and last stage of the pipeline for one. Plus the
    tensor-parallel all-gathers of scattered sends (`cut_sends`): the receiver's of the hidden states in
    forward, the sender's of their gradient in backward. And memory: the sender keeps what it sends (its
    chunk's output) until that micro-batch's backward (`cached_chunk_outputs_bytes`)."""
    sends = cut_sends(graph, assign, ctx, pipe)
    if keeps_chunk_outputs(ctx, pipe):
        sent = [s for s, _, _ in sends]
        for st, cached, recv in zip(stages, held_per_stage(sent, pipe), recv_buffer_bytes(sent, ctx, pipe),
                                    strict=True):
            st.cached, st.recv_buffers = cached, recv
    if pipe.degree == 1:
        return
    for c, (sent, whole, gather) in enumerate(sends):
        sender, receiver = stages[c % pipe.degree], stages[(c + 1) % pipe.degree]
        wait = ctx.p2p_s(sent)
        sender.p2p += wait
        receiver.p2p += wait
        if gather:
            t = ctx.redistribute_s("all_gather", whole, gather)
            sender.tp += t
            receiver.tp += t


def stage_exposed_s(st: _Stage, ctx: PlanContext, pipe: PipelineSpec, m: int) -> tuple[float, float]:
    """(exposed ZeRO traffic, exposed tensor-parallel traffic) of one micro-batch on a stage (module doc)."""
    s, u = ctx.gpu.overlap_slowdown, st.units
    if pipe.layered:  # one forward phase over all m micro-batches per block, one backward phase: per step
        dp = (exposed_comm_s(m * st.fwd, st.dp_fwd, units=u, slowdown=s)
              + exposed_comm_s(m * st.bwd, st.dp_bwd, units=u, slowdown=s)) / m
    else:
        dp = (exposed_comm_s(st.fwd, st.dp_fwd, units=u, slowdown=s)
              + exposed_comm_s(st.bwd, st.dp_bwd, units=u, slowdown=s))
    dp += st.dp_sync
    # "backward": what ran beside weight-gradient GEMMs is hidden (`_beside_wgrad`); "all": what ran beside the
    # GEMMs each collective is pipelined with (`_beside_gemms`); "": nothing is
    tp = st.tp - st.tp_hidden
    return dp, tp


def iteration_sync_s(st: _Stage, ctx: PlanContext, pipe: PipelineSpec, m: int, drain_s: float = 0.0) -> float:
    """Exposed seconds of a stage's once-per-step data-parallel traffic, where the runtime issues it
    (runtime/data_parallel.py `set_microbatch`): ZeRO-0's all-reduce and ZeRO-1's reduce-scatter overlap the last
    micro-batch's backward, ZeRO-1 and -2's parameter gather the first micro-batch's forward. Those phases
    already hide their own traffic (ZeRO-3's gathers, ZeRO-2 and -3's reduce-scatters; spread over the m
    micro-batches of a layered pipeline's phases) on the same link: what both expose together beyond what
    their own traffic does (a phase whose own traffic saturates the link hides none of the step's).

    In a pipeline (degree > 1) the gradient reduction runs after the stage's last backward, with nothing of
    its own left to hide it: torch.distributed.pipelining's REDUCE_GRAD action follows the schedule's last
    backward (schedules.py `_step_microbatches`, then `perform_reduce_grad`), as Megatron-LM's data-parallel
    all-reduce follows the pipeline flush (Narayanan et al. 2021 §2.2). Only the `drain_s` by which the stage
    finishes before the first stage's last backward hides it (the later stages are done earlier)."""
    s, u = ctx.gpu.overlap_slowdown, st.units

    def beside(compute: float, own: float, extra: float) -> float:
        own = own / m if pipe.layered else own
        return (exposed_comm_s(compute, own + extra, units=u, slowdown=s)
                - exposed_comm_s(compute, own, units=u, slowdown=s))

    gather = beside(st.fwd, st.dp_fwd, st.dp_iter_fwd)
    if pipe.degree > 1:
        return max(0.0, st.dp_iter - drain_s) + gather
    return beside(st.bwd, st.dp_bwd, st.dp_iter) + gather


def core_share(ctx: PlanContext) -> float:
    """The fraction of a core each rank gets when all ranks of a node compute at once: CPU ranks that
    outnumber the node's cores (`num_sms` of a CPU profile) share them; GPUs have their own device."""
    gpu = ctx.gpu
    if gpu.device != "cpu":
        return 1.0
    return min(1.0, gpu.num_sms / ctx.cluster.gpus_per_node)


def _iteration(stages: list[_Stage], ctx: PlanContext, pipe: PipelineSpec, m: int):
    """(total seconds, TimeBreakdown, slowest stage time per micro-batch, per-stage times).

    Ranks sharing cores (`core_share` < 1) compute at their share while all of them are busy; a pipeline's
    bubble leaves some idle, so its step is the longer of the schedule at full speed and the stages' work at
    their share (the cores are busy either way)."""
    share = core_share(ctx)
    full, shared = [], []
    for st in stages:
        dp, tp = stage_exposed_s(st, ctx, pipe, m)
        full.append(st.fwd + st.bwd + tp + dp + st.p2p)
        shared.append((st.fwd + st.bwd) / share + tp + dp + st.p2p)
    fill = pipeline_fill(pipe, m)
    t, t_shared = max(full), max(shared)
    slow = full.index(t)
    steady_and_fill = max((m + fill) * t, m * t_shared)
    bubble = steady_and_fill - m * t_shared
    # stage k's last backward ends k chunk backwards before the first stage's (the schedule's drain)
    sync = max(iteration_sync_s(st, ctx, pipe, m, drain_s=k * st.bwd / pipe.virtual_stages)
               for k, st in enumerate(stages))
    opt = max(optimizer_s(st, ctx) for st in stages) / share
    busy = m * (stages[slow].fwd + stages[slow].bwd) / share
    waits = m * stages[slow].host_wait
    breakdown = TimeBreakdown(compute_s=busy - waits, host_bound_s=waits, exposed_comm_s=m * t_shared - busy + sync,
                              bubble_s=bubble, optimizer_s=opt)
    return breakdown.total_s, breakdown, full


def optimizer_s(st: _Stage, ctx: PlanContext) -> float:
    """Seconds of the AdamW step over a stage's parameters: its kernels' HBM traffic and its per-tensor host work,
    one after the other where the host is the device (CPU ranks), the longer of the two on a GPU
    (cost_models/host.py)."""
    fused, passes = ctx.fused_pointwise, OPTIMIZER_PASSES[ctx.fused_pointwise]
    kernels = memory_bound_time_s(optimizer_step_bytes(st.params, ctx.precision, fused=fused), ctx.gpu, kernels=passes)
    host = optimizer_step_host_s(st.param_tensors, ctx)
    return max(kernels, host) if separate_host(ctx.gpu) else kernels + host


def optimizer_step_host_s(param_tensors: int, ctx: PlanContext) -> float:
    """Host seconds of the AdamW step's per-tensor work over `param_tensors` tensors: torch.optim.AdamW on
    FSDP2's DTensor parameters (the runtime's, and any torch optimizer on FSDP: `torch_fsdp_and_optimizer`;
    another engine's fused optimizer: 0 on a GPU)."""
    if separate_host(ctx.gpu) and not ctx.torch_fsdp_and_optimizer:
        return 0.0
    return optimizer_host_s(param_tensors, ctx.gpu)


def _memory(stages: list[_Stage], ctx: PlanContext, pipe: PipelineSpec, m: int) -> list[MemoryBreakdown]:
    groups = sum(1 for a in ctx.mesh.names if ctx.mesh.degree(a) > 1)
    out = []
    for i, st in enumerate(stages):
        acts = (st.saved + st.cached) * inflight_microbatches(i, pipe, m) + st.recompute_peak + st.logits + \
            st.recv_buffers
        transient = 2 * st.transient + st.loss_bytes
        dynamic = acts + transient  # allocated and freed every step: what fragments the allocator's pool
        out.append(st.memory + MemoryBreakdown(activations_bytes=acts, transient_bytes=transient,
                                               other_bytes=framework_overhead_bytes(groups)
                                               + ctx.fragmentation * dynamic))
    return out


def evaluate(graph: OpGraph, assign: dict[str, OpStrategy], ctx: PlanContext, pipe: PipelineSpec,
             *, global_batch: int, check_tied: bool = True) -> Evaluation:
    """Predict iteration time, throughput and per-GPU memory of `assign` on `ctx` with pipeline `pipe`.

    `assign` may cover every op, or only the template ops (block 0 of each repeated group and the ops
    outside blocks) with `check_tied=False`: the search prices thousands of candidates that way."""
    graph = with_stage_copies(graph, pipe)
    tg, stage = template_for(graph, pipe)
    missing = [op.name for op in tg.ops if op.name not in assign]
    if missing:
        raise ValueError(f"assignment lacks strategies for {len(missing)} ops, e.g. {missing[:3]}")
    if check_tied:
        untied = [n for n, t in tg.to_template.items() if n in assign and not same_strategy(assign[n], assign[t])]
        if untied:
            raise ValueError(f"blocks must share strategies: {untied[0]} differs from {tg.to_template[untied[0]]}")
    op_costs, edges, outs = _template_costs(graph, assign, ctx, tg)
    stages = _accumulate(graph, assign, ctx, pipe, tg, op_costs, edges, outs, stage)
    m = ctx.num_microbatches
    total, breakdown, per_mb = _iteration(stages, ctx, pipe, m)
    mems = _memory(stages, ctx, pipe, m)
    peak = max(mems, key=lambda x: x.total_bytes)
    tokens = global_batch * (graph.seq_len or 1)
    matmul_flops = graph.matmul_flops_per_sample
    if ctx.cp > 1:  # a rank-local graph's attention covers 1/cp of the keys (cost_models/context_parallel.py)
        matmul_flops += (ctx.cp - 1) * sum(op.fwd_flops for op in graph.ops if op.kind is OpKind.ATTENTION)
    model_flops = 3.0 * matmul_flops * global_batch
    n_gpus = ctx.mesh.size
    tflops = model_flops / total / n_gpus / 1e12
    pred = Prediction(iteration_time_s=total, tokens_per_s=tokens / total, mfu=tflops / ctx.gpu.peak_tflops,
                      model_tflops_per_gpu=tflops, memory=peak, time=breakdown)
    return Evaluation(prediction=pred, op_costs={n: op_costs[t] for n, t in tg.to_template.items()
                                                 if t in op_costs}, edge_costs=edges, output_costs=outs,
                      stage_memory=tuple(mems), stage_time_s=tuple(per_mb))


def edge_step_s(c: EdgeCost, in_block: bool, ctx: PlanContext) -> float:
    """Seconds of an edge per micro-batch on the critical path: its redistribution both ways, and under full
    recompute the forward's again where the edge is inside a block (recomputed up to where the checkpoint
    stops: `TemplateEdge.in_block`)."""
    return c.time_s + (c.fwd_s if ctx.recompute == "full" and in_block else 0.0)


def edge_time_s(e, src: Layout, key: tuple, ctx: PlanContext) -> float:
    """Seconds to bring template edge `e` from producer layout `src` to consumer key `key` (and its gradient
    back); under full recompute an edge inside a block is redistributed again in the recomputed forward."""
    return edge_step_s(edge_cost(e.meta, src, key[0], key[1], ctx, regather=key[2], **e.shares), e.in_block, ctx)


def optimizer_s_per_state_byte(ctx: PlanContext) -> float:
    """Seconds of the optimizer step per byte of optimizer state (`OpCost.optim_bytes` counts the master
    weights and moments): the step streams the local shard's states through HBM."""
    precision = ctx.precision
    step_bytes = optimizer_step_bytes(1.0, precision, fused=ctx.fused_pointwise)
    hbm = ctx.gpu.hbm_gbps * 1e9 * ctx.gpu.hbm_efficiency
    return step_bytes / (precision.master_bytes + precision.optim_bytes) / hbm
