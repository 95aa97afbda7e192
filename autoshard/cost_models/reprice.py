"""Price a plan made elsewhere (a file, a hand-made plan, another cluster's profile) with the one cost model.

`autoshard measure --cluster FILE` and `scripts/validate_measured.py` use it to set a plan's prediction
beside its measurement under the profile of the cluster it runs on.
"""

from __future__ import annotations

from dataclasses import replace

from autoshard.capture.ir import OpGraph
from autoshard.cost_models.evaluate import Evaluation, evaluate
from autoshard.cost_models.prediction import context_for
from autoshard.errors import PlanFileError
from autoshard.plans.plan import Plan, check_fingerprint

__all__ = ["price_plan"]


def price_plan(plan: Plan, graph: OpGraph, cluster) -> tuple[Plan, Evaluation]:
    """(`plan` with its prediction on `cluster`, the evaluation); `graph` is the plan's model, and for a
    context-parallel plan its rank-local graph (captured at plan.seq / cp tokens; planner/estimate.py)."""
    cp = plan.mesh.degree("cp")
    if cp > 1:
        if graph.seq_len is None or graph.seq_len * cp != plan.seq:
            raise PlanFileError(f"plan {plan.model} is context parallel over {cp} ranks: price it on its rank-local "
                                f"graph, captured at {plan.seq // cp} tokens (this one has {graph.seq_len})")
    else:
        check_fingerprint(plan, graph, exact=True)
    assign = {p.op: p.strategy for p in plan.ops}
    ev = evaluate(graph, assign, context_for(plan, cluster, graph), plan.pipeline,
                  global_batch=plan.global_batch * cp)
    return replace(plan, prediction=ev.prediction, cluster=str(cluster)), ev
