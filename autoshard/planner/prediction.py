"""What a plan makes one rank do, as the cost model predicts it: collective bytes per step, parameter bytes.

The runtime measures the same quantities (`autoshard.runtime.measure_step_comm`, `local_param_bytes`); the
distributed tests compare the two, so the cost model prices what actually runs.
"""

from __future__ import annotations

from collections import defaultdict

from autoshard.capture.ir import OpGraph
from autoshard.planner.context import PlanContext, default_precision
from autoshard.planner.evaluate import Evaluation, evaluate
from autoshard.planner.plan import Plan
from autoshard.planner.template import template_for

__all__ = ["context_for", "evaluate_plan", "predicted_step_comm", "predicted_param_bytes"]


def context_for(plan: Plan, cluster, graph: OpGraph) -> PlanContext:
    return PlanContext(mesh=plan.mesh, cluster=cluster, micro_batch=plan.micro_batch,
                       num_microbatches=plan.num_microbatches, precision=default_precision(cluster),
                       recompute=plan.recompute, seq=graph.seq_len)


def evaluate_plan(plan: Plan, graph: OpGraph, cluster) -> Evaluation:
    assign = {p.op: p.strategy for p in plan.ops}
    return evaluate(graph, assign, context_for(plan, cluster, graph), plan.pipeline, global_batch=plan.global_batch)


def predicted_step_comm(plan: Plan, graph: OpGraph, cluster, *, stage: int = 0) -> dict[str, float]:
    """Bytes (full buffer per call, nccl-tests convention) per collective kind one rank of pipeline stage
    `stage` issues in one iteration: every micro-batch's op and edge traffic, plus once-per-step gradient
    synchronization."""
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
        for kind, nbytes in ev.edge_costs[(e.src, e.dst, e.index)].comm:
            out[kind] += m * n * nbytes
    for name, c in ev.output_costs.items():
        if stage_of[name] == stage:
            for kind, nbytes in c.comm:
                out[kind] += m * nbytes
    return dict(out)


def predicted_param_bytes(plan: Plan, graph: OpGraph, cluster, *, stage: int = 0) -> float:
    """Parameter bytes one rank of `stage` holds between steps (sharded storage, ZeRO-3 shards)."""
    ev = evaluate_plan(plan, graph, cluster)
    _, stage_of = template_for(graph, plan.pipeline)
    return sum(c.param_bytes for name, c in ev.op_costs.items() if stage_of[name] == stage)
