"""Lower bounds on one candidate's ILP objective, without writing the ILP.

`compute_bound_s` needs only the candidate's strategies: kernel times, optionally with dual charges for the
edges between ops; it decides whether the strategies are worth pricing (`op_cost`). `knapsack_bounds` needs
their prices: a multiple-choice knapsack per pipeline stage in its LP relaxation, yielding a rising bound so
the search (`search.py`) can set it aside as soon as another candidate is lower. On GPT-3 175B over 1,024
A100s the edge charges leave 130 of 336 candidates to price, and the knapsack 11 LP relaxations to write.
`tests/test_search_bounds.py` checks every bound stays at or below the ILP optimum.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from autoshard.cost_models.bounds import knapsack_lp_min
from autoshard.cost_models.context import PlanContext
from autoshard.cost_models.evaluate import (
    edge_time_s,
    inflight_microbatches,
    op_sites,
    optimizer_s_per_state_byte,
    pipeline_fill,
    sink_layout,
    stage_units,
)
from autoshard.cost_models.memory import framework_overhead_bytes
from autoshard.cost_models.opcost import edge_cost, kernel_times_s, repeats_forward
from autoshard.cost_models.template import template_for
from autoshard.planner.ilp import binding_stages, consumer_key, fixed_stage_rows

__all__ = ["knapsack_bound_s", "knapsack_bounds", "compute_bound_s", "edge_times"]


class _Strategies(NamedTuple):
    """What the edge charges need of a candidate: its context and strategies (not their prices)."""
    ctx: PlanContext
    strategies: dict


def compute_bound_s(graph, cand, ctx: PlanContext, strategies: dict, cache: dict, *, edges: bool = True) -> float:
    """A lower bound on the ILP objective of `cand` from kernel times and edge charges, before its strategies
    are priced: (m + fill)·T with T >= F_k + B_k + P_k + fixed_k, where each op takes the strategy that
    minimizes its kernel times (`kernel_times_s`; the forward counted again when the recompute mode repeats
    it, `repeats_forward`) plus, with `edges`, the dual charges of its edges (`_edge_minima`, the "split"
    mode), and fixed_k is the stage's loss and p2p rows. Parameter traffic and memory count nothing, so it is
    looser than `knapsack_bound_s` but needs no `op_cost`: the search uses it to skip pricing candidates that
    cannot win (with edges: on GPT-3 175B, most 2D and 3D meshes, whose activations move between layouts at
    every op; without, cheaper still, most candidates of a small model)."""
    tg, stage = template_for(graph, cand.pipe)
    memo = cache.setdefault("op_parts", {})
    sites = op_sites(graph)
    kernels = {}
    for op in tg.ops:
        again = repeats_forward(op, cand.recompute, sites[op.name]["selective_keep"], graph.seq_len,
                                not_recomputed=sites[op.name]["not_recomputed"])
        key = ("kernels", op.name, cand.mesh.spmd_signature, ctx.on_dtensors, cand.micro_batch, again, cand.ep)
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = [f + b + (f if again else 0.0)
                                for f, b in (kernel_times_s(op, st, ctx, memo) for st in strategies[op.name])]
        kernels[op.name] = hit
    pipe = cand.pipe
    fixed, _ = fixed_stage_rows(graph, tg, stage, ctx, pipe)
    view, minima = _Strategies(ctx, strategies), None
    per_stage, names = 0.0, tuple(op.name for op in tg.ops)
    for k in range(pipe.degree):
        # a stage's ops and edges (the middle stages of a pipeline hold the same), on these tensor-parallel axes,
        # micro-batch and recompute mode, whatever the pipeline and data-parallel degrees
        key = ("stage kernels", names, tuple(tg.per_stage[name][k] for name in names),
               tuple(e.per_stage[k] for e in tg.edges) if edges else None, cand.mesh.spmd_signature,
               ctx.on_dtensors, cand.micro_batch, cand.recompute, cand.ep)
        t = cache.get(key)
        if t is None:
            if not edges:
                charges = {name: [0.0] * len(kernels[name]) for name in names if tg.per_stage[name][k]}
            else:
                if minima is None:
                    minima = _edge_minima(tg, cand, view, cache)
                charges = _edge_charges(tg, k, view, minima, "split", cache)
            t = cache[key] = sum(min(tg.per_stage[name][k] * kt + ch
                                     for kt, ch in zip(kernels[name], edge_s, strict=True))
                                 for name, edge_s in charges.items())
        per_stage = max(per_stage, t + fixed[k])
    return (cand.num_microbatches + pipeline_fill(pipe, cand.num_microbatches)) * per_stage


def knapsack_bound_s(graph, cand, prep, cap: float, cache: dict,
                     stop_at: float = math.inf) -> float:
    """`knapsack_bounds` to the end, or until it reaches `stop_at`."""
    best = 0.0
    for best in knapsack_bounds(graph, cand, prep, cap, cache):
        if best >= stop_at:
            break
    return best


def knapsack_bounds(graph, cand, prep, cap: float, cache: dict):
    """Yields a lower bound on the ILP objective of `cand` (a search `Candidate` whose strategies and op costs are
    `prep`, the search's `_Prepared`), rising with each knapsack solved (the last is the bound), without writing
    the ILP; per pipeline stage k, with r = 1 - 1/u_k and s = 1 - 1/slow, its constraints give
        T >= F_k + B_k + P_k + (Df_k + Db_k)/u_k + Ef_k + Eb_k + fixed_k,
        Ef_k >= Df_k·r - F_k  and  Ef_k >= Df_k·r·s   (Eb_k likewise with Db_k, B_k),
        S >= (G_k + Gf_k)/u_k + S_k + Sg_k,  S_k >= G_k·r - B_k  and  S_k >= G_k·r·s
        (Sg_k likewise with Gf_k, F_k),   O >= opt_k,
    so for each choice of one lower bound per E and S (`_FORMS`) the objective (m + fill)·T + S + O is at
    least a constant plus a sum over ops of a cost per chosen strategy. An edge u -> v costs at least a dual
    charge to v's strategy plus one to u's (`_edge_minima`; three charge splits are tried, the one that binds
    most often first). The stage's memory row caps the
    sum of the ops' bytes. Picking one strategy per op under that cap is a multiple-choice knapsack whose LP
    relaxation (`knapsack_lp_min`) bounds every plan of the candidate from below."""
    tg, stage = template_for(graph, cand.pipe)
    m, pipe, ctx = cand.num_microbatches, cand.pipe, prep.ctx
    weight = m + pipeline_fill(pipe, m)
    units = stage_units(graph, pipe, stage)
    groups = sum(1 for a in cand.mesh.names if cand.mesh.degree(a) > 1)
    frag = 1.0 + ctx.fragmentation
    fixed_s, loss_bytes = fixed_stage_rows(graph, tg, stage, ctx, pipe)
    slow = 1.0 - 1.0 / ctx.gpu.overlap_slowdown
    best, minima = 0.0, None
    for edges in ("split", "receive", "send"):
        if minima is None:
            minima = _edge_minima(tg, cand, prep, cache)
        for k in _stage_order(tg, pipe, m, fixed_s, loss_bytes, units):
            parts, transient = _stage_parts(tg, k, cand, prep, _edge_charges(tg, k, prep, minima, edges, cache))
            # R_k is at least the largest gathered buffer every strategy of some op needs
            capacity = cap - framework_overhead_bytes(groups) - frag * (loss_bytes[k] + 2 * transient)
            fixed = weight * fixed_s[k]
            u = units[k]
            r = 1.0 - 1.0 / u
            for hide_f, hide_b, hide_s in _FORMS:
                items = [[(weight * (F + B + P + (Df + Db) / u + (Df * r - F if hide_f else Df * r * slow)
                                     + (Db * r - B if hide_b else Db * r * slow))
                           + (G + Gf) / u + (G * r - B if hide_s else G * r * slow)
                           + (Gf * r - F if hide_s else Gf * r * slow) + opt, nbytes)
                          for F, B, P, Df, Db, G, Gf, opt, nbytes in op_parts] for op_parts in parts]
                best = max(best, fixed + knapsack_lp_min(items, capacity))
                yield best


# (Ef, Eb, S) each bounded by its hiding row (True) or its slowdown row (False), the one that binds most
# often first (compute hides the traffic in the plans that win). The mixed choices (Ef by one row, Eb by the
# other) are left out: on GPT-3 175B over 1,024 A100s they gave the largest bound for 3 of 641 candidates,
# and each form tried costs a knapsack per stage.
_FORMS = ((False, False, False), (False, False, True), (True, True, True), (True, True, False))


def _stage_order(tg, pipe, m: int, fixed_s, loss_bytes, units) -> list[int]:
    """The stages whose knapsack can set the bound, in the order to try them. Of stages that hold the same
    ops, edges, loss and fixed rows (the middle stages of a pipeline), only the one with the most micro-batches
    in flight (`binding_stages`): the same items under the least capacity. The first stage (most in flight,
    the embedding) and the last (the head and the loss) bound the objective most often: tried first, so a
    candidate that cannot win stops early."""
    keep = binding_stages(tg, pipe, m, fixed_s, loss_bytes, units)
    return [k for k in dict.fromkeys([0, pipe.degree - 1, *range(pipe.degree)]) if k in keep]


def _edge_charges(tg, k: int, prep, minima, edges: str, cache: dict) -> dict[str, list[float]]:
    """Seconds of edge traffic charged to each strategy of each op of stage k (see `knapsack_bound_s`)."""
    charges = {op.name: [0.0] * len(prep.strategies[op.name]) for op in tg.ops if tg.per_stage[op.name][k]}
    for name, times in _output_times(tg, prep, cache).items():  # the model's outputs gathered for the loss
        if name in charges:
            charges[name] = list(times)
    for e, modes in minima:
        ne = e.per_stage[k]
        if not ne:
            continue
        to_consumer, to_producer = modes[edges]
        for i, t in enumerate(to_consumer):
            charges[e.dst][i] += ne * t
        if e.src in charges:
            for j, t in enumerate(to_producer):
                charges[e.src][j] += ne * t
    return charges


def _stage_parts(tg, k: int, cand, prep, charges) -> tuple[list[list[tuple]], float]:
    """(per op of stage k, per strategy: (F, B, P, Df, Db, G, Gf, opt seconds, bytes) of `knapsack_bound_s`;
    the largest over the stage's ops of the smallest gathered buffer any of its strategies holds).
    B counts recompute, P the op's tensor-parallel traffic and its edge charges; Df and Db are divided by m
    under layered accumulation (one gather per step)."""
    ctx, m, pipe = prep.ctx, cand.num_microbatches, cand.pipe
    inflight = inflight_microbatches(k, pipe, m)
    per_state_byte = optimizer_s_per_state_byte(ctx)
    per = m if pipe.layered else 1
    frag = 1.0 + ctx.fragmentation
    parts, transient = [], 0.0
    for name, edge_s in charges.items():
        n = tg.per_stage[name][k]
        costs = prep.costs[name]
        parts.append([(n * c.fwd_s, n * (c.bwd_s + c.recompute_s), n * (c.tp_fwd_s + c.tp_bwd_s) + edge_s[i],
                       n * c.dp_fwd_s / per, n * c.dp_bwd_s / per, n * c.dp_iter_s, n * c.dp_iter_fwd_s,
                       n * c.optim_bytes * per_state_byte,
                       n * (c.state_bytes + frag * inflight * c.saved_bytes) + frag * c.recompute_peak_bytes)
                      for i, c in enumerate(costs)])
        transient = max(transient, min(c.transient_bytes for c in costs))
    return parts, transient


def edge_times(ctx: PlanContext, cache: dict):
    """`edge_time_s` memoized across candidates: an edge's cost depends on the tensor-parallel axes and
    whether there is a dp axis (`MeshSpec.spmd_signature`), the micro-batch and whether full recompute replays
    it, not on the pipeline layout, the pipeline or data-parallel degree or the number of micro-batches."""
    full = ctx.recompute == "full"
    spmd = ctx.mesh.spmd_signature

    def edge_time(e, src, key) -> float:
        memo = (key, e.meta, e.in_block and full, spmd, ctx.micro_batch, e.fanout, e.grad_fanout, src)
        hit = cache.get(memo)
        if hit is None:
            hit = cache[memo] = edge_time_s(e, src, key, ctx)
        return hit

    return edge_time


def _output_times(tg, prep, cache: dict) -> dict[str, tuple[float, ...]]:
    """Per template output op, per strategy: seconds to bring its output to the sink layout (the ILP's
    `_output_costs`); the same for every pipeline layout, pp and dp degree of these tensor-parallel axes."""
    ctx = prep.ctx
    memo = ("outputs", ctx.mesh.spmd_signature, ctx.micro_batch, tuple(tg.outputs))
    if memo not in cache:
        sink, ops = sink_layout(ctx), {op.name: op for op in tg.ops}
        cache[memo] = {name: tuple(edge_cost(ops[name].output_meta, s.output, sink, frozenset(), ctx).time_s
                                   for s in prep.strategies[name]) for name in tg.outputs}
    return cache[memo]


def _edge_minima(tg, cand, prep, cache: dict) -> list[tuple]:
    """Per template edge: (edge, {mode: ([seconds charged to each consumer strategy], [seconds charged to each
    producer strategy])}); the same for every pipeline layout, pp and dp degree of these tensor-parallel axes,
    micro-batch and recompute.

    The ILP moves an edge from producer layout a to consumer key b at c(a, b) (a transportation problem
    between the two ops' choices). Charges beta_b to the consumer and alpha_a to the producer with
    alpha_a + beta_b <= c(a, b), both >= 0, are a feasible dual of it, so their sum never exceeds the edge's
    cost in any plan, fractional or not. Each mode starts from one split of the cheapest ways to receive and
    to send (all to the consumer, all to the producer, half each) and raises alpha, then beta, by what c
    leaves over. A producer in another pipeline stage drops its alpha, which stays a lower bound."""
    edge_time = edge_times(prep.ctx, cache)
    out = []
    for e in tg.edges:
        memo = ("minima", e.src, e.dst, e.index, cand.mesh.spmd_signature, cand.micro_batch, cand.recompute == "full")
        if memo not in cache:
            src_outs = [s.output for s in prep.strategies[e.src]]
            keys = [consumer_key(st, e.index) for st in prep.strategies[e.dst]]
            outs_u, keys_u = list(dict.fromkeys(src_outs)), list(dict.fromkeys(keys))
            c = [[edge_time(e, lay, k) for k in keys_u] for lay in outs_u]
            receive = [min(c[a][b] for a in range(len(outs_u))) for b in range(len(keys_u))]
            send = [min(row) for row in c]
            modes = {}
            for mode, (alpha, beta) in (("split", ([t / 2 for t in send], [t / 2 for t in receive])),
                                        ("receive", ([0.0] * len(outs_u), receive)),
                                        ("send", (send, [0.0] * len(keys_u)))):
                alpha, beta = _tighten(c, alpha, beta)
                a_of = {lay: alpha[i] for i, lay in enumerate(outs_u)}
                b_of = {k: beta[i] for i, k in enumerate(keys_u)}
                modes[mode] = ([b_of[k] for k in keys], [a_of[lay] for lay in src_outs])
            cache[memo] = modes
        out.append((e, cache[memo]))
    return out


def _tighten(c: list[list[float]], alpha: list[float], beta: list[float]) -> tuple[list[float], list[float]]:
    """Raise dual charges alpha (rows of c) then beta (columns) by the least slack c - alpha - beta they
    leave, over the finite entries: still alpha_a + beta_b <= c(a, b), never lower."""
    def slack(a: int, b: int) -> float:
        return c[a][b] - alpha[a] - beta[b] if math.isfinite(c[a][b]) else math.inf

    alpha = [alpha[a] + max(0.0, min(slack(a, b) for b in range(len(beta)))) if math.isfinite(alpha[a]) else alpha[a]
             for a in range(len(alpha))]
    beta = [beta[b] + max(0.0, min(slack(a, b) for a in range(len(alpha)))) if math.isfinite(beta[b]) else beta[b]
            for b in range(len(beta))]
    return alpha, beta
