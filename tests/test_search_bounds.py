"""The search's pruning bounds are lower bounds: they never cut a candidate that could win."""

import itertools
import math
import random
import re

import pytest

from autoshard.api import load_graph
from autoshard.cost_models.bounds import knapsack_lp_min
from autoshard.cost_models.evaluate import op_sites
from autoshard.cost_models.opcost import op_cost, repeats_forward
from autoshard.hardware_profiles import ClusterSpec
from autoshard.planner import ilp
from autoshard.planner.candidate_bound import compute_bound_s, knapsack_bound_s
from autoshard.planner.ilp import build_problem, solve
from autoshard.planner.search import SPACE, _prepare, enumerate_candidates


def _best_integer_choice(items, capacity):
    best = math.inf
    for pick in itertools.product(*items):
        if sum(w for _, w in pick) <= capacity:
            best = min(best, sum(c for c, _ in pick))
    return best


def test_knapsack_relaxation_is_exact_on_a_hand_example():
    # start at cost 3 / weight 15; the cheapest saving is item 0's (2 per 8 bytes): 4 bytes of it cost 1
    items = [[(1.0, 10.0), (3.0, 2.0)], [(2.0, 5.0), (4.0, 1.0)]]
    assert knapsack_lp_min(items, 100.0) == pytest.approx(3.0)
    assert knapsack_lp_min(items, 11.0) == pytest.approx(4.0)
    assert knapsack_lp_min(items, 2.0) == math.inf  # the lightest options weigh 3


def test_knapsack_relaxation_never_exceeds_the_best_integer_choice():
    rng = random.Random(0)
    for _ in range(300):
        items = [[(rng.uniform(0, 10), rng.uniform(0, 10)) for _ in range(rng.randint(1, 4))]
                 for _ in range(rng.randint(1, 4))]
        capacity = rng.uniform(0, 25)
        exact = _best_integer_choice(items, capacity)
        relaxed = knapsack_lp_min(items, capacity)
        assert relaxed <= exact + 1e-9  # (both +inf when even the lightest options do not fit)


_LLAMA_FLASH = "llama:layers=4,hidden=1024,heads=16,kv_heads=4,ffn=2816,seq=2048,vocab=32000"


@pytest.mark.parametrize("model, attention, cluster, batch, cap_gib", [
    ("gpt2-medium", "eager", "2x8xA100-80GB", 64, 80),
    ("gpt2-medium", "eager", "1x8xA100-40GB", 16, 6),  # tight: the memory row binds
    (_LLAMA_FLASH, "flash", "2x8xH100-80GB", 32, 12),  # op-level selective recompute, ZeRO overlap rows
])
def test_candidate_bounds_never_exceed_the_ilp_optimum(model, attention, cluster, batch, cap_gib):
    graph = load_graph(model, attention=attention)
    spec = ClusterSpec.parse(cluster)
    cap = cap_gib * 2**30
    space = frozenset(SPACE)
    cands, _ = enumerate_candidates(graph, spec, global_batch=batch, space=space, cap_bytes=cap)
    cache: dict = {}
    checked = 0
    for cand in cands[:: max(1, len(cands) // 12)]:
        prep = _prepare(graph, spec, cand, space, cache)
        if prep is None:
            continue
        problem = build_problem(graph, prep.ctx, cand.pipe, prep.strategies, cap_bytes=cap, costs=prep.costs)
        sol = solve(problem, time_limit_s=20.0)
        bound = knapsack_bound_s(graph, cand, prep, cap, cache)
        cheap = compute_bound_s(graph, cand, prep.ctx, prep.strategies, cache)
        cheapest = compute_bound_s(graph, cand, prep.ctx, prep.strategies, cache, edges=False)
        if sol.status == "infeasible":
            continue
        assert sol.status == "optimal"
        where = (str(cand.mesh), cand.micro_batch, cand.recompute, cand.pipe)
        assert bound <= sol.objective * (1 + 1e-6), where
        assert cheapest <= cheap <= sol.objective * (1 + 1e-6), where
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("attention", ["eager", "flash"])
def test_the_recompute_predicate_names_exactly_the_ops_op_cost_recomputes(attention):
    # compute_bound_s counts a forward again where repeats_forward says so; op_cost is the truth
    graph = load_graph(_LLAMA_FLASH, attention=attention)
    spec = ClusterSpec.parse("1x8xH100-80GB")
    cands, _ = enumerate_candidates(graph, spec, global_batch=8, space=frozenset(SPACE), cap_bytes=math.inf)
    sites = op_sites(graph)
    seen = set()
    for cand in cands:
        if (cand.recompute, cand.compile) in seen or cand.mesh.degree("pp") > 1:
            continue
        seen.add((cand.recompute, cand.compile))
        prep = _prepare(graph, spec, cand, frozenset(SPACE), {})
        for name, strategies in prep.strategies.items():
            op = graph.op(name)
            cost = op_cost(op, strategies[0], prep.ctx, **sites[name])
            if cand.compile and cost.fwd_s == 0:
                continue  # a fused member of a compiled region: its region's op carries the time, again or not
            assert repeats_forward(op, cand.recompute, sites[name]["selective_keep"], graph.seq_len,
                                   not_recomputed=sites[name]["not_recomputed"]) == (cost.recompute_s > 0), \
                (cand.recompute, name)
    assert {r for r, _ in seen} == {"none", "selective", "full"}


def _rows(problem) -> list[tuple]:
    """Each constraint as (sense, rhs, {variable: coefficient}), per-stage variables (Ef_3, Sg_3, R_3, Fh_3, ...) named
    without their stage, so that the same row written for two stages compares equal."""
    def name(v):
        return re.sub(r"^(Ef|Eb|Et|S|Sg|R|Fh|Bh)_\d+$", r"\1", v.name)
    return [(c.sense, round(-c.constant, 12), {name(v): round(a, 12) for v, a in c.items()})
            for c in problem.lp.constraints.values()]


def _implied(row, rows) -> bool:
    """`row` is one of `rows`, or (a <= row) a row of `rows` with the same terms, each at least as large."""
    sense, rhs, terms = row
    for s2, r2, t2 in rows:
        if s2 != sense or r2 != rhs or t2.keys() != terms.keys():
            continue
        if t2 == terms or (sense == -1 and all(t2[v] >= a for v, a in terms.items())):
            return True
    return False


def test_rows_written_once_for_stages_that_repeat_them_leave_the_ilp_unchanged(monkeypatch):
    # the middle stages of a pipeline repeat their time rows, and their memory rows are bounded by the one
    # with the most micro-batches in flight: every row of the problem with each stage's rows must be in
    # the problem as written, or implied by one of its rows
    graph = load_graph("gpt:layers=32,hidden=512,heads=8,seq=512,vocab=8192", attention="eager")
    spec = ClusterSpec.parse("1x8xA100-40GB")
    cap = 3.5 * 2**30  # enough candidates solve (the pipelines' receive buffers and held outputs take room)
    space = frozenset(SPACE)
    cands, _ = enumerate_candidates(graph, spec, global_batch=64, space=space, cap_bytes=cap)
    piped = [c for c in cands if c.mesh.degree("pp") >= 4]  # 32 layers over 4 or 8 stages: the middle ones repeat
    cache: dict = {}
    checked = 0
    for cand in piped[:: max(1, len(piped) // 8)]:
        prep = _prepare(graph, spec, cand, space, cache)
        if prep is None:
            continue
        small = build_problem(graph, prep.ctx, cand.pipe, prep.strategies, cap_bytes=cap, costs=prep.costs)
        with monkeypatch.context() as m:
            m.setattr(ilp, "stage_shape", lambda tg, k: k)  # every stage its own rows
            full = build_problem(graph, prep.ctx, cand.pipe, prep.strategies, cap_bytes=cap, costs=prep.costs)
        kept, every = _rows(small), _rows(full)
        assert len(kept) < len(every)
        missing = [r for r in every if not _implied(r, kept)]
        assert not missing, (str(cand.mesh), cand.pipe.schedule, missing[:1])
        a, b = solve(small), solve(full)
        assert a.status == b.status
        if a.status == "optimal":
            assert a.objective == pytest.approx(b.objective, rel=1e-4)  # within the MIP gap
            checked += 1
    assert checked >= 4
