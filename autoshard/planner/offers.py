"""What the planner offers beside its plan: float8 on GPUs with fp8 tensor cores.

Float8 changes the numerics (torchao's Float8Linear: e4m3 operands), so the planner never switches it on by
itself; on an H100 / H200 cluster it prices the chosen plan with each recipe where the runtime runs it (no
tensor or expert parallelism: runtime/compile.py) and reports the predicted throughput, so a user can decide.
"""

from __future__ import annotations

from dataclasses import replace

from autoshard.capture.ir import OpGraph
from autoshard.cost_models.float8 import FLOAT8_RECIPES
from autoshard.cost_models.prediction import evaluate_plan
from autoshard.plans.plan import Plan

__all__ = ["float8_offers"]


def float8_offers(plan: Plan, graph: OpGraph, cluster) -> dict[str, float]:
    """Recipe -> predicted tokens/s of `plan` with its block Linears in float8 (same layout, micro-batch and
    recompute); {} where the GPU has no fp8 tensor cores, the plan is in float8 already, or the runtime would
    not run it (tensor or expert parallelism)."""
    if not cluster.gpu.fp8_gemm_speedup or plan.float8 or plan.mesh.tp_axes or plan.ep > 1 or plan.mesh.degree("cp") > 1:
        return {}
    return {recipe: evaluate_plan(replace(plan, float8=recipe), graph, cluster).prediction.tokens_per_s
            for recipe in FLOAT8_RECIPES}
