"""What a plan makes one rank do, as the cost model predicts it: collective bytes per step, parameter bytes.

The runtime measures the same quantities (`autoshard.runtime.measure_step_comm`, `local_param_bytes`); the
distributed tests compare the two, so the cost model prices what actually runs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from autoshard.capture.ir import OpGraph
from autoshard.cost_models.context import PlanContext, default_precision
from autoshard.cost_models.evaluate import (
    Evaluation,
    cached_logits_bytes,
    cut_bytes,
    cut_sends,
    evaluate,
    held_loss_bytes,
    held_per_stage,
    inflight_microbatches,
    keeps_chunk_outputs,
    recv_buffer_bytes,
)
from autoshard.cost_models.template import template_for
from autoshard.plans.contract import expert_ops, kv_head_fraction
from autoshard.plans.plan import Plan
from autoshard.plans.strategies import same_strategy

__all__ = ["context_for", "priced_graph", "evaluate_plan", "predicted_step_comm", "predicted_p2p_bytes",
           "predicted_cached_output_bytes", "predicted_cached_logits_bytes",
           "predicted_held_loss_bytes", "predicted_recv_buffer_bytes",
           "predicted_param_bytes"]


def context_for(plan: Plan, cluster, graph: OpGraph) -> PlanContext:
    """The context `plan` was priced in; for a context-parallel plan `graph` is the rank-local graph (captured
    at plan.seq / cp tokens) and the mesh has cp folded into dp (planner/estimate.py)."""
    cp = plan.mesh.degree("cp")
    return PlanContext(mesh=plan.mesh.folded_cp(), cluster=cluster, micro_batch=plan.micro_batch,
                       num_microbatches=plan.num_microbatches, precision=default_precision(cluster),
                       recompute=plan.recompute, seq=graph.seq_len, cp=cp,
                       cp_kv_fraction=kv_head_fraction(graph), ep=plan.ep, compile=plan.compile,
                       float8=plan.float8)


def priced_graph(plan: Plan, graph: OpGraph) -> OpGraph:
    """`graph` itself when the plan gives every instance of a repeated block the same strategies (as the
    planner does), else `graph` without its block structure, so that each block is priced as planned (plans
    written by hand may mix strategies across blocks)."""
    by_op = {p.op: p.strategy for p in plan.ops}
    for group in graph.blocks:
        for names in group.op_names[1:]:
            for first, name in zip(group.op_names[0], names, strict=True):
                if first in by_op and name in by_op and not same_strategy(by_op[first], by_op[name]):
                    return replace(graph, blocks=())
    return graph


def evaluate_plan(plan: Plan, graph: OpGraph, cluster) -> Evaluation:
    assign = {p.op: p.strategy for p in plan.ops}
    graph = priced_graph(plan, graph)
    return evaluate(graph, assign, context_for(plan, cluster, graph), plan.pipeline,
                    global_batch=plan.global_batch * plan.mesh.degree("cp"))


def predicted_step_comm(plan: Plan, graph: OpGraph, cluster, *, stage: int = 0) -> dict[str, float]:
    """Bytes (full buffer per call, nccl-tests convention) per collective kind one rank of pipeline stage
    `stage` issues in one iteration: every micro-batch's op and edge traffic, plus once-per-step gradient
    synchronization."""
    graph = priced_graph(plan, graph)
    ev = evaluate_plan(plan, graph, cluster)
    tg, stage_of = template_for(graph, plan.pipeline)
    m = plan.num_microbatches
    out: dict[str, float] = defaultdict(float)
    for op in graph.ops:
        c = ev.op_costs.get(op.name)
        if c is None or stage_of[op.name] != stage:
            continue
        for kind, nbytes in c.comm:
            out[kind] += m * nbytes
        for kind, nbytes in c.iter_comm:
            out[kind] += nbytes
    for e in tg.edges:
        n = e.per_stage[stage]
        c = ev.edge_costs[(e.src, e.dst, e.index)]
        replayed = c.fwd_comm if plan.recompute == "full" and e.in_block else ()  # the recomputed forward's
        for kind, nbytes in (*c.comm, *replayed):
            out[kind] += m * n * nbytes
    for name, c in ev.output_costs.items():
        if stage_of[name] == stage:
            for kind, nbytes in c.comm:
                out[kind] += m * nbytes
    sent = predicted_p2p_bytes(plan, graph, cluster, stage=stage)
    if sent:
        out["p2p"] += sent
    return dict(out)


def predicted_cached_output_bytes(plan: Plan, graph: OpGraph, cluster, *, stage: int = 0) -> float:
    """Bytes of chunk outputs one rank of pipeline stage `stage` keeps for backward at its peak
    (`evaluate.cached_chunk_outputs_bytes`, from what it sends across each cut, `evaluate.cut_sends`)."""
    pipe = plan.pipeline
    graph = priced_graph(plan, graph)
    ctx = context_for(plan, cluster, graph)
    if not keeps_chunk_outputs(ctx, pipe):
        return 0.0
    sends = cut_sends(graph, {p.op: p.strategy for p in plan.ops}, ctx, pipe)
    held = held_per_stage([sent for sent, _, _ in sends], pipe)[stage]
    return held * inflight_microbatches(stage, pipe, plan.num_microbatches)


def _output_args(plan: Plan, graph: OpGraph, cluster) -> tuple:
    """(graph, its outputs, stage of each op, context, pipeline, assignment): what the per-output pricing reads."""
    graph = priced_graph(plan, graph)
    tg, stages = template_for(graph, plan.pipeline)
    assign = {p.op: p.strategy for p in plan.ops}
    return graph, tg.outputs, stages, context_for(plan, cluster, graph), plan.pipeline, assign


def predicted_cached_logits_bytes(plan: Plan, graph: OpGraph, cluster, *, stage: int = 0) -> float:
    """Bytes of the model's outputs one rank of pipeline stage `stage` keeps for backward at its peak
    (`evaluate.cached_logits_bytes`)."""
    return cached_logits_bytes(*_output_args(plan, graph, cluster))[stage]


def predicted_recv_buffer_bytes(plan: Plan, graph: OpGraph, cluster, *, stage: int = 0) -> float:
    """Bytes of the receive buffers one rank of pipeline stage `stage` keeps for the step's micro-batches
    (`evaluate.recv_buffer_bytes`, from what crosses each cut, `evaluate.cut_sends`)."""
    graph = priced_graph(plan, graph)
    ctx = context_for(plan, cluster, graph)
    sends = cut_sends(graph, {p.op: p.strategy for p in plan.ops}, ctx, plan.pipeline)
    return recv_buffer_bytes([sent for sent, _, _ in sends], ctx, plan.pipeline)[stage]


def predicted_held_loss_bytes(plan: Plan, graph: OpGraph, cluster, *, stage: int = 0) -> float:
    """Bytes of the loss's saved tensors one rank of pipeline stage `stage` keeps at their peak, every micro-batch
    whose loss ran forward and not yet backward (`evaluate.held_loss_bytes` with the first one)."""
    return held_loss_bytes(*_output_args(plan, graph, cluster), first=True)[stage]


def predicted_p2p_bytes(plan: Plan, graph: OpGraph, cluster, *, stage: int = 0) -> float:
    """Bytes one rank of pipeline stage `stage` sends in one iteration: per micro-batch and chunk it holds
    (chunk c on stage c mod degree), the hidden states forward across the cut after it and their gradient
    backward across the cut before it (`evaluate.cut_bytes`)."""
    pipe = plan.pipeline
    if pipe.degree == 1:
        return 0.0
    graph = priced_graph(plan, graph)
    cuts = cut_bytes(graph, {p.op: p.strategy for p in plan.ops}, context_for(plan, cluster, graph), pipe)
    chunks = range(stage, pipe.degree * pipe.virtual_stages, pipe.degree)
    per_microbatch = sum((cuts[c] if c < len(cuts) else 0.0) + (cuts[c - 1] if c > 0 else 0.0) for c in chunks)
    return plan.num_microbatches * per_microbatch


def predicted_param_bytes(plan: Plan, graph: OpGraph, cluster, *, stage: int = 0) -> float:
    """Parameter bytes one rank of `stage` holds between steps: tensor-parallel storage shards, divided over dp
    at any ZeRO level above 0. FSDP2 stores ZeRO-2 parameters sharded too and gathers them once per step; the
    memory model's `params_bytes` counts them whole, as the step's peak holds them."""
    graph = priced_graph(plan, graph)
    ev = evaluate_plan(plan, graph, cluster)
    _, stage_of = template_for(graph, plan.pipeline)
    zero = {p.op: p.strategy.zero for p in plan.ops}
    dp = plan.mesh.folded_cp().degree("dp")  # sharded over dp x cp
    experts = set(expert_ops(graph)) if plan.ep > 1 else set()  # over the dp / ep ranks holding them
    return sum(c.param_bytes / ((dp // plan.ep if name in experts else dp) if zero.get(name, 0) in (1, 2) else 1)
               for name, c in ev.op_costs.items() if stage_of[name] == stage)
