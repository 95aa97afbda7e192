"""What the planner offers beside its plan: float8 on GPUs with fp8 tensor cores.

Float8 changes the numerics (torchao's Float8Linear: e4m3 operands), so the planner never switches it on by
itself; on an H100 / H200 cluster it prices the chosen plan with each recipe where the runtime runs it (no
tensor or expert parallelism: runtime/compile.py) and reports the predicted throughput, so a user can decide.
Where the chosen layout has no such offer, `plan` offers instead the fastest plan the search finds in each recipe
(api.float8_searches: the search `plan --float8 RECIPE` runs, over the families the runtime trains in float8).
"""

from __future__ import annotations

from dataclasses import replace

from autoshard.capture.ir import OpGraph
from autoshard.cost_models.float8 import FLOAT8_RECIPES
from autoshard.cost_models.prediction import evaluate_plan
from autoshard.plans.plan import Plan

__all__ = ["float8_offers", "float8_blocked_by"]


def float8_blocked_by(plan: Plan, cluster) -> str:
    """What in `plan`'s layout the runtime does not train in float8 ("tensor parallelism", "expert parallelism";
    runtime/compile.py `check_float8_plan`); "" where it does, the GPU has no fp8 tensor cores or the plan is in
    float8 already."""
    if not cluster.gpu.fp8_gemm_speedup or plan.float8:
        return ""
    if plan.mesh.tp_axes:
        return "tensor parallelism"
    if plan.ep > 1:
        return "expert parallelism"
    return ""


def float8_offers(plan: Plan, graph: OpGraph, cluster) -> dict[str, float]:
    """Recipe -> predicted tokens/s of `plan` with its block Linears in float8 (same layout, micro-batch and
    recompute); {} where the GPU has no fp8 tensor cores, the plan is in float8 already, the runtime would not
    run it (`float8_blocked_by`), or the plan is context parallel (priced on its rank-local graph, which `graph`
    is not). Where it is {} on an fp8 GPU, `plan` offers the float8 search's plans instead (api.float8_searches)."""
    if not cluster.gpu.fp8_gemm_speedup or plan.float8 or float8_blocked_by(plan, cluster) or \
            plan.mesh.degree("cp") > 1:
        return {}
    return {recipe: evaluate_plan(replace(plan, float8=recipe), graph, cluster).prediction.tokens_per_s
            for recipe in FLOAT8_RECIPES}
