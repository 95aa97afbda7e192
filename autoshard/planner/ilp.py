r"""The per-operator strategy ILP for one mesh, micro-batch, recompute mode and pipeline layout.

Sets: template ops O (repeated blocks folded, `template.py`), strategies S(o) (`strategies.py`), template
edges E (u -> v, input i), pipeline stages K. n_k(o), n_k(e): instances of o / e in stage k. m micro-batches
per replica; fill = p - 1 (1F1B, GPipe) or (p - 1)/v (interleaved, looped BFS).

Variables
    x[o,s] in {0,1}        op o runs strategy s                                    (`_strategy_vars`)
    y[e,a,b] >= 0          edge e carries producer layout a to consumer key b      (`_edge_vars`)
                           (b = consumer input layout and partial-gradient axes)
    T >= 0                 per-micro-batch time of the slowest stage
    E_k, S_k, R_k >= 0     exposed ZeRO traffic, exposed gradient sync, transient buffer of stage k

Objective (iteration time; `_objective`)
    min (m + fill)·T + max_k S_k + max_k opt_k

Constraints
    sum_s x[o,s] = 1                                                   one strategy per op      (`_strategy_vars`)
    sum_b y[e,a,b] = sum_{s: out(s)=a} x[u,s]
    sum_a y[e,a,b] = sum_{s: key_i(s)=b} x[v,s]                        edge consistency         (`_edge_vars`)
    T >= C_k + P_k + E_k + p2p_k                                       stage time               (`_stage_time`)
      C_k = sum_o n_k(o) sum_s (fwd + bwd + recompute)[o,s] x[o,s]
      P_k = sum_o n_k(o) sum_s tp[o,s] x[o,s] + sum_e n_k(e) sum_ab c[e,a,b] y[e,a,b]
    E_k >= D_k - C_k,  E_k >= D_k / units_k                            ZeRO overlap             (`_stage_time`)
      D_k = sum_o n_k(o) sum_s (dp_fwd + dp_bwd)[o,s] x[o,s]   (divided by m for layered accumulation)
    S_k >= G_k - B_k,  S_k >= G_k / units_k                            gradient-sync overlap    (`_stage_time`)
    R_k >= trans[o,s] x[o,s]  for o in stage k                         largest gathered buffer  (`_memory`)
    sum_o n_k(o) sum_s (state + inflight_k·saved)[o,s] x[o,s] + 2 R_k + other <= cap   per stage (`_memory`)
    placements of a shared parameter agree across the ops that use it                        (`_tied_params`)

The solver (HiGHS through highspy when installed, CBC otherwise) runs with a time limit and returns its best
incumbent. With `minimize_memory=True` the same constraints minimize max_k memory instead: the smallest memory
any plan in this configuration needs, reported when the cap is infeasible.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import pulp

from autoshard.capture.ir import OpGraph
from autoshard.cost_models.memory import framework_overhead_bytes, optimizer_step_bytes
from autoshard.planner.context import PlanContext
from autoshard.planner.evaluate import block_inputs, inflight_microbatches, sink_layout
from autoshard.planner.opcost import EdgeCost, OpCost, edge_cost, grad_partial_axes, op_cost
from autoshard.planner.physical import physical_key
from autoshard.planner.plan import OpStrategy, PipelineSpec
from autoshard.planner.strategies import rebind
from autoshard.planner.template import TemplateGraph, build_template, stage_of

__all__ = ["StratVar", "EdgeVar", "Problem", "Solution", "build_problem", "solve", "extract_assignment"]

log = logging.getLogger(__name__)


class StratVar(NamedTuple):
    op: str
    index: int


class EdgeVar(NamedTuple):
    edge: int
    src_layout: int
    dst_key: int


@dataclass
class Problem:
    graph: OpGraph
    lp: pulp.LpProblem
    template: TemplateGraph
    strategies: dict[str, list[OpStrategy]]
    costs: dict[str, list[OpCost]]
    x: dict[StratVar, pulp.LpVariable]
    memory_exprs: list  # per stage
    time_var: pulp.LpVariable


@dataclass(frozen=True)
class Solution:
    status: str  # "optimal", "time_limit" (best incumbent), "infeasible"
    objective: float
    choice: dict[str, int]  # template op -> strategy index
    solve_time_s: float


def _strategy_vars(lp, tg: TemplateGraph, strategies) -> dict[StratVar, pulp.LpVariable]:
    x = {}
    for op in tg.ops:
        vs = []
        for i, _ in enumerate(strategies[op.name]):
            key = StratVar(op.name, i)
            x[key] = vs_i = pulp.LpVariable(f"x_{len(x)}", cat="Binary")
            vs.append(vs_i)
        lp += pulp.lpSum(vs) == 1
    return x


def _consumer_key(st: OpStrategy, index: int) -> tuple:
    return (st.inputs[index], grad_partial_axes(st) if index == 0 else frozenset())


def _edge_vars(lp, tg, strategies, x, ctx, recompute_full: bool):
    """Edge variables and their per-stage cost expressions."""
    num_stages = len(next(iter(tg.per_stage.values())))
    stage_cost = [[] for _ in range(num_stages)]
    cache: dict[tuple, EdgeCost] = {}
    for ei, e in enumerate(tg.edges):
        src_st, dst_st = strategies[e.src], strategies[e.dst]
        outs = sorted({s.output for s in src_st}, key=str)
        keys = sorted({_consumer_key(s, e.index) for s in dst_st}, key=str)
        y = {(a, b): pulp.LpVariable(f"y_{ei}_{a}_{b}", lowBound=0) for a in range(len(outs))
             for b in range(len(keys))}
        for a, lay in enumerate(outs):
            lp += pulp.lpSum(y[a, b] for b in range(len(keys))) == pulp.lpSum(
                x[StratVar(e.src, i)] for i, s in enumerate(src_st) if s.output == lay)
        for b, key in enumerate(keys):
            lp += pulp.lpSum(y[a, b] for a in range(len(outs))) == pulp.lpSum(
                x[StratVar(e.dst, i)] for i, s in enumerate(dst_st) if _consumer_key(s, e.index) == key)
        for (a, b), var in y.items():
            ck = (id(e), a, b)
            c = cache.get(ck) or edge_cost(e.meta, outs[a], keys[b][0], keys[b][1], ctx)
            cache[ck] = c
            t = c.time_s + (c.fwd_s if recompute_full and e.in_block else 0.0)
            if t == float("inf"):
                lp += var == 0
                continue
            for k, n in enumerate(e.per_stage):
                if n and t:
                    stage_cost[k].append(n * t * var)
    return stage_cost


def _output_costs(tg, strategies, x, ctx, stage_of_t):
    terms = []
    for name in tg.outputs:
        for i, s in enumerate(strategies[name]):
            c = edge_cost(_op(tg, name).output_meta, s.output, sink_layout(ctx), frozenset(), ctx)
            terms.append((stage_of_t[name], c.time_s * x[StratVar(name, i)]))
    return terms


def _op(tg: TemplateGraph, name: str):
    return next(op for op in tg.ops if op.name == name)


def _stage_time(lp, tg, costs, x, ctx, pipe, edge_terms, out_terms, units, p2p):
    """T >= per-stage time; returns (T, [S_k], [opt_k])."""
    num_stages = pipe.degree
    T = pulp.LpVariable("T", lowBound=0)
    syncs, opts = [], []
    m = ctx.num_microbatches
    for k in range(num_stages):
        comp, tp, dpmb, dpit, bwd, params = [], [], [], [], [], []
        for op in tg.ops:
            n = tg.per_stage[op.name][k]
            if not n:
                continue
            for i, c in enumerate(costs[op.name]):
                v = x[StratVar(op.name, i)]
                comp.append(n * (c.fwd_s + c.bwd_s + c.recompute_s) * v)
                bwd.append(n * (c.bwd_s + c.recompute_s) * v)
                tp.append(n * (c.tp_fwd_s + c.tp_bwd_s) * v)
                dpmb.append(n * (c.dp_fwd_s + c.dp_bwd_s) / (m if pipe.layered else 1) * v)
                dpit.append(n * c.dp_iter_s * v)
                params.append(n * c.param_bytes * v)
        tp += edge_terms[k] + [t for s, t in out_terms if s == k]
        E = pulp.LpVariable(f"E_{k}", lowBound=0)
        S = pulp.LpVariable(f"S_{k}", lowBound=0)
        lp += pulp.lpSum(dpmb) - pulp.lpSum(comp) <= E
        lp += pulp.lpSum(dpmb) * (1.0 / units[k]) <= E
        lp += pulp.lpSum(dpit) - pulp.lpSum(bwd) <= S
        lp += pulp.lpSum(dpit) * (1.0 / units[k]) <= S
        lp += pulp.lpSum(comp) + pulp.lpSum(tp) + E + p2p[k] <= T
        syncs.append(S)
        # Optimizer step: memory-bound over the stage's local parameters (params bytes -> numel).
        per_param = optimizer_step_bytes(1.0, ctx.precision) / ctx.precision.param_bytes
        opts.append(pulp.lpSum(params) * (per_param / (ctx.gpu.hbm_gbps * 1e9 * ctx.gpu.hbm_efficiency)))
    return T, syncs, opts


def _memory(lp, tg, costs, strategies, x, ctx, pipe, cap_bytes, minimize):
    exprs = []
    groups = sum(1 for a in ctx.mesh.names if ctx.mesh.degree(a) > 1)
    other = framework_overhead_bytes(groups)
    for k in range(pipe.degree):
        inflight = inflight_microbatches(k, pipe, ctx.num_microbatches)
        R = pulp.LpVariable(f"R_{k}", lowBound=0)
        terms = []
        for op in tg.ops:
            n = tg.per_stage[op.name][k]
            if not n:
                continue
            for i, c in enumerate(costs[op.name]):
                v = x[StratVar(op.name, i)]
                terms.append(n * (c.state_bytes + inflight * c.saved_bytes) * v)
                if c.transient_bytes:
                    lp += c.transient_bytes * v <= R
        expr = pulp.lpSum(terms) + 2 * R + other
        exprs.append(expr)
        if not minimize:
            lp += expr <= cap_bytes
    return exprs


def _tied_params(lp, graph: OpGraph, tg, strategies, x) -> None:
    """A parameter shared by two ops (tied embedding and LM head) must be placed the same in both."""
    users: dict[str, list[str]] = {}
    for op in tg.ops:
        for p in op.params:
            users.setdefault(p.name, []).append(op.name)
    for pname, ops in users.items():
        if len(ops) < 2:
            continue
        first = ops[0]
        for other in ops[1:]:
            keys = {physical_key(_op(tg, first), s, pname) for s in strategies[first]} & \
                   {physical_key(_op(tg, other), s, pname) for s in strategies[other]}
            for key in keys:
                lp += pulp.lpSum(x[StratVar(first, i)] for i, s in enumerate(strategies[first])
                                 if physical_key(_op(tg, first), s, pname) == key) == pulp.lpSum(
                    x[StratVar(other, i)] for i, s in enumerate(strategies[other])
                    if physical_key(_op(tg, other), s, pname) == key)
            for i, s in enumerate(strategies[first]):
                if physical_key(_op(tg, first), s, pname) not in keys:
                    lp += x[StratVar(first, i)] == 0
            for i, s in enumerate(strategies[other]):
                if physical_key(_op(tg, other), s, pname) not in keys:
                    lp += x[StratVar(other, i)] == 0


def build_problem(graph: OpGraph, ctx: PlanContext, pipe: PipelineSpec, strategies: dict[str, list[OpStrategy]],
                  *, cap_bytes: float, minimize_memory: bool = False, p2p_bytes: float = 0.0) -> Problem:
    """Write the ILP for `graph` on `ctx` with candidate `strategies` per op (template ops only needed)."""
    chunk = stage_of(graph, pipe)
    stage = {n: c % pipe.degree for n, c in chunk.items()}
    tg = build_template(graph, stage, pipe.degree)
    lp = pulp.LpProblem("autoshard", pulp.LpMinimize)
    firsts = block_inputs(graph)
    costs = {op.name: [op_cost(op, s, ctx, block_input=firsts.get(op.name)) for s in strategies[op.name]]
             for op in tg.ops}
    x = _strategy_vars(lp, tg, strategies)
    edge_terms = _edge_vars(lp, tg, strategies, x, ctx, ctx.recompute == "full")
    out_terms = _output_costs(tg, strategies, x, ctx, {n: stage[n] for n in tg.outputs})
    units = [max(1, len({op.layer for op in graph.ops if op.layer is not None and stage[op.name] == k}))
             for k in range(pipe.degree)]
    p2p = [2 * pipe.virtual_stages * ctx.p2p_s(p2p_bytes) if pipe.degree > 1 else 0.0] * pipe.degree
    T, syncs, opts = _stage_time(lp, tg, costs, x, ctx, pipe, edge_terms, out_terms, units, p2p)
    mem = _memory(lp, tg, costs, strategies, x, ctx, pipe, cap_bytes, minimize_memory)
    _tied_params(lp, graph, tg, strategies, x)
    if minimize_memory:
        M = pulp.LpVariable("M", lowBound=0)
        for e in mem:
            lp += e <= M
        lp += M
    else:
        fill = _fill(pipe)
        S = pulp.LpVariable("S", lowBound=0)
        O = pulp.LpVariable("O", lowBound=0)
        for s in syncs:
            lp += s <= S
        for o in opts:
            lp += o <= O
        lp += (ctx.num_microbatches + fill) * T + S + O
    return Problem(graph=graph, lp=lp, template=tg, strategies=strategies, costs=costs, x=x, memory_exprs=mem, time_var=T)


def _fill(pipe: PipelineSpec) -> float:
    if pipe.degree == 1:
        return 0.0
    if pipe.virtual_stages > 1 or pipe.schedule in ("interleaved-1f1b", "looped-bfs"):
        return (pipe.degree - 1) / pipe.virtual_stages
    return float(pipe.degree - 1)


def _solver(time_limit_s: float):
    if pulp.HiGHS().available():
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s, threads=1)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s)


def solve(problem: Problem, *, time_limit_s: float = 20.0) -> Solution:
    import time

    t0 = time.perf_counter()
    problem.lp.solve(_solver(time_limit_s))
    elapsed = time.perf_counter() - t0
    # sol_status: 1 optimal, 2 feasible (stopped at the time limit), anything else no usable solution
    sol = problem.lp.sol_status
    if sol not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible) or not _has_values(problem):
        return Solution(status="infeasible", objective=float("inf"), choice={}, solve_time_s=elapsed)
    choice = {}
    for op in problem.template.ops:
        vals = [(problem.x[StratVar(op.name, i)].value() or 0.0) for i in range(len(problem.strategies[op.name]))]
        choice[op.name] = max(range(len(vals)), key=vals.__getitem__)
    state = "optimal" if sol == pulp.LpSolutionOptimal else "time_limit"
    if state == "time_limit":
        log.warning("ILP hit its %.0f s time limit; using the best plan found so far", time_limit_s)
    return Solution(status=state, objective=float(pulp.value(problem.lp.objective) or 0.0), choice=choice,
                    solve_time_s=elapsed)


def _has_values(problem: Problem) -> bool:
    return all(v.value() is not None for v in problem.x.values())


def extract_assignment(problem: Problem, solution: Solution) -> dict[str, OpStrategy]:
    """Strategy of every real op: each block instance takes its template op's choice."""
    out = {}
    for real, tmpl in problem.template.to_template.items():
        if tmpl in solution.choice:
            out[real] = rebind(problem.strategies[tmpl][solution.choice[tmpl]], problem.graph.op(real))
    return out


