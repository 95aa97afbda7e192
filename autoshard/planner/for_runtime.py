"""The plan `autoshard.autoparallel` makes when it is given none: the planner's best plan inside what the
runtime runs through the model's own forward.

Plans with a `pp` axis or layered gradient accumulation need `train_step` and a loss function
(runtime/pipeline.py), so the space excludes `pp` unless the caller asks for it, and layered accumulation with
it. The runtime calls `make_runtime_plan` on rank 0 only and broadcasts its plan (runtime/rank0.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from autoshard.errors import ConfigurationError
from autoshard.plans.plan import SCHEDULES, Plan

__all__ = ["RUNTIME_SPACE", "runtime_space", "make_runtime_plan", "plan_summary"]

log = logging.getLogger(__name__)

# What the runtime applies through the model's own forward (every family but pipeline parallelism).
RUNTIME_SPACE = ("dp", "zero", "tp1d", "tp2d", "tp3d")


def runtime_space(space: str | Iterable[str] | None) -> tuple[frozenset[str], frozenset[str]]:
    """(families, pipeline schedules) to plan over: `space` as given ("dp,zero,tp1d" or a list of names), or
    every family the runtime runs without pipeline stages."""
    from autoshard.planner.search import parse_space

    if space is None:
        families = frozenset(RUNTIME_SPACE)
    else:
        families = parse_space(space if isinstance(space, str) else ",".join(space))
    if "pp" not in families:
        # no layered (breadth-first) accumulation either: it runs through pipeline schedules only
        return families, frozenset(s for s in SCHEDULES if s != "looped-bfs")
    return families, frozenset(SCHEDULES)


def _cap_bytes(cluster, memory_cap_gib: float | None) -> float:
    if memory_cap_gib is None:
        return cluster.device_memory_bytes
    if isinstance(memory_cap_gib, bool) or not isinstance(memory_cap_gib, (int, float)) or \
            not math.isfinite(memory_cap_gib) or memory_cap_gib <= 0:
        raise ConfigurationError(f"memory_cap must be a positive number of GiB per GPU, got {memory_cap_gib!r}")
    return memory_cap_gib * 2**30


def make_runtime_plan(model, cluster, example_inputs: tuple, *, global_batch: int, space=None,
                      memory_cap: float | None = None, graph=None, time_limit_s: float = 20.0,
                      lowering=None) -> Plan:
    """The planner's best plan for `model` (an nn.Module and one batch of its inputs, or its `graph`) on
    `cluster` inside what the runtime can run; logs it."""
    from autoshard.capture import capture
    from autoshard.planner.planning import plan_from_result
    from autoshard.planner.search import search

    families, schedules = runtime_space(space)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigurationError(f"global_batch must be a positive integer, got {global_batch!r}")
    cap = _cap_bytes(cluster, memory_cap)
    graph = graph if graph is not None else capture(model, example_inputs, name=type(model).__name__)
    result = search(graph, cluster, global_batch=global_batch, space=families, schedules=schedules, cap_bytes=cap,
                    time_limit_s=time_limit_s, **({"lowering": lowering} if lowering is not None else {}))
    plan = plan_from_result(graph, cluster, result, global_batch=global_batch, space=families)
    log.info("%s", plan_summary(plan))
    if lowering is not None and lowering.float8 and not plan.float8:
        log.warning("float8=%r was asked for, but the fastest plan (mesh %s) is on a layout the runtime trains in "
                    "16 bits (tensor or expert parallelism): its GEMMs stay 16-bit; space='dp,zero,pp' plans only "
                    "layouts trained in float8", lowering.float8, plan.mesh)
    return plan


def plan_summary(plan: Plan) -> str:
    """The plan as rank 0 logs it: mesh, micro-batching, predicted time and one line per op of each group of
    identical layers."""
    from autoshard.planner.explain import batch_label, block_table

    lines = [f"plan for {plan.model}: mesh {plan.mesh}, global batch {plan.global_batch} "
             f"({batch_label(plan.micro_batch, plan.num_microbatches)}), recompute {plan.recompute}"]
    if plan.prediction is not None:
        pred = plan.prediction
        lines.append(f"predicted {pred.iteration_time_s * 1e3:.2f} ms per step, "
                     f"{pred.memory.total_bytes / 2**30:.2f} GiB per device")
    lines += block_table(plan)
    return "\n".join(lines)
