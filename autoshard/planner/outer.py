"""The outer loops around the search: one search per context-parallel degree (on that degree's rank-local graph)
and per expert-parallel degree beside the best plan without them, and the fastest of all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace as dc_replace

from autoshard.capture.ir import OpGraph
from autoshard.errors import ConfigurationError, InfeasiblePlanError
from autoshard.planner.estimate import check_context_parallel
from autoshard.planner.planning import make_plan
from autoshard.planner.search import DEFAULT_LOWERING, Lowering, SearchResult
from autoshard.plans.contract import expert_parallel_degrees, num_experts
from autoshard.plans.plan import Plan, graph_fields

__all__ = ["best_plan", "context_parallel_degrees", "CP_MIN_SEQ", "CP_MIN_LOCAL_SEQ"]


# Context parallelism is searched from this many tokens per sequence up (a search-cost cut, not a claim that
# CP never pays below it: `estimate --cp` prices any length); each cp rank keeps at least CP_MIN_LOCAL_SEQ.
CP_MIN_SEQ = 32768
CP_MIN_LOCAL_SEQ = 4096


def context_parallel_degrees(graph: OpGraph, cluster, space: frozenset[str], *, local_graphs: bool) -> list[int]:
    """The cp degrees the planner tries: with "cp" in the space, a causal decoder with a fused attention kernel
    whose rank-local graph can be captured at seq / cp (`local_graphs`: the model was given by reference),
    without mixture-of-experts layers, sequences of at least CP_MIN_SEQ tokens, cp dividing the GPUs and
    cutting each sequence into 2 x cp equal chunks."""
    seq = graph.seq_len
    if "cp" not in space or not local_graphs or not seq or seq < CP_MIN_SEQ or num_experts(graph):
        return []  # (the runtime does not run CP with mixture-of-experts layers)
    out = []
    for cp in (2, 4, 8, 16, 32):
        if cluster.num_gpus % cp or seq % (2 * cp) or seq // cp < CP_MIN_LOCAL_SEQ:
            continue
        try:
            check_context_parallel(graph, cp)
        except ConfigurationError:
            continue
        out.append(cp)
    return out


def best_plan(graph: OpGraph, cluster, *, global_batch: int, space: frozenset[str], cap_bytes: float,
              time_limit_s: float, progress=None,
              local_graph: Callable[[int], OpGraph] | None = None,
              lowering: Lowering = DEFAULT_LOWERING) -> tuple[Plan, SearchResult]:
    """(plan, search) of the fastest plan over `space`: the search on the whole graph; with "cp" in the space
    one search per context-parallel degree on that degree's rank-local graph (`local_graph(seq)`: the model
    captured at seq tokens; data parallel, ZeRO and tensor parallelism around it, no pipeline: what the
    runtime runs with cp); for a mixture-of-experts model with "ep" in the space one search per
    expert-parallel degree. The SearchResult's `context_parallel` and `expert_parallel` say how CP and EP
    compared with the best plan without them."""
    best, first_error, without_cp = None, None, None
    # a search with no candidate (none fits, or none divides the GPUs and the batch: ConfigurationError) leaves
    # the others to try; the first one's error is raised only when none finds a plan
    try:
        best = make_plan(graph, cluster, global_batch=global_batch, space=space - {"cp", "ep"}, cap_bytes=cap_bytes,
                         time_limit_s=time_limit_s, progress=progress, lowering=lowering)
        without_cp = best[0].prediction.iteration_time_s
    except (InfeasiblePlanError, ConfigurationError) as exc:
        first_error = exc
    without_ep, by_ep = without_cp, {}
    for ep in expert_parallel_degrees(graph, cluster.num_gpus) if "ep" in space else ():
        if progress is not None:
            progress(f"expert parallel {ep}: searching")
        try:
            p, r = make_plan(graph, cluster, global_batch=global_batch, space=space - {"cp"}, cap_bytes=cap_bytes,
                             time_limit_s=time_limit_s, progress=progress, lowering=lowering, ep=ep)
        except (InfeasiblePlanError, ConfigurationError) as exc:
            first_error = first_error or exc
            by_ep[ep] = None
            continue
        by_ep[ep] = p.prediction.iteration_time_s
        if best is None or by_ep[ep] < best[0].prediction.iteration_time_s:
            best = (p, r)
    tried = {}
    for cp in context_parallel_degrees(graph, cluster, space, local_graphs=local_graph is not None):
        if progress is not None:
            progress(f"context parallel {cp}: capturing the rank-local graph ({graph.seq_len // cp} tokens)")
        local = local_graph(graph.seq_len // cp)
        try:
            p, r = make_plan(local, cluster, global_batch=global_batch * cp, space=space - {"cp", "ep", "pp"},
                             cap_bytes=cap_bytes, time_limit_s=time_limit_s, progress=progress, lowering=lowering, cp=cp)
        except (InfeasiblePlanError, ConfigurationError) as exc:
            first_error = first_error or exc
            tried[cp] = None
            continue
        tried[cp] = p.prediction.iteration_time_s
        p = dc_replace(p, **graph_fields(graph))
        if best is None or p.prediction.iteration_time_s < best[0].prediction.iteration_time_s:
            best = (p, r)
    if best is None:
        raise first_error
    if tried:
        best[1].context_parallel = {"chosen_cp": best[0].mesh.degree("cp"), "without_cp_s": without_cp,
                                    "by_cp_s": tried}
    if by_ep:
        best[1].expert_parallel = {"chosen_ep": best[0].ep, "without_ep_s": without_ep, "by_ep_s": by_ep}
    return best
