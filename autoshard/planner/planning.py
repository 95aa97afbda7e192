"""From a search result to a `Plan`: per-op costs and the runner-up each op had, for `explain`."""

from __future__ import annotations

import math

from autoshard.capture.ir import OpGraph
from autoshard.cost_models.context import PlanContext
from autoshard.cost_models.evaluate import op_sites, sink_layout
from autoshard.cost_models.opcost import edge_cost, grad_partial_axes, op_cost
from autoshard.cost_models.template import template_for
from autoshard.planner.ilp import solver_name
from autoshard.planner.search import (
    DEFAULT_LOWERING,
    Lowering,
    SearchResult,
    allowed,
    candidate_context,
    search,
)
from autoshard.plans.contract import attention_kernel
from autoshard.plans.layouts import MeshSpec
from autoshard.plans.plan import OpPlan, OpStrategy, Plan, graph_fields
from autoshard.plans.strategies import strategies_in

__all__ = ["make_plan", "runner_ups", "plan_from_result"]


def _local_time(graph, tg, name, st, assign, ctx, firsts) -> float:
    """Op time plus the edges it touches, with its neighbours' strategies fixed."""
    op = graph.op(name)
    t = op_cost(op, st, ctx, **firsts[name]).time_s
    for e in tg.edges:
        if e.dst == name:
            t += edge_cost(e.meta, assign[e.src].output, st.inputs[e.index],
                           grad_partial_axes(st) if e.index == 0 else frozenset(), ctx,
                           regather=st.save_sharded_input and e.index == 0, **e.shares).time_s
        elif e.src == name:
            dst = assign[e.dst]
            t += edge_cost(e.meta, st.output, dst.inputs[e.index],
                           grad_partial_axes(dst) if e.index == 0 else frozenset(), ctx,
                           regather=dst.save_sharded_input and e.index == 0, **e.shares).time_s
    if name in tg.outputs:
        t += edge_cost(op.output_meta, st.output, sink_layout(ctx), frozenset(), ctx).time_s
    return t


def runner_ups(graph: OpGraph, assign: dict[str, OpStrategy], ctx: PlanContext, result: SearchResult,
               space: frozenset[str]) -> dict[str, tuple[str, float, float, float]]:
    """template op -> (runner-up name, its local time, chosen local time, runner-up memory bytes)."""
    tg, _ = template_for(graph, result.candidate.pipe)
    firsts = op_sites(graph)
    out = {}
    dp = ctx.mesh.degree("dp")
    for op in tg.ops:
        chosen = assign[op.name]
        cands = [s for s in strategies_in(graph, op, ctx.mesh, ctx.micro_batch)
                 if allowed(s, bool(op.params), space, dp) and s != chosen]
        if not cands:
            continue
        t_chosen = _local_time(graph, tg, op.name, chosen, assign, ctx, firsts)
        scored = [(_local_time(graph, tg, op.name, s, assign, ctx, firsts), i, s) for i, s in enumerate(cands)]
        scored = [x for x in scored if math.isfinite(x[0])]
        if not scored:
            continue
        t, _, s = min(scored, key=lambda x: (x[0], x[1]))
        mem = op_cost(op, s, ctx, **firsts[op.name]).state_bytes
        label = s.name + (f" zero{s.zero}" if s.zero else "") + (f" split{s.split}" if s.split > 1 else "")
        out[op.name] = (label, t, t_chosen, mem)
    return out


def plan_from_result(graph: OpGraph, cluster, result: SearchResult, *, global_batch: int,
                     space: frozenset[str]) -> Plan:
    cand = result.candidate
    ctx = candidate_context(graph, cluster, cand)
    ru = runner_ups(graph, result.assignment, ctx, result, space)
    tg, _ = template_for(graph, cand.pipe)
    ops = []
    for op in graph.ops:
        st = result.assignment.get(op.name)
        if st is None:
            continue
        t = tg.to_template[op.name]
        c = result.evaluation.op_costs[op.name]
        r = ru.get(t)
        ops.append(OpPlan(op=op.name, module=op.module_path, kind=op.kind.value, layer=op.layer, strategy=st,
                          inputs=op.inputs,
                          time_s=r[2] if r else c.time_s, memory_bytes=c.state_bytes,
                          runner_up=r[0] if r else None, runner_up_time_s=r[1] if r else None,
                          runner_up_memory_bytes=r[3] if r else None))
    mesh = cand.mesh
    if cand.cp > 1:  # the plan as it runs: dp and cp apart, whole sequences (planner/estimate.py)
        dp = mesh.degree("dp") // cand.cp
        mesh = MeshSpec.of(**{a: d for a, d in mesh.axes if a != "dp"}, **({"dp": dp} if dp > 1 else {}), cp=cand.cp)
    return Plan(**graph_fields(graph), cluster=str(cluster), mesh=mesh,
                global_batch=global_batch // cand.cp, micro_batch=cand.micro_batch,
                seq=graph.seq_len * cand.cp if graph.seq_len else graph.seq_len,
                recompute=cand.recompute, pipeline=cand.pipe, ops=tuple(ops), prediction=result.evaluation.prediction,
                space=tuple(sorted(space)), solve_time_s=result.solve_time_s, attention=attention_kernel(graph),
                solver=solver_name(), optimal=result.optimal, ep=cand.ep, compile=cand.compile,
                float8=cand.float8)


def make_plan(graph: OpGraph, cluster, *, global_batch: int, space: frozenset[str], cap_bytes: float | None = None,
              time_limit_s: float = 20.0, budget_s: float = 120.0, progress=None, cp: int = 1,
              ep: int | None = None, lowering: Lowering = DEFAULT_LOWERING) -> tuple[Plan, SearchResult]:
    """The best plan and its search. With `cp` > 1, `graph` is the rank-local graph (seq / cp tokens) and
    `global_batch` counts its sequences (cp per whole sequence); the plan returned is in whole sequences, under
    the local graph's name and fingerprint (api.py names it for the whole model). `ep`: search that
    expert-parallel degree only (search.enumerate_candidates)."""
    result = search(graph, cluster, global_batch=global_batch, space=space, cap_bytes=cap_bytes,
                    time_limit_s=time_limit_s, budget_s=budget_s, progress=progress, cp=cp, ep=ep,
                    lowering=lowering)
    return plan_from_result(graph, cluster, result, global_batch=global_batch, space=space), result
