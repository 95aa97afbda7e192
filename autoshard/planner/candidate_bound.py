"""A lower bound on one candidate's ILP objective from its priced strategies, without writing the ILP.

The search (`search.py`) prices a candidate's strategies (`op_cost`) before deciding whether to write and
solve its ILP; this bound, a multiple-choice knapsack per pipeline stage in its LP relaxation, skips most
candidates that cannot beat the best plan found so far (GPT-3 175B on 1,024 A100s: 101 LP relaxations -> 24).
`tests/test_search_bounds.py` checks it never exceeds the ILP optimum.
"""

from __future__ import annotations

import math

from autoshard.cost_models.memory import framework_overhead_bytes
from autoshard.planner.bounds import knapsack_lp_min
from autoshard.planner.context import PlanContext
from autoshard.planner.evaluate import inflight_microbatches, pipeline_fill, stage_units
from autoshard.planner.ilp import consumer_key, edge_time_s, optimizer_s_per_state_byte
from autoshard.planner.template import template_for

__all__ = ["knapsack_bound_s", "edge_times"]


def knapsack_bound_s(graph, cand, prep, cap: float, cache: dict,
                     stop_at: float = math.inf) -> float:
    """A lower bound on the ILP objective of `cand` (a search `Candidate` whose strategies and op costs are
    `prep`, the search's `_Prepared`), per pipeline stage k, without writing the ILP
    (returns as soon as it reaches `stop_at`). Its constraints give
        T >= C_k + P_k + D_k/units_k  and  T >= P_k + D_k          (E_k >= D_k/units_k, E_k >= D_k - C_k)
        S >= G_k/units_k              and  S >= G_k - B_k          (gradient sync outside backward)
        O >= opt_k,
    so for each of the four pairings the objective (m + fill)·T + S + O is at least a sum over ops of a cost
    per chosen strategy. An edge u -> v costs at least nothing, at least the cheapest way for v's strategy to
    receive it, and at least half that plus half the cheapest way for u's strategy to send it (all three are
    tried, the cheap one first). The stage's memory row caps the sum of the ops' bytes. Picking one strategy
    per op under that cap is a multiple-choice knapsack whose LP relaxation (`knapsack_lp_min`) bounds every
    plan of the candidate from below."""
    tg, stage = template_for(graph, cand.pipe)
    m, pipe = cand.num_microbatches, cand.pipe
    weight = m + pipeline_fill(pipe)
    units = stage_units(graph, pipe, stage)
    groups = sum(1 for a in cand.mesh.names if cand.mesh.degree(a) > 1)
    capacity = cap - framework_overhead_bytes(groups)
    best, minima = 0.0, None
    for edges in ("none", "receive", "split"):
        if edges != "none" and minima is None:
            minima = _edge_minima(tg, cand, prep, cache)
        for k in range(pipe.degree):
            parts = _stage_parts(tg, k, cand, prep, units[k], _edge_charges(tg, k, prep, minima, edges))
            for t_form, s_form in ((0, 0), (0, 1), (1, 0), (1, 1)):
                items = [[(weight * (P + D if t_form else C + P + D / units[k])
                           + (G - B if s_form else G / units[k]) + opt, nbytes)
                          for C, P, D, G, B, opt, nbytes in op_parts] for op_parts in parts]
                best = max(best, knapsack_lp_min(items, capacity))
                if best >= stop_at:
                    return best
    return best


def _edge_charges(tg, k: int, prep, minima, edges: str) -> dict[str, list[float]]:
    """Seconds of edge traffic charged to each strategy of each op of stage k (see `knapsack_bound_s`)."""
    charges = {op.name: [0.0] * len(prep.costs[op.name]) for op in tg.ops if tg.per_stage[op.name][k]}
    for e, receive, send in (minima if edges != "none" else ()):
        ne = e.per_stage[k]
        if not ne:
            continue
        half = edges == "split" and e.src in charges
        for i, t in enumerate(receive):
            charges[e.dst][i] += ne * t * (0.5 if half else 1.0)
        if half:
            for j, t in enumerate(send):
                charges[e.src][j] += ne * t * 0.5
    return charges


def _stage_parts(tg, k: int, cand, prep, units: int, charges) -> list[list[tuple]]:
    """Per op of stage k, per strategy: (C, P, D, G, B, opt seconds, bytes) of `knapsack_bound_s`. C is the
    ILP's compute row and P its tensor-parallel row with the edge charges; D is divided by m under layered
    accumulation (one gather per step)."""
    ctx, m, pipe = prep.ctx, cand.num_microbatches, cand.pipe
    inflight = inflight_microbatches(k, pipe, m)
    per_state_byte = optimizer_s_per_state_byte(ctx)
    parts = []
    for name, edge_s in charges.items():
        n = tg.per_stage[name][k]
        parts.append([(n * (c.fwd_s + c.bwd_s + c.recompute_s), n * (c.tp_fwd_s + c.tp_bwd_s) + edge_s[i],
                       n * (c.dp_fwd_s + c.dp_bwd_s) / (m if pipe.layered else 1), n * c.dp_iter_s,
                       n * (c.bwd_s + c.recompute_s), n * c.optim_bytes * per_state_byte,
                       n * (c.state_bytes + inflight * c.saved_bytes) + c.recompute_peak_bytes)
                      for i, c in enumerate(prep.costs[name])])
    return parts


def edge_times(ctx: PlanContext, cache: dict):
    """`edge_time_s` memoized across candidates: an edge's cost depends on the mesh, the micro-batch and
    whether full recompute replays it, not on the pipeline layout or the number of micro-batches."""
    full = ctx.recompute == "full"

    def edge_time(e, src, key) -> float:
        memo = (key, e.meta, e.in_block and full, ctx.mesh, ctx.micro_batch, e.fanout, src)
        hit = cache.get(memo)
        if hit is None:
            hit = cache[memo] = edge_time_s(e, src, key, ctx)
        return hit

    return edge_time


def _edge_minima(tg, cand, prep, cache: dict) -> list[tuple]:
    """Per template edge: (edge, [cheapest receive time for each consumer strategy], [cheapest send time for
    each producer strategy]); the same for every pipeline layout of this mesh, micro-batch and recompute."""
    edge_time = edge_times(prep.ctx, cache)
    out = []
    for e in tg.edges:
        memo = ("minima", e.src, e.dst, e.index, cand.mesh, cand.micro_batch, cand.recompute == "full")
        if memo not in cache:
            src_outs = [s.output for s in prep.strategies[e.src]]
            keys = [consumer_key(st, e.index) for st in prep.strategies[e.dst]]
            table = {(lay, k): edge_time(e, lay, k) for lay in dict.fromkeys(src_outs) for k in dict.fromkeys(keys)}
            receive = {k: min(table[lay, k] for lay in src_outs) for k in keys}
            send = {lay: min(table[lay, k] for k in keys) for lay in src_outs}
            cache[memo] = ([receive[k] for k in keys], [send[lay] for lay in src_outs])
        out.append((e, *cache[memo]))
    return out
