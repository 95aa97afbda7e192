"""The search around the ILP: meshes, pipeline layouts, micro-batch and recompute.

Candidates are enumerated (tensor-parallel axes inside a node first, data parallel outermost, pipeline
degrees that divide the GPUs) with a lower bound on iteration time and memory (`bounds.py`). Each candidate's
bound is then tightened in steps, each tighter and costlier than the last (`candidate_bound.py`): kernel
times at each op's fastest strategy; kernel times plus dual charges for moving activations between layouts
(before pricing its strategies); a per-stage knapsack over the priced strategies (before writing its ILP);
the LP relaxation of its ILP; the ILP itself. The search is best first: it always works on the candidate with
the lowest bound so far, one step at a time, and stops when that bound cannot beat the best plan found.
A candidate is therefore only refined while it could still be the best, and the first ILP solved is the one
whose relaxation is lowest. On GPT-3 175B over 1,024 A100s: 2,955 candidates, 641 kernel-time bounds, 336
with edges, 130 priced, 11 LP relaxations, 2 ILPs solved.
Ties break on the candidate order (the bound, then the enumeration), which is deterministic: same inputs,
same plan. The objective is tokens/s at the given global batch, i.e. the shortest iteration.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from autoshard.capture.ir import OpGraph
from autoshard.cost_models.bounds import block_costs, memory_lower_bound_bytes, time_lower_bound_s
from autoshard.cost_models.context import PlanContext, default_precision
from autoshard.cost_models.evaluate import (
    Evaluation,
    evaluate,
    inflight_microbatches,
    op_sites,
    pipeline_fill,
    selective_keeps,
)
from autoshard.cost_models.float8 import FLOAT8_RECIPES, require_fp8_tensor_cores
from autoshard.cost_models.opcost import op_cost
from autoshard.cost_models.template import template_for
from autoshard.errors import InfeasiblePlanError
from autoshard.planner.candidate_bound import compute_bound_s, edge_times, knapsack_bounds
from autoshard.planner.ilp import build_problem, expand_assignment, relaxation_bound, solve
from autoshard.planner.stages import balanced_stage_layers
from autoshard.plans.contract import (
    expert_parallel_degrees,
    kv_head_fraction,
    largest_head_divisor,
    pipeline_blocker,
    schedule_blocker,
)
from autoshard.plans.layouts import MeshSpec
from autoshard.plans.plan import RECOMPUTE_MODES, SCHEDULES, OpStrategy, PipelineSpec
from autoshard.plans.strategies import strategies_in

__all__ = ["SPACE", "Candidate", "SearchResult", "enumerate_candidates", "search", "parse_space", "allowed",
           "candidate_context", "Lowering", "DEFAULT_LOWERING"]

log = logging.getLogger(__name__)
SPACE = ("dp", "zero", "tp1d", "tp2d", "tp3d", "pp", "cp", "ep")
_FAMILY_OF = {"col": "tp1d", "row": "tp1d", "col+sp": "tp1d", "vocab": "tp1d", "2d": "tp2d", "3d-yz": "tp3d",
              "3d-zy": "tp3d"}


def parse_space(text: str | None) -> frozenset[str]:
    if not text:
        return frozenset(SPACE)
    parts = frozenset(p.strip().lower() for p in text.split(",") if p.strip())
    bad = parts - set(SPACE)
    if bad:
        from autoshard.errors import ConfigurationError

        raise ConfigurationError(f"space={text!r}: unknown families {', '.join(sorted(bad))}; choose from "
                                 f"{', '.join(SPACE)} (dp,zero is OSDP's)", params=("space",))
    return parts


@dataclass(frozen=True, kw_only=True)
class Lowering:
    """How the runtime lowers the blocks, where it can (runtime/compile.py refuses the rest): `compile` each
    block with torch.compile (None: on GPU clusters, where the cost model prices the compiled kernels from GPU
    sources; CPU ranks compile in minutes what runs in seconds), on every mesh but tensor parallelism with
    context or expert parallelism (blocks on DTensors also keep one FSDP unit each: ilp.py `_whole_blocks`);
    `float8` the block Linears ("" none, "tensorwise", "rowwise"; GPUs with fp8 tensor cores only) where the
    ops run on plain tensors (no tensor-parallel axes, pipeline stages of one rank) and experts are not
    parallel."""

    compile: bool | None = None
    float8: str = ""

    def __post_init__(self) -> None:
        if self.float8 not in ("", *FLOAT8_RECIPES):
            raise ValueError(f"float8 must be one of {', '.join(FLOAT8_RECIPES)} or empty, got {self.float8!r}")

    def for_mesh(self, cluster, mesh: MeshSpec, *, cp: int, ep: int) -> tuple[bool, str]:
        """(compile, float8) for a candidate on `mesh` with context and expert parallel degrees `cp`, `ep`."""
        wanted = cluster.gpu.device == "cuda" if self.compile is None else self.compile
        compiled = wanted and not (mesh.tp_axes and (cp > 1 or ep > 1))
        return compiled, self.float8 if not mesh.on_dtensors and ep == 1 else ""


DEFAULT_LOWERING = Lowering()


@dataclass(frozen=True)
class Candidate:
    mesh: MeshSpec
    micro_batch: int
    num_microbatches: int
    recompute: str
    pipe: PipelineSpec
    time_lb_s: float
    memory_lb_bytes: float
    cp: int = 1  # context parallel: `mesh` has cp folded into dp and the graph is the rank-local one
    ep: int = 1  # expert parallel: each MoE layer's experts over ep consecutive ranks of dp
    compile: bool = False  # every block torch.compile'd (Lowering)
    float8: str = ""  # the block Linears in float8 (Lowering)


@dataclass
class SearchResult:
    assignment: dict[str, OpStrategy]
    candidate: Candidate
    evaluation: Evaluation
    solve_time_s: float
    considered: int = 0
    solved: int = 0
    pruned_memory: int = 0
    log: list[str] = field(default_factory=list)
    # False when an ILP stopped at its time limit or the search at its budget: the plan is the best found
    # (the incumbent), not proven the fastest in the space
    optimal: bool = True
    # with "cp" in the space (planner/outer.py best_plan): {"chosen_cp": cp of the plan (1: none), "without_cp_s": the best
    # plan without CP (None: none fits), "by_cp_s": {cp: best iteration time, None where nothing fits}}
    context_parallel: dict | None = None
    # with "ep" in the space and a mixture-of-experts model, likewise: {"chosen_ep", "without_ep_s", "by_ep_s"}
    expert_parallel: dict | None = None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_meshes(gpn: int, heads: int, space: frozenset[str]) -> list[dict[str, int]]:
    """Tensor-parallel axes: 1D degrees inside a node, 2D q x q and 3D q x q x q grids."""
    out: list[dict[str, int]] = [{}]

    def ok(q: int) -> bool:
        return heads == 0 or heads % q == 0

    if "tp1d" in space:
        out += [{"tp": t} for t in _divisors(gpn) if t > 1 and ok(t)]
    if "tp2d" in space:
        out += [{"tp_r": q, "tp_c": q} for q in (2, 4, 8) if q * q <= max(gpn, 4) * 4 and ok(q)]
    if "tp3d" in space:
        out += [{"tp_x": q, "tp_y": q, "tp_z": q} for q in (2, 4) if ok(q)]
    return out


def _pipelines(graph: OpGraph, pp: int, space: frozenset[str], m: int,
               schedules: frozenset[str]) -> list[PipelineSpec]:
    layers = graph.num_layers
    if pp == 1:
        out = [PipelineSpec()]
        if "zero" in space and m > 1 and "looped-bfs" in schedules:
            # layered gradient accumulation alone (Lamy-Poirier 2021 §3)
            out.append(PipelineSpec(schedule="looped-bfs", layered=True))
        return out
    pre, block, post = block_costs(graph)
    specs = []
    for schedule, vs in (("1f1b", (1,)), ("interleaved-1f1b", (2, 3, 4)), ("looped-bfs", (2, 4))):
        if schedule not in schedules:
            continue
        for v in vs:
            if layers < pp * v:
                continue
            if schedule_blocker(schedule, pp, m) is not None:
                continue
            stage_layers = balanced_stage_layers(layers, pp, v, pre, block, post)
            specs.append(PipelineSpec(degree=pp, schedule=schedule, virtual_stages=v, stage_layers=stage_layers,
                                      layered=schedule == "looped-bfs"))
    return specs


def enumerate_candidates(graph: OpGraph, cluster, *, global_batch: int, space: frozenset[str],
                         cap_bytes: float, schedules: frozenset[str] = frozenset(SCHEDULES), cp: int = 1,
                         ep: int | None = None, lowering: Lowering = DEFAULT_LOWERING) -> tuple[list[Candidate], int]:
    """(candidates that may fit, number pruned by the memory bound), sorted by time bound. With `cp` > 1 the
    graph is the rank-local one (seq / cp tokens), `global_batch` counts its sequences, and the meshes' dp
    is dp x cp (MeshSpec.folded_cp). With "ep" in the space, a model with mixture-of-experts layers also gets
    every expert-parallel degree the runtime runs on each dp (`contract.expert_parallel_degrees`); `ep`: that
    degree only (meshes whose dp it divides). `lowering`: compile and float8 where the runtime runs them."""
    n, gpn = cluster.num_gpus, cluster.gpus_per_node
    require_fp8_tensor_cores(cluster.gpu, lowering.float8)
    prec = default_precision(cluster)
    recomputes = ["none", "full"] + (["selective"] if _has_scores(graph) or selective_keeps(graph) else [])
    max_zero = 3 if "zero" in space else 0
    heads = largest_head_divisor(graph)
    cuttable = pipeline_blocker(graph) is None
    pps = [p for p in _divisors(n) if p == 1 or ("pp" in space and cuttable and p <= graph.num_layers)]
    found, pruned = [], 0
    for pp in pps:
        for tp in _tp_meshes(gpn, heads, space):
            tdeg = math.prod(tp.values())
            if n % (pp * tdeg):
                continue
            dp = n // (pp * tdeg)
            if dp > 1 and not ({"dp", "zero"} & space) or dp % cp:
                continue
            mesh = MeshSpec.of(**({"pp": pp} if pp > 1 else {}), **({"dp": dp} if dp > 1 else {}), **tp)
            batch_shard = tp.get("tp_r", 1) * tp.get("tp_x", 1) * tp.get("tp_z", 1)
            eps = (1, *expert_parallel_degrees(graph, dp)) if "ep" in space and cp == 1 else (1,)
            if ep is not None:
                eps = (ep,) if ep in eps else ()
            for b, e in itertools.product(_micro_batches(global_batch, dp, batch_shard), eps):
                m = global_batch // (dp * b)
                compiled, f8 = lowering.for_mesh(cluster, mesh, cp=cp, ep=e)
                speedup = cluster.gpu.fp8_gemm_speedup if f8 else 1.0
                for pipe in _pipelines(graph, pp, space, m, schedules):
                    for rc in recomputes:
                        inflight = inflight_microbatches(0, pipe, m)
                        # expert weights split over ep and ZeRO-sharded over dp / ep: at most ZeRO-3's memory
                        mem = memory_lower_bound_bytes(graph, prec, tp_degree=tdeg, pp=pp, dp=dp,
                                                       max_zero=3 if e > 1 else max_zero,
                                                       micro_batch=b, inflight=inflight, recompute=rc)
                        if mem > cap_bytes:
                            pruned += 1
                            continue
                        lb = time_lower_bound_s(graph, cluster.gpu, prec, tp_degree=tdeg, pp=pp, micro_batch=b,
                                                num_microbatches=m, fill=pipeline_fill(pipe, m), recompute=rc,
                                                gemm_speedup=speedup)
                        found.append(Candidate(mesh, b, m, rc, pipe, lb, mem, cp, e, compiled, f8))
    # ties go to the less recompute (a model without repeated blocks recomputes nothing under "full")
    found.sort(key=lambda c: (c.time_lb_s, c.mesh.size, str(c.mesh), c.micro_batch,
                              RECOMPUTE_MODES.index(c.recompute), c.pipe.schedule, c.pipe.virtual_stages, c.ep))
    return found, pruned


def _micro_batches(global_batch: int, dp: int, batch_shard: int) -> list[int]:
    if global_batch % dp:
        return []
    local = global_batch // dp
    # every divisor up to 8 (a hand configuration's usual micro-batches, 3 and 6 included), powers of two above
    # it, and the whole local batch
    return [b for b in _divisors(local) if b % batch_shard == 0 and (b <= 8 or (b & (b - 1)) == 0 or b == local)]


def _has_scores(graph: OpGraph) -> bool:
    from autoshard.cost_models.opcost import score_shaped

    return any(score_shaped(t, graph.seq_len) for op in graph.ops for t in op.saved)


def allowed(st: OpStrategy, has_params: bool, space: frozenset[str], dp: int) -> bool:
    """Is `st` inside the searched families?"""
    fam = _FAMILY_OF.get(st.name)
    if fam is not None and fam not in space:
        return False
    if has_params and dp > 1:
        if st.zero == 0 and "dp" not in space:
            return False
        if st.zero > 0 and "zero" not in space:
            return False
    return True


def _strategies(graph: OpGraph, cand: Candidate, space, cache) -> dict[str, list[OpStrategy]] | None:
    tg, _ = template_for(graph, PipelineSpec())
    out = {}
    dp = cand.mesh.degree("dp")
    for op in tg.ops:
        key = (op.name, cand.mesh.spmd_signature, cand.micro_batch)
        if key not in cache:
            cache[key] = [s for s in strategies_in(graph, op, cand.mesh, cand.micro_batch)
                          if allowed(s, bool(op.params), space, dp)]
        if not cache[key]:
            return None
        out[op.name] = cache[key]
    return out


_PROGRESS_EVERY_S = 2.0  # one progress line per this many seconds of search, not one per candidate


def search(graph: OpGraph, cluster, *, global_batch: int, space: frozenset[str] = frozenset(SPACE),
           schedules: frozenset[str] = frozenset(SCHEDULES),
           cap_bytes: float | None = None, time_limit_s: float = 20.0, budget_s: float = 120.0,
           progress: Callable[[str], None] | None = None, cp: int = 1, ep: int | None = None,
           lowering: Lowering = DEFAULT_LOWERING) -> SearchResult:
    """Best plan over the space; raises InfeasiblePlanError with the smallest memory any plan needs. `cp`:
    context parallel over cp ranks, `ep`: only that expert-parallel degree (`enumerate_candidates`)."""
    cap = cap_bytes if cap_bytes is not None else cluster.device_memory_bytes
    cands, pruned = enumerate_candidates(graph, cluster, global_batch=global_batch, space=space, cap_bytes=cap,
                                         schedules=schedules, cp=cp, ep=ep, lowering=lowering)
    t0 = time.perf_counter()
    if progress:
        progress(f"searching {len(cands)} configurations")
    best: SearchResult | None = None
    best_index = -1
    solved, num_time_limited, stopped_early, cache = 0, 0, False, {}
    last_progress_s = t0
    # best first: (lower bound, candidate index, how far the bound has been tightened); a candidate's bound is
    # tightened one step each time it is the lowest (`_tighten`) and solved when only its ILP is left
    heap = [(cand.time_lb_s, i, _LB) for i, cand in enumerate(cands)]  # sorted by bound: already a heap
    pending: dict[int, object] = {}  # candidate index -> what its last step computed (its prices, its ILP)
    while heap:
        lb, i, step = heapq.heappop(heap)
        incumbent = best.evaluation.prediction.iteration_time_s if best is not None else math.inf
        if lb >= incumbent:
            break
        if time.perf_counter() - t0 > budget_s and best is not None:
            log.warning("search stopped after %.0f s with %d candidates left; the plan is the best found so far",
                        budget_s, len({j for _, j, _ in heap}) + 1)
            stopped_early = True
            break
        cand = cands[i]
        if step != _ILP:
            # the knapsack's bound rises as it goes: stop where it passes the next candidate, resume when this one
            # is the lowest again
            target = min(incumbent, heap[0][0]) if heap else incumbent
            tighter, done = _tighten(graph, cluster, cand, step, space, cap, target, cache, pending, i)
            if tighter is not None and tighter < incumbent:
                heapq.heappush(heap, (max(lb, tighter), i, step + 1 if done else step))
            else:
                pending.pop(i, None)
            continue
        problem, prepared = pending.pop(i)
        result = _solve_problem(graph, cand, global_batch, cap, time_limit_s, prepared, problem)
        solved += result is not None
        num_time_limited += result is not None and not result.optimal
        if progress and time.perf_counter() - last_progress_s >= _PROGRESS_EVERY_S:
            last_progress_s = time.perf_counter()
            progress(f"searched {solved} configurations ({len(cands) - len(heap)}/{len(cands)} by bound)")
        if result is not None and (result.evaluation.prediction.iteration_time_s, i) < (incumbent, best_index):
            best, best_index = result, i
    if best is None:
        raise _infeasible(graph, cluster, cands, global_batch, space, cap, cache, pruned)
    if num_time_limited:  # one warning for the whole search, not one per ILP
        log.warning("%d of %d ILP solves stopped at the %g s time limit: the plan is the best found (the incumbent), "
                    "not proven optimal; raise the time limit for the optimum", num_time_limited, solved, time_limit_s)
    best.optimal = not (num_time_limited or stopped_early)
    best.assignment = expand_assignment(graph, best.assignment)
    best.evaluation = evaluate(graph, best.assignment, candidate_context(graph, cluster, best.candidate),
                               best.candidate.pipe,
                               global_batch=global_batch)
    best.considered, best.solved, best.pruned_memory = len(cands), solved, pruned
    best.solve_time_s = time.perf_counter() - t0
    return best


def candidate_context(graph, cluster, cand: Candidate, cache: dict | None = None) -> PlanContext:
    """The candidate's PlanContext; with the search's `cache`, contexts on one mesh share their memo of group
    placements and collective times (they depend on the mesh and cluster only)."""
    memo = {} if cache is None else cache.setdefault(("context memo", cand.mesh), {})
    return PlanContext(mesh=cand.mesh, cluster=cluster, micro_batch=cand.micro_batch,
                       num_microbatches=cand.num_microbatches, precision=default_precision(cluster),
                       recompute=cand.recompute, seq=graph.seq_len, _cache=memo, cp=cand.cp,
                       cp_kv_fraction=kv_head_fraction(graph), ep=cand.ep, compile=cand.compile,
                       float8=cand.float8)


@dataclass
class _Prepared:
    ctx: PlanContext
    strategies: dict[str, list[OpStrategy]]
    costs: dict[str, list]  # template op -> OpCost per strategy


def _prepare(graph, cluster, cand: Candidate, space, cache) -> _Prepared | None:
    """Candidate strategies and their op costs; costs do not depend on the pipeline, so candidates that
    differ only in schedule share them."""
    strategies = _strategies(graph, cand, space, cache)
    if strategies is None:
        return None
    key = ("costs", cand.mesh, cand.micro_batch, cand.num_microbatches, cand.recompute, cand.ep)
    ctx = candidate_context(graph, cluster, cand, cache)
    if key not in cache:
        sites = op_sites(graph)
        memo = cache.setdefault("op_parts", {})
        cache[key] = {name: [op_cost(graph.op(name), s, ctx, memo=memo, **sites[name]) for s in sts]
                      for name, sts in strategies.items()}
    return _Prepared(ctx=ctx, strategies=strategies, costs=cache[key])


# the steps of a candidate's bound (see the module docstring): `enumerate_candidates`' bound, kernel times,
# kernel times and edge charges, the knapsack over its priced strategies, the LP relaxation of its ILP, then
# the ILP itself
_LB, _KERNELS, _EDGES, _KNAPSACK, _ILP = 0, 1, 2, 3, 4


def _tighten(graph, cluster, cand: Candidate, step: int, space, cap: float, target: float, cache: dict,
             pending: dict, i: int) -> tuple[float | None, bool]:
    """(the candidate's next lower bound after `step`, None when it has no plan; whether that step is done).
    The knapsack step stops once its bound reaches `target` and resumes on the next call; what a later step
    reuses (the prices, the knapsack under way, the written ILP) is kept in pending[i]."""
    if step in (_LB, _KERNELS):
        strategies = _strategies(graph, cand, space, cache)
        if strategies is None:
            return None, True  # no strategy of some op
        return compute_bound_s(graph, cand, candidate_context(graph, cluster, cand, cache), strategies, cache,
                               edges=step == _KERNELS), True
    if step == _EDGES:
        if i not in pending:
            prepared = _prepare(graph, cluster, cand, space, cache)
            if prepared is None:
                return None, True
            pending[i] = (prepared, knapsack_bounds(graph, cand, prepared, cap, cache), 0.0)
        prepared, bounds, value = pending[i]
        for value in bounds:
            if value >= target:
                pending[i] = (prepared, bounds, value)
                return value, False
        pending[i] = prepared
        return value, True
    prepared = pending[i]
    problem = build_problem(graph, prepared.ctx, cand.pipe, prepared.strategies, cap_bytes=cap, costs=prepared.costs,
                            edge_time=edge_times(prepared.ctx, cache))
    pending[i] = (problem, prepared)
    return relaxation_bound(problem), True


def _solve_problem(graph, cand, global_batch, cap, time_limit_s, prep: _Prepared, problem) -> SearchResult | None:
    ctx, strategies = prep.ctx, prep.strategies
    sol = solve(problem, time_limit_s=time_limit_s)
    if sol.status == "infeasible":
        return None
    # price the template-level choice (every block instance shares it); expand to every op only for the winner
    assign = {name: strategies[name][i] for name, i in sol.choice.items()}
    ev = evaluate(graph, assign, ctx, cand.pipe, global_batch=global_batch, check_tied=False)
    if ev.prediction.memory.total_bytes > cap * 1.0001:
        return None  # the ILP's linear memory model and the evaluator disagree: trust the evaluator
    return SearchResult(assignment=assign, candidate=cand, evaluation=ev, solve_time_s=sol.solve_time_s,
                        optimal=sol.status == "optimal")


def _infeasible(graph, cluster, cands, global_batch, space, cap, cache, pruned):
    """The smallest memory any plan needs, over the configurations with the lowest memory bounds; or, when the
    space has no configuration at all for this cluster and batch, say that instead."""
    everything, _ = enumerate_candidates(graph, cluster, global_batch=global_batch, space=space, cap_bytes=math.inf)
    if not everything:
        from autoshard.errors import ConfigurationError

        return ConfigurationError(
            f"no configuration of space={','.join(sorted(space))} uses all {cluster.num_gpus} GPUs of {cluster} "
            f"with global batch {global_batch}; widen space (data parallelism: dp or zero) or use a global batch "
            f"divisible by the data-parallel degree", params=("space",))
    everything.sort(key=lambda c: c.memory_lb_bytes)
    best = math.inf
    for cand in everything[:8]:
        strategies = _strategies(graph, cand, space, cache)
        if strategies is None:
            continue
        problem = build_problem(graph, candidate_context(graph, cluster, cand), cand.pipe, strategies,
                                cap_bytes=math.inf,
                                minimize_memory=True)
        sol = solve(problem, time_limit_s=10.0)
        if sol.status != "infeasible":
            best = min(best, sol.objective * 2**30)  # the ILP counts memory in GiB
    need = f"{best / 2**30:.1f} GiB" if math.isfinite(best) else "more than any configuration allows"
    return InfeasiblePlanError(
        f"no plan fits {cap / 2**30:.1f} GiB per GPU on {cluster}: the smallest plan needs {need}; raise "
        "memory_cap, add GPUs, lower global_batch or widen space", min_memory_gib=best / 2**30,
        params=("memory_cap", "global_batch", "space"))
