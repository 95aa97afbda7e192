r"""The per-operator strategy ILP for one mesh, micro-batch, recompute mode and pipeline layout.

Sets: template ops O (repeated blocks folded, `template.py`), strategies S(o) (`strategies.py`), template
edges E (u -> v, input i), pipeline stages K. n_k(o), n_k(e): instances of o / e in stage k. m micro-batches
per replica; fill = p - 1 (1F1B, GPipe) or (p - 1)/v (interleaved, looped BFS;
p - m + (m - 1)/v with m < p).

Variables
    x[o,s] in {0,1}        op o runs strategy s                                    (`_strategy_vars`)
    y[e,a,b] >= 0          edge e carries producer layout a to consumer key b      (`_edge_vars`)
                           (b = consumer input layout and partial-gradient axes)
    T >= 0                 per-micro-batch time of the slowest stage
    E_k, S_k, R_k >= 0     exposed ZeRO traffic, exposed once-per-step traffic, transient buffer of stage k

Objective (iteration time; `_objective`)
    min (m + fill)·T + max_k (S_k + Sg_k + (G_k + Gf_k)/u_k) + O

Constraints
    sum_s x[o,s] = 1                                                   one strategy per op      (`_strategy_vars`)
    sum_b y[e,a,b] = sum_{s: out(s)=a} x[u,s]
    sum_a y[e,a,b] = sum_{s: key_i(s)=b} x[v,s]                        edge consistency         (`_edge_vars`)
    T >= F_k + B_k + P_k + (Df_k + Db_k)/(u_k·l) + Ef_k + Eb_k + p2p_k + loss_k                (`_stage_time`)
      F_k, B_k = sum_o n_k(o) sum_s fwd[o,s] x[o,s], resp. (bwd + recompute)[o,s]; on a GPU each replaced by
      Fh_k >= F_k + loss_k, Fh_k >= HF_k (resp. Bh_k, HB_k), loss_k then leaving loss_k's row: the host issuing
      the phase's ops, the same for every strategy of an op (cost_models/host.py)            (`_host_floor`)
      P_k = sum_o n_k(o) sum_s tp[o,s] x[o,s] + sum_e n_k(e) sum_ab c[e,a,b] y[e,a,b]
      Df_k, Db_k = ZeRO traffic of a forward, resp. backward (gathers, reduce-scatters); l = m for layered
      accumulation (one gather per block and step), else 1; u_k = blocks of the stage (FSDP units)
    Ef_k >= Df_k·(1 - 1/u_k)/l - F_k,  Ef_k >= Df_k·(1 - 1/u_k)·(1 - 1/slow)/l, Eb_k likewise with Db_k, B_k
                                                                       ZeRO overlap, compute slowed by the
                                                                       GPU's overlap_slowdown (`_overlap_rows`)
    S_k >= G_k·(1 - 1/u_k) - B_k,  S_k >= G_k·(1 - 1/u_k)·(1 - 1/slow)  once-per-step overlap: G_k the
    Sg_k likewise with Gf_k, F_k                                       gradient all-reduce (ZeRO-0) or
                                                                       reduce-scatter (1) after the last
                                                                       backward, Gf_k ZeRO-1/2's gather in
                                                                       the first forward (evaluate.py also
                                                                       counts the link they share with
                                                                       Db_k, Df_k; the rows do not)
    (P_k on the critical path: the runtime overlaps no tensor-parallel collective, and the planner prices
    only what it runs; `estimate --tp-comm-overlap` prices other engines in evaluate.py)
    opt_k = sum_o n_k(o) sum_s optim_state_bytes[o,s]·r x[o,s]         optimizer step: r the seconds per
                                                                       state byte of torch's AdamW passes
                                                                       or a fused Adam (`optimizer_s_per_
                                                                       state_byte`); O >= opt_k + H_k on
                                                                       CPU ranks, O >= opt_k and O >= H_k on
                                                                       a GPU, H_k the step's per-tensor
                                                                       host work
    R_k >= trans[o,s] x[o,s]  for o in stage k                         largest gathered buffer  (`_memory`)
    sum_o sum_s (n_k(o)·(state + f·inflight_k·saved) + f·peak)[o,s] x[o,s] + 2f·R_k + f·L_k + other <= cap
                                                                       (`_memory`; L_k: the loss's buffers and
                                                                       inflight_k chunk outputs the schedule
                                                                       keeps, `fixed_stage_rows`)
      (f = 1 + allocator fragmentation, on what is allocated every step)
      (peak: a recomputed block's activations, live while that one block runs backward)
    placements of a shared parameter agree across the ops that use it                        (`_tied_params`)
    sum_{s: zero(s)=z, split(s)=1} x[o,s] = w[g,z],  sum_z w[g,z] = 1,  w binary
      for every op o holding parameters in block group g, when compiled blocks run on DTensors (tensor-
      parallel axes, pipeline stages of several ranks): one FSDP unit per block, the block itself
      (runtime/compile.py)                                                                   (`_whole_blocks`)
A row is written once for stages that would repeat it: the time rows of stages holding the same ops and
edges (the middle stages of a pipeline), the memory row only for the one of them with the most micro-batches
in flight (it bounds the others); the problem is the same, a fraction of the size.

The solver (HiGHS through highspy when installed, CBC otherwise) runs with a time limit and returns its best
incumbent. The search first solves the LP relaxation (`relaxation_bound`) and skips the integer solve when
that bound cannot beat the best plan found so far. With `minimize_memory=True` the same constraints minimize max_k memory instead: the smallest memory
any plan in this configuration needs, reported when the cap is infeasible.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import NamedTuple

import pulp

from autoshard.capture.ir import OpGraph
from autoshard.cost_models.context import PlanContext
from autoshard.cost_models.evaluate import (
    cached_chunk_outputs_bytes,
    cached_logits_bytes,
    chunk_sends_bytes,
    compiled_graphs_host_s,
    edge_time_s,
    held_loss_bytes,
    inflight_microbatches,
    loss_per_stage,
    op_sites,
    optimizer_s_per_state_byte,
    optimizer_step_host_s,
    pipeline_fill,
    recv_buffer_bytes,
    sink_layout,
    stage_units,
)
from autoshard.cost_models.host import separate_host
from autoshard.cost_models.memory import framework_overhead_bytes
from autoshard.cost_models.opcost import OpCost, edge_cost, grad_partial_axes, op_cost
from autoshard.cost_models.template import TemplateGraph, template_for
from autoshard.plans.breakdown import GIB
from autoshard.plans.physical import physical_key
from autoshard.plans.plan import OpStrategy, PipelineSpec
from autoshard.plans.strategies import rebind

__all__ = ["StratVar", "EdgeVar", "Problem", "Solution", "build_problem", "solve", "relaxation_bound",
           "extract_assignment", "expand_assignment",
           "fixed_stage_rows", "stage_shape", "binding_stages"]

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
    memory_exprs: list  # per stage whose row can bind (see `_memory`): (terms, constant GiB)
    time_var: pulp.LpVariable


@dataclass(frozen=True)
class Solution:
    status: str  # "optimal", "time_limit" (best incumbent), "infeasible"
    objective: float
    choice: dict[str, int]  # template op -> strategy index
    solve_time_s: float


def _var(lp: pulp.LpProblem, name: str, **kw) -> pulp.LpVariable:
    """A variable of `lp` (PuLP >= 3.3 attaches it to the problem; older versions build it standalone)."""
    if hasattr(lp, "add_variable"):
        return lp.add_variable(name, **kw)
    return pulp.LpVariable(name, **kw)


def _aff(terms) -> pulp.LpAffineExpression:
    """An affine expression from (variable, coefficient) pairs, repeated variables summed (PuLP's own
    constructor keeps only the last coefficient of a repeated variable); much faster than `+` and `*`."""
    acc: dict = {}
    for v, c in terms:
        acc[v] = acc.get(v, 0.0) + c
    return pulp.LpAffineExpression(acc)


def _eq(lp, left, right) -> None:
    lp += pulp.LpConstraint(_aff(left + [(v, -c) for v, c in right]), pulp.LpConstraintEQ, rhs=0)


def _strategy_vars(lp, tg: TemplateGraph, strategies) -> dict[StratVar, pulp.LpVariable]:
    x = {}
    for op in tg.ops:
        vs = []
        for i, _ in enumerate(strategies[op.name]):
            x[StratVar(op.name, i)] = v = _var(lp, f"x_{len(x)}", cat="Binary")
            vs.append((v, 1.0))
        lp += pulp.LpConstraint(_aff(vs), pulp.LpConstraintEQ, rhs=1)
    return x


def consumer_key(st: OpStrategy, index: int) -> tuple:
    """What the edge into input `index` depends on: its layout, partial-gradient axes, and whether the
    consumer gathers it again in backward."""
    first = index == 0
    return (st.inputs[index], grad_partial_axes(st) if first else frozenset(), st.save_sharded_input and first)


def _groups(items: list, key) -> tuple[list, list[int]]:
    """(distinct keys in first-seen order, group index of each item)."""
    index: dict = {}
    of = [index.setdefault(key(it), len(index)) for it in items]
    return list(index), of


def _edge_vars(lp, tg, strategies, x, ctx, edge_time):
    """Edge variables; returns per-stage lists of (variable, seconds) terms."""
    num_stages = len(next(iter(tg.per_stage.values())))
    stage_terms: list[list] = [[] for _ in range(num_stages)]
    out_groups = {}
    for ei, e in enumerate(tg.edges):
        src_st, dst_st = strategies[e.src], strategies[e.dst]
        if e.src not in out_groups:
            out_groups[e.src] = _groups(src_st, lambda s: s.output)
        outs, out_of = out_groups[e.src]
        keys, key_of = _groups(dst_st, lambda s, i=e.index: consumer_key(s, i))
        y = {(a, b): _var(lp, f"y_{ei}_{a}_{b}", lowBound=0) for a in range(len(outs))
             for b in range(len(keys))}
        for a in range(len(outs)):
            _eq(lp, [(y[a, b], 1.0) for b in range(len(keys))],
                [(x[StratVar(e.src, i)], 1.0) for i, g in enumerate(out_of) if g == a])
        for b in range(len(keys)):
            _eq(lp, [(y[a, b], 1.0) for a in range(len(outs))],
                [(x[StratVar(e.dst, i)], 1.0) for i, g in enumerate(key_of) if g == b])
        for (a, b), var in y.items():
            t = edge_time(e, outs[a], keys[b])
            if t == float("inf"):
                var.upBound = 0
                continue
            for k, n in enumerate(e.per_stage):
                if n and t:
                    stage_terms[k].append((var, n * t))
    return stage_terms


def _output_costs(tg, strategies, x, ctx, stage_of_t):
    terms = []
    for name in tg.outputs:
        for i, s in enumerate(strategies[name]):
            c = edge_cost(_op(tg, name).output_meta, s.output, sink_layout(ctx), frozenset(), ctx)
            terms.append((stage_of_t[name], (x[StratVar(name, i)], c.time_s)))
    return terms


def _op(tg: TemplateGraph, name: str):
    return next(op for op in tg.ops if op.name == name)


def _overlap_rows(lp, name: str, comm, compute, *, units: int, slowdown: float, per: float = 1.0):
    """A variable E with E >= rest/per - compute and E >= rest·(1 - 1/slowdown)/per, rest = comm·(1 - 1/units):
    with comm/(units·per) added it is `cost_models.overlap.exposed_comm_s` (of compute·per, comm)/per."""
    E = _var(lp, name, lowBound=0)
    r = (1.0 - 1.0 / units) / per
    lp += pulp.LpConstraint(_aff([(E, 1.0)] + [(v, -c * r) for v, c in comm] + compute), pulp.LpConstraintGE, rhs=0)
    lp += pulp.LpConstraint(_aff([(E, 1.0)] + [(v, -c * r * (1.0 - 1.0 / slowdown)) for v, c in comm]),
                            pulp.LpConstraintGE, rhs=0)
    return E


def _stage_time(lp, tg, costs, x, ctx, pipe, edge_terms, out_terms, units, p2p, loss):
    """T >= per-stage time; returns (T, [S_k], [opt_k] as term lists)."""
    T = _var(lp, "T", lowBound=0)
    syncs, opts = [], []
    m = ctx.num_microbatches
    per = m if pipe.layered else 1  # layered accumulation: one gather / reduction per block and step
    slow = ctx.gpu.overlap_slowdown
    per_state_byte = optimizer_s_per_state_byte(ctx)
    written = set()
    for k in range(pipe.degree):
        shape = (stage_shape(tg, k), tuple(s == k for s, _ in out_terms), units[k], p2p[k])
        if shape in written:  # the same rows as a stage already written (the middle stages of a pipeline)
            continue
        written.add(shape)
        fwd, bwd, tp, dpf, dpb, dpit, dpg, opt = [], [], [], [], [], [], [], []
        for op in tg.ops:
            n = tg.per_stage[op.name][k]
            if not n:
                continue
            for i, c in enumerate(costs[op.name]):
                v = x[StratVar(op.name, i)]
                fwd.append((v, n * c.fwd_s))
                bwd.append((v, n * (c.bwd_s + c.recompute_s)))
                tp.append((v, n * (c.tp_fwd_s + c.tp_bwd_s)))
                dpf.append((v, n * c.dp_fwd_s))
                dpb.append((v, n * c.dp_bwd_s))
                dpit.append((v, n * c.dp_iter_s))
                dpg.append((v, n * c.dp_iter_fwd_s))
                opt.append((v, n * c.optim_bytes * per_state_byte))
        tp += edge_terms[k] + [t for s, t in out_terms if s == k]
        fwd, bwd, in_floor = _host_floor(lp, tg, costs, ctx, k, fwd, bwd, loss[k])
        u = units[k]
        Ef = _overlap_rows(lp, f"Ef_{k}", dpf, fwd, units=u, slowdown=slow, per=per)
        Eb = _overlap_rows(lp, f"Eb_{k}", dpb, bwd, units=u, slowdown=slow, per=per)
        first = [(v, c / (u * per)) for v, c in dpf + dpb]
        # tensor-parallel collectives on the critical path: the runtime overlaps none, and the planner never sets
        # ctx.tp_overlap (estimate prices other engines' overlap in evaluate.py)
        lp += pulp.LpConstraint(_aff([(T, 1.0), (Ef, -1.0), (Eb, -1.0)] + [(v, -c) for v, c in fwd + bwd + first]
                                     + [(v, -c) for v, c in tp]), pulp.LpConstraintGE, rhs=p2p[k] - in_floor)
        S = _overlap_rows(lp, f"S_{k}", dpit, bwd, units=u, slowdown=slow)
        dpg = [(v, c) for v, c in dpg if c]
        Sg = [_overlap_rows(lp, f"Sg_{k}", dpg, fwd, units=u, slowdown=slow)] if dpg else []
        syncs.append(([S, *Sg], [(v, c / u) for v, c in dpit + dpg]))
        opts.append((opt, optimizer_step_host_s(sum(n * tensors for n, tensors in _stage_tensors(tg, k)), ctx)))
    return T, syncs, opts


def _stage_tensors(tg: TemplateGraph, k: int):
    """(instances on stage k, parameter tensors the optimizer steps through) per template op."""
    return [(tg.per_stage[op.name][k], sum(1 for p in op.params if p.owner)) for op in tg.ops]


def _host_floor(lp, tg, costs, ctx, k: int, fwd, bwd, loss_s: float):
    """On a GPU a phase takes at least its host time (cost_models/host.py; the same for every strategy of an op):
    (F, B, seconds of the stage's fixed row now inside them) with F, B as variables Fh >= F + loss, Fh >= host
    forward and Bh likewise (the loss's kernels are part of the phase the host issues, as evaluate.py counts
    them), or the term lists unchanged and 0 where the host costs nothing (CPU ranks)."""
    graphs = compiled_graphs_host_s(tg, ctx, k)
    host_f = graphs + sum(tg.per_stage[op.name][k] * costs[op.name][0].host_fwd_s for op in tg.ops)
    host_b = graphs + sum(tg.per_stage[op.name][k] * costs[op.name][0].host_bwd_s for op in tg.ops)
    if not host_f and not host_b:
        return fwd, bwd, 0.0
    out = []
    for name, terms, host in ((f"Fh_{k}", fwd, host_f), (f"Bh_{k}", bwd, host_b)):
        V = _var(lp, name, lowBound=host)
        lp += pulp.LpConstraint(_aff([(V, 1.0)] + [(v, -c) for v, c in terms]), pulp.LpConstraintGE, rhs=loss_s)
        out.append([(V, 1.0)])
    return out[0], out[1], 2 * loss_s


def _memory(lp, tg, costs, strategies, x, ctx, pipe, cap_bytes, minimize, loss_bytes):
    """Per-stage memory in GiB as (terms, constant); adds the cap constraints unless minimizing. Rows are in
    GiB, not bytes: coefficients of 1e10 next to times of 1e-3 s make the solver's tolerances misjudge them."""
    exprs = []
    groups = sum(1 for a in ctx.mesh.names if ctx.mesh.degree(a) > 1)
    other = framework_overhead_bytes(groups) / GIB
    frag = 1.0 + ctx.fragmentation  # on what is allocated per step (evaluate._memory)
    for k in sorted(binding_stages(tg, pipe, ctx.num_microbatches, loss_bytes)):
        inflight = inflight_microbatches(k, pipe, ctx.num_microbatches)
        R = _var(lp, f"R_{k}", lowBound=0)
        terms = [(R, 2.0 * frag)]
        const = other + frag * loss_bytes[k] / GIB
        for op in tg.ops:
            n = tg.per_stage[op.name][k]
            if not n:
                continue
            for i, c in enumerate(costs[op.name]):
                v = x[StratVar(op.name, i)]
                terms.append((v, (n * (c.state_bytes + frag * inflight * c.saved_bytes)
                                  + frag * c.recompute_peak_bytes) / GIB))
                if c.transient_bytes:
                    lp += pulp.LpConstraint(_aff([(R, 1.0), (v, -c.transient_bytes / GIB)]), pulp.LpConstraintGE,
                                            rhs=0)
        exprs.append((terms, const))
        if not minimize and math.isfinite(cap_bytes):
            lp += pulp.LpConstraint(_aff(terms), pulp.LpConstraintLE, rhs=cap_bytes / GIB - const)
    return exprs


def stage_shape(tg: TemplateGraph, k: int) -> tuple:
    """What stage k holds: instances of each template op and edge (the middle stages of a pipeline agree)."""
    return tuple(tg.per_stage[op.name][k] for op in tg.ops), tuple(e.per_stage[k] for e in tg.edges)


def binding_stages(tg: TemplateGraph, pipe: PipelineSpec, m: int, *per_stage) -> set[int]:
    """Stages whose memory row can bind: of stages that hold the same ops and edges (`stage_shape`) and the
    same value in each list of `per_stage`, the one with the most micro-batches in flight (the rest of its row
    is the same, and saved bytes are never negative, so it bounds the others)."""
    inflight = [inflight_microbatches(k, pipe, m) for k in range(pipe.degree)]
    binding: dict = {}
    for k in range(pipe.degree):
        shape = (stage_shape(tg, k), *(values[k] for values in per_stage))
        if shape not in binding or inflight[k] > inflight[binding[shape]]:
            binding[shape] = k
    return set(binding.values())


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


def _whole_blocks(lp, graph: OpGraph, tg: TemplateGraph, strategies, x) -> None:
    """Compiled blocks on DTensors need the block as one FSDP unit (runtime/compile.py
    `check_compile_plan`): every op of a block that holds parameters at one zero level, none split."""
    in_template = {op.name for op in tg.ops}
    for g, group in enumerate(graph.blocks):
        holders = [n for n in group.op_names[0] if n in in_template and _op(tg, n).params]
        if not holders:
            continue  # no parameters, no FSDP unit
        levels = sorted({s.zero for n in holders for s in strategies[n] if s.split == 1})
        w = {z: _var(lp, f"w_{g}_{z}", cat="Binary") for z in levels}
        lp += pulp.LpConstraint(_aff([(v, 1.0) for v in w.values()]), pulp.LpConstraintEQ, rhs=1)
        for n in holders:
            for z, v in w.items():
                _eq(lp, [(x[StratVar(n, i)], 1.0) for i, s in enumerate(strategies[n])
                         if s.zero == z and s.split == 1], [(v, 1.0)])
            for i, s in enumerate(strategies[n]):
                if s.split > 1:
                    lp += x[StratVar(n, i)] == 0


def fixed_stage_rows(graph: OpGraph, tg: TemplateGraph, stage: dict[str, int], ctx: PlanContext,
                     pipe: PipelineSpec, p2p_bytes: float = 0.0) -> tuple[list[float], list[float]]:
    """Per pipeline stage: (seconds its time row pays whatever the strategies: p2p sends and the loss both
    ways; bytes the loss holds, with the chunk outputs and logits the schedule keeps: `cached_chunk_outputs_bytes`
    per micro-batch in flight, `cached_logits_bytes`, the loss's saved tensors of the other micro-batches in
    flight, `held_loss_bytes`, and the receive buffers of every micro-batch, `recv_buffer_bytes`). The search's
    lower bounds (`candidate_bound.py`) use the same rows."""
    loss_time, loss_bytes = loss_per_stage(graph, tg.outputs, stage, ctx, pipe.degree)
    p2p = 2 * pipe.virtual_stages * ctx.p2p_s(p2p_bytes) if pipe.degree > 1 else 0.0
    cached = cached_chunk_outputs_bytes(graph, ctx, pipe)
    logits = cached_logits_bytes(graph, tg.outputs, stage, ctx, pipe)
    losses = held_loss_bytes(graph, tg.outputs, stage, ctx, pipe)
    recv = recv_buffer_bytes(chunk_sends_bytes(graph, ctx, pipe), ctx, pipe)
    held = [b + logits[k] + losses[k] + recv[k] + cached[k] * inflight_microbatches(k, pipe, ctx.num_microbatches)
            for k, b in enumerate(loss_bytes)]
    return [p2p + 2 * t for t in loss_time], held


def build_problem(graph: OpGraph, ctx: PlanContext, pipe: PipelineSpec, strategies: dict[str, list[OpStrategy]],
                  *, cap_bytes: float, minimize_memory: bool = False, p2p_bytes: float = 0.0,
                  costs: dict[str, list[OpCost]] | None = None, edge_time=None) -> Problem:
    """Write the ILP for `graph` on `ctx` with candidate `strategies` per op (template ops only needed).
    `costs`: precomputed `op_cost` of each candidate (they do not depend on the pipeline layout);
    `edge_time(edge, src_layout, consumer_key)`: a memoized `edge_time_s` shared across candidates."""
    tg, stage = template_for(graph, pipe)
    lp = pulp.LpProblem("autoshard", pulp.LpMinimize)
    if costs is None:
        sites = op_sites(graph)
        costs = {op.name: [op_cost(op, s, ctx, **sites[op.name]) for s in strategies[op.name]]
                 for op in tg.ops}
    x = _strategy_vars(lp, tg, strategies)
    if edge_time is None:
        def edge_time(e, src, key):
            return edge_time_s(e, src, key, ctx)
    edge_terms = _edge_vars(lp, tg, strategies, x, ctx, edge_time)
    out_terms = _output_costs(tg, strategies, x, ctx, {n: stage[n] for n in tg.outputs})
    units = stage_units(graph, pipe, stage)
    fixed, loss_bytes = fixed_stage_rows(graph, tg, stage, ctx, pipe, p2p_bytes)
    loss = loss_per_stage(graph, tg.outputs, stage, ctx, pipe.degree)[0]
    T, syncs, opts = _stage_time(lp, tg, costs, x, ctx, pipe, edge_terms, out_terms, units, fixed, loss)
    mem = _memory(lp, tg, costs, strategies, x, ctx, pipe, cap_bytes, minimize_memory, loss_bytes)
    _tied_params(lp, graph, tg, strategies, x)
    if ctx.compile and ctx.mesh.on_dtensors:
        _whole_blocks(lp, graph, tg, strategies, x)
    if minimize_memory:
        M = _var(lp, "M", lowBound=0)
        for terms, const in mem:
            lp += pulp.LpConstraint(_aff([(M, 1.0)] + [(v, -c) for v, c in terms]), pulp.LpConstraintGE, rhs=const)
        lp.setObjective(_aff([(M, 1.0)]))
    else:
        fill = pipeline_fill(pipe, ctx.num_microbatches)
        S = _var(lp, "S", lowBound=0)
        O = _var(lp, "O", lowBound=0)
        for s_k, first in syncs:
            lp += pulp.LpConstraint(_aff([(S, 1.0)] + [(e, -1.0) for e in s_k] + [(v, -c) for v, c in first]),
                                    pulp.LpConstraintGE, rhs=0)
        for o, host in opts:  # the step's kernels and its per-tensor host work: in turn on CPU ranks, the
            # longer of the two on a GPU (evaluate.optimizer_s)
            apart = separate_host(ctx.gpu)
            lp += pulp.LpConstraint(_aff([(O, 1.0)] + [(v, -c) for v, c in o]), pulp.LpConstraintGE,
                                    rhs=0.0 if apart else host)
            if apart:
                lp += pulp.LpConstraint(_aff([(O, 1.0)]), pulp.LpConstraintGE, rhs=host)
        lp.setObjective(_aff([(T, ctx.num_microbatches + fill), (S, 1.0), (O, 1.0)]))
    return Problem(graph=graph, lp=lp, template=tg, strategies=strategies, costs=costs, x=x, memory_exprs=mem, time_var=T)


@contextlib.contextmanager
def _solver_output_silenced():
    """HiGHS prints its banner from C++ on file descriptor 1 when the first model is built, whatever `msg`
    says: two lines of licence on every `plan`, and `--json` output must be only JSON. The solver's stdout
    goes to the null device while it runs (`msg=False` keeps everything else quiet)."""
    try:
        out = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # stdout replaced (pytest capture, StringIO): nothing to do
        yield
        return
    sys.stdout.flush()
    saved = os.dup(out)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, out)
        os.close(null)
        yield
    finally:
        os.dup2(saved, out)
        os.close(saved)


def solver_name() -> str:
    """The MILP solver plans are made with: HiGHS when highspy is installed (a dependency), else CBC. The two
    may pick different strategies that tie on predicted time; the plan file names the one used."""
    return "HiGHS" if pulp.HiGHS().available() else "CBC"


def _solver(time_limit_s: float):
    if pulp.HiGHS().available():
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s, threads=1)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s)


def relaxation_bound(problem: Problem) -> float:
    """Objective of the LP relaxation (strategy variables continuous): a lower bound on the ILP, usually
    within a few percent of it, at a fraction of the cost. +inf when even the relaxation is infeasible."""
    binaries = [v for v in problem.x.values()]
    for v in binaries:
        v.cat = pulp.LpContinuous
    try:
        with _solver_output_silenced():
            problem.lp.solve(pulp.HiGHS(msg=False, threads=1) if pulp.HiGHS().available() else
                             pulp.PULP_CBC_CMD(msg=False))
        ok = problem.lp.sol_status == pulp.LpSolutionOptimal
        return float(pulp.value(problem.lp.objective)) if ok else float("inf")
    finally:
        for v in binaries:
            v.cat = pulp.LpInteger


def solve(problem: Problem, *, time_limit_s: float = 20.0) -> Solution:
    import time

    t0 = time.perf_counter()
    with _solver_output_silenced():
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
    # a solve stopped at the time limit returns its incumbent; search() warns once for the whole search
    state = "optimal" if sol == pulp.LpSolutionOptimal else "time_limit"
    return Solution(status=state, objective=float(pulp.value(problem.lp.objective) or 0.0), choice=choice,
                    solve_time_s=elapsed)


def _has_values(problem: Problem) -> bool:
    return all(v.value() is not None for v in problem.x.values())


def extract_assignment(problem: Problem, solution: Solution) -> dict[str, OpStrategy]:
    """Strategy of every real op: each block instance takes its template op's choice."""
    chosen = {t: problem.strategies[t][i] for t, i in solution.choice.items()}
    return expand_assignment(problem.graph, chosen)


def expand_assignment(graph: OpGraph, template_assign: dict[str, OpStrategy]) -> dict[str, OpStrategy]:
    """Template-level strategies -> every op, each block instance with its own parameter names."""
    tg, _ = template_for(graph, PipelineSpec())
    return {real: (template_assign[t] if real == t else rebind(template_assign[t], graph.op(real)))
            for real, t in tg.to_template.items() if t in template_assign}


