"""Baselines a user would otherwise pick, priced by the same cost model as the plan.

- `dp`: data parallel everywhere (parameters replicated).
- `zero3`: FSDP FULL_SHARD everywhere.
- `tp1d`: Megatron-LM tensor parallelism (with sequence parallelism) inside a node, the best degree.
- `tp2d`: 2D (Optimus) tensor parallelism on q x q, every Linear 2D.
- `tp3d`: 3D tensor parallelism on q x q x q, every Linear 3D.
- `grid`: the best Megatron DP x TP x PP grid: TP inside a node, PP across nodes (1F1B or interleaved), DP
  outermost with or without the distributed optimizer, any micro-batch and recompute mode.
Each is the best of its own configurations that fit in memory, or None when none does.
"""

from __future__ import annotations

import math

from autoshard.capture.ir import OpGraph
from autoshard.cost_models.bounds import block_costs, memory_lower_bound_bytes, time_lower_bound_s
from autoshard.cost_models.context import PlanContext, default_precision
from autoshard.cost_models.evaluate import evaluate, inflight_microbatches, pipeline_fill
from autoshard.cost_models.template import template_for
from autoshard.errors import ConfigurationError
from autoshard.planner.explain import batch_label
from autoshard.planner.ilp import build_problem, extract_assignment, solve
from autoshard.planner.manual import megatron_assignment
from autoshard.planner.stages import balanced_stage_layers
from autoshard.plans.contract import largest_head_divisor, pipeline_blocker, schedule_blocker
from autoshard.plans.layouts import MeshSpec
from autoshard.plans.plan import RECOMPUTE_MODES, Baseline, PipelineSpec, Prediction
from autoshard.plans.strategies import strategies_in

__all__ = ["Baseline", "BASELINES", "compute_baselines"]

BASELINES = ("dp", "zero3", "tp1d", "tp2d", "tp3d", "grid")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _micro_batches(local: int, shard: int = 1) -> list[int]:
    return [b for b in (1, 2, 4, 8, 16) if local % b == 0 and b % shard == 0]


class _Best:
    def __init__(self) -> None:
        self.pred: Prediction | None = None
        self.config = ""
        self.tried = 0  # configurations priced or pruned (0: none divides the batch / GPUs)
        self.smallest = float("inf")  # least memory any of them needed (a lower bound for pruned ones)
        self.heads_left_out = 0  # the head-slice gcd that left out every tensor-parallel degree (0: none left out)

    def offer(self, pred: Prediction, config: str, cap: float) -> None:
        self.tried += 1
        self.smallest = min(self.smallest, pred.memory.total_bytes)
        if pred.memory.total_bytes <= cap and (self.pred is None or pred.iteration_time_s < self.pred.iteration_time_s):
            self.pred, self.config = pred, config

    def pruned(self, memory_lower_bound_bytes: float) -> None:
        """A configuration whose memory lower bound is already over the cap."""
        self.tried += 1
        self.smallest = min(self.smallest, memory_lower_bound_bytes)

    def note(self, cap: float) -> str:
        if self.pred is not None:
            return ""
        if self.tried == 0 and self.heads_left_out:
            return (f"no tensor-parallel degree divides the model's attention heads (their gcd with the "
                    f"projections' head slices is {self.heads_left_out})")
        if self.tried == 0:
            return "no configuration of this family divides the GPUs and the global batch"
        return f"does not fit: needs at least {self.smallest / 2**30:.1f} GiB per GPU, cap {cap / 2**30:.1f} GiB"

    def bound(self) -> float:
        return self.pred.iteration_time_s if self.pred else math.inf


def _ctx(graph, cluster, mesh, b, m, rc) -> PlanContext:
    return PlanContext(mesh=mesh, cluster=cluster, micro_batch=b, num_microbatches=m,
                       precision=default_precision(cluster), recompute=rc, seq=graph.seq_len)


def _recomputes(graph: OpGraph) -> tuple[str, ...]:
    from autoshard.cost_models.opcost import score_shaped

    scores = any(score_shaped(t, graph.seq_len) for op in graph.ops for t in op.saved)
    return ("none", "selective", "full") if scores else ("none", "full")


def _uniform(graph, cluster, global_batch, cap, zero: int) -> _Best:
    """dp (zero 0) or zero3: every op the same data-parallel strategy on an all-dp mesh."""
    best = _Best()
    n = cluster.num_gpus
    if global_batch % n:
        return best
    mesh = MeshSpec.of(dp=n) if n > 1 else MeshSpec(axes=())
    tg, _ = template_for(graph, PipelineSpec())
    for b in _micro_batches(global_batch // n):
        assign = {}
        for op in tg.ops:
            cands = [s for s in strategies_in(graph, op, mesh, b, zero_options=(zero,)) if s.split == 1]
            assign[op.name] = next(s for s in cands if not any(a != "dp" for a, _ in s.output.items))
        for rc in _recomputes(graph):
            ctx = _ctx(graph, cluster, mesh, b, global_batch // (n * b), rc)
            ev = evaluate(graph, assign, ctx, PipelineSpec(), global_batch=global_batch, check_tied=False)
            best.offer(ev.prediction, f"dp={n}, micro-batch {batch_label(b, global_batch // (n * b))}, recompute {rc}",
                       cap)
    return best


def _megatron(graph, cluster, global_batch, cap, *, pipelines: bool) -> _Best:
    """Megatron TP (+SP) inside a node x PP x DP; tp1d when `pipelines` is False."""
    best = _Best()
    n, gpn = cluster.num_gpus, cluster.gpus_per_node
    prec = default_precision(cluster)
    pre, block, post = block_costs(graph)
    cuttable = pipeline_blocker(graph) is None  # stages are priced (and run) from one list of identical blocks
    heads = largest_head_divisor(graph)  # as the planner and estimate: a column split cuts whole heads
    degrees = [t for t in _divisors(gpn) if heads == 0 or heads % t == 0]
    if not pipelines and degrees == [1] and gpn > 1:
        best.heads_left_out = heads
    configs = []
    for tp in degrees:
        for pp in (_divisors(n // tp) if pipelines and cuttable else [1]):
            if (not pipelines and tp == 1) or pp > max(graph.num_layers, 1) or n % (tp * pp):
                continue
            dp = n // (tp * pp)
            if global_batch % dp:
                continue
            for b in _micro_batches(global_batch // dp):
                m = global_batch // (dp * b)
                for v in ((1, 2, 4) if pp > 1 else (1,)):
                    if pp > 1 and (graph.num_layers < pp * v or schedule_blocker(
                            "interleaved-1f1b" if v > 1 else "1f1b", pp, m) is not None):
                        continue  # as the planner: only what torch.distributed.pipelining runs
                    for rc in _recomputes(graph):
                        configs.append((tp, pp, dp, b, m, v, rc))
    scored = []
    for tp, pp, dp, b, m, v, rc in configs:
        pipe0 = PipelineSpec(degree=pp, schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v)
        lb = time_lower_bound_s(graph, cluster.gpu, prec, tp_degree=tp, pp=pp, micro_batch=b, num_microbatches=m,
                                fill=pipeline_fill(pipe0, m), recompute=rc)
        mem = memory_lower_bound_bytes(graph, prec, tp_degree=tp, pp=pp, dp=dp, max_zero=1, micro_batch=b,
                                       inflight=inflight_microbatches(0, pipe0, m), recompute=rc)
        if mem <= cap:
            scored.append((lb, tp, pp, dp, b, m, v, rc))
        else:
            best.pruned(mem)
    for lb, tp, pp, dp, b, m, v, rc in sorted(scored, key=lambda t: (*t[:7], RECOMPUTE_MODES.index(t[7]))):
        if lb >= best.bound():
            break
        layers = balanced_stage_layers(graph.num_layers, pp, v, pre, block, post) if pp > 1 else ()
        pipe = PipelineSpec(degree=pp, schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v,
                            stage_layers=layers)
        mesh = MeshSpec.of(**{a: d for a, d in (("pp", pp), ("dp", dp), ("tp", tp)) if d > 1})
        for zero in ((0, 1) if dp > 1 else (0,)):
            try:
                assign = megatron_assignment(graph, mesh, b, sequence_parallel=tp > 1, zero=zero)
            except ConfigurationError:
                break
            ev = evaluate(graph, assign, _ctx(graph, cluster, mesh, b, m, rc), pipe, global_batch=global_batch,
                          check_tied=False)
            sched = "" if pp == 1 else (f", interleaved x{v}" if v > 1 else ", 1f1b")
            best.offer(ev.prediction, f"tp={tp} pp={pp} dp={dp}{sched}, micro-batch {batch_label(b, m)}, recompute {rc}"
                                      f"{', distributed optimizer' if zero else ''}", cap)
    return best


def _tensor_family(graph, cluster, global_batch, cap, family: str) -> _Best:
    """Every Linear 2D (or 3D) on a q x q (x q) grid, the rest chosen by the ILP; data parallel around it."""
    best = _Best()
    n = cluster.num_gpus
    names = {"tp2d": ("2d",), "tp3d": ("3d-yz", "3d-zy")}[family]
    heads = largest_head_divisor(graph)  # each grid axis splitting q, k, v cuts whole heads, as in the search
    best.heads_left_out = heads if heads and heads % 2 else 0
    for q in (q for q in (2, 4, 8) if heads == 0 or heads % q == 0):
        axes = {"tp2d": {"tp_r": q, "tp_c": q}, "tp3d": {"tp_x": q, "tp_y": q, "tp_z": q}}[family]
        tdeg = math.prod(axes.values())
        if n % tdeg:
            continue
        dp = n // tdeg
        if global_batch % dp:
            continue
        mesh = MeshSpec.of(**({"dp": dp} if dp > 1 else {}), **axes)
        shard = q if family == "tp2d" else q * q
        for b in _micro_batches(global_batch // dp, shard):
            strategies = _family_strategies(graph, mesh, b, names)
            if strategies is None:
                continue
            for rc in _recomputes(graph):
                ctx = _ctx(graph, cluster, mesh, b, global_batch // (dp * b), rc)
                problem = build_problem(graph, ctx, PipelineSpec(), strategies, cap_bytes=cap)
                sol = solve(problem, time_limit_s=10.0)
                if sol.status == "infeasible":
                    continue
                ev = evaluate(graph, extract_assignment(problem, sol), ctx, PipelineSpec(), global_batch=global_batch)
                best.offer(ev.prediction, f"{mesh}, micro-batch {batch_label(b, ctx.num_microbatches)}, recompute {rc}", cap)
    return best


def _family_strategies(graph, mesh, b, names):
    tg, _ = template_for(graph, PipelineSpec())
    out = {}
    for op in tg.ops:
        cands = [s for s in strategies_in(graph, op, mesh, b, zero_options=(0,))
                 if s.split == 1]
        if op.kind.value in ("linear", "conv"):
            cands = [s for s in cands if s.name in names] or [s for s in cands if s.name == "replicate"]
        if not cands:
            return None
        out[op.name] = cands
    return out


def compute_baselines(graph: OpGraph, cluster, *, global_batch: int, cap_bytes: float,
                      names: tuple[str, ...] = BASELINES) -> dict[str, Baseline]:
    out = {}
    for name in names:
        if name == "dp":
            best = _uniform(graph, cluster, global_batch, cap_bytes, zero=0)
        elif name == "zero3":
            best = _uniform(graph, cluster, global_batch, cap_bytes, zero=3)
        elif name == "tp1d":
            best = _megatron(graph, cluster, global_batch, cap_bytes, pipelines=False)
        elif name == "grid":
            best = _megatron(graph, cluster, global_batch, cap_bytes, pipelines=True)
        else:
            best = _tensor_family(graph, cluster, global_batch, cap_bytes, name)
        out[name] = Baseline(name=name, prediction=best.pred, config=best.config, note=best.note(cap_bytes))
    return out
