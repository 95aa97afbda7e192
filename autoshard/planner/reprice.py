"""Price a plan made elsewhere (a file, a hand-made plan, another cluster's profile) with the one cost model.

`autoshard measure --cluster FILE` and `scripts/validate_measured.py` use it to set a plan's prediction
beside its measurement under the profile of the cluster it runs on.
"""

from __future__ import annotations

from dataclasses import replace

from autoshard.capture.ir import OpGraph
from autoshard.errors import PlanFileError
from autoshard.planner.context import PlanContext, default_precision
from autoshard.planner.evaluate import Evaluation, evaluate
from autoshard.planner.plan import Plan

__all__ = ["price_plan"]


def price_plan(plan: Plan, graph: OpGraph, cluster) -> tuple[Plan, Evaluation]:
    """(`plan` with its prediction on `cluster`, the evaluation); `graph` is the plan's model."""
    if plan.fingerprint != graph.fingerprint():
        raise PlanFileError(f"plan {plan.model} was made for another graph (fingerprint {plan.fingerprint}, "
                            f"this one {graph.fingerprint()}); re-plan it")
    assign = {p.op: p.strategy for p in plan.ops}
    ctx = PlanContext(mesh=plan.mesh, cluster=cluster, micro_batch=plan.micro_batch,
                      num_microbatches=plan.num_microbatches, precision=default_precision(cluster),
                      recompute=plan.recompute, seq=graph.seq_len)
    ev = evaluate(graph, assign, ctx, plan.pipeline, global_batch=plan.global_batch)
    return replace(plan, prediction=ev.prediction, cluster=str(cluster)), ev
