"""Work done once, on rank 0, whose outcome every rank needs: planning and the plan's fingerprint check.

Rank 0 captures the user's model (`torch.export` with fake tensors: no compute, no memory), plans or checks,
and broadcasts the outcome with `broadcast_object_list` — a plan as its versioned JSON, or an error as its
class name and message — so every rank applies the same plan, or every rank raises the same error instead of
waiting in a collective for a rank that died.

The runtime runs plans without pipeline stages through the model's own forward; plans with a `pp` axis or
layered gradient accumulation need `train_step` and a loss function (pipeline.py). The planning space
therefore excludes `pp` unless the caller asks for it, and layered accumulation with it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable

import torch.distributed as dist
from torch import nn

from autoshard import errors
from autoshard.errors import ConfigurationError, RuntimeSetupError
from autoshard.plans.plan import SCHEDULES, Plan

__all__ = ["RUNTIME_SPACE", "runtime_space", "plan_on_rank0", "check_plan_on_rank0", "plan_summary"]

log = logging.getLogger(__name__)

# What the runtime applies through the model's own forward (every family but pipeline parallelism).
RUNTIME_SPACE = ("dp", "zero", "tp1d", "tp2d", "tp3d")


def _pipeline_available() -> bool:
    try:
        from autoshard.runtime.pipeline import apply_pipeline_plan  # noqa: F401
    except ImportError:
        return False
    return True


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
    if not _pipeline_available():
        raise ConfigurationError(f"space {','.join(sorted(families))} includes pp, but this autoshard's runtime "
                                 "has no pipeline parallelism yet; drop pp from space")
    return families, frozenset(SCHEDULES)


def _cap_bytes(cluster, memory_cap_gib: float | None) -> float:
    if memory_cap_gib is None:
        return cluster.device_memory_bytes
    if isinstance(memory_cap_gib, bool) or not isinstance(memory_cap_gib, (int, float)) or \
            not math.isfinite(memory_cap_gib) or memory_cap_gib <= 0:
        raise ConfigurationError(f"memory_cap must be a positive number of GiB per GPU, got {memory_cap_gib!r}")
    return memory_cap_gib * 2**30


def make_plan(model: nn.Module, cluster, example_inputs: tuple, *, global_batch: int, space, memory_cap,
              graph=None, time_limit_s: float = 20.0) -> Plan:
    """The planner's best plan for `model` on `cluster` inside what the runtime can run (no collectives)."""
    from autoshard.capture import capture
    from autoshard.planner.planning import plan_from_result
    from autoshard.planner.search import search

    families, schedules = runtime_space(space)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigurationError(f"global_batch must be a positive integer, got {global_batch!r}")
    cap = _cap_bytes(cluster, memory_cap)
    graph = graph if graph is not None else capture(model, example_inputs, name=type(model).__name__)
    result = search(graph, cluster, global_batch=global_batch, space=families, schedules=schedules, cap_bytes=cap,
                    time_limit_s=time_limit_s)
    return plan_from_result(graph, cluster, result, global_batch=global_batch, space=families)


def _broadcast_outcome(fn: Callable[[], object]) -> object:
    """`fn()` on rank 0, its result (or its error) on every rank."""
    rank = dist.get_rank()
    box: list = [None]
    failure: BaseException | None = None
    if rank == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - every rank must learn that rank 0 failed
            failure = exc
            box[0] = ("error", type(exc).__name__, str(exc))
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    outcome = box[0]
    if outcome[0] == "ok":
        return outcome[1]
    _, name, message = outcome
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.AutoshardError):
        raise cls(message)
    raise RuntimeSetupError(f"rank 0 failed ({name}: {message})")


def plan_on_rank0(model: nn.Module, cluster, example_inputs: tuple, *, global_batch: int, space=None,
                  memory_cap: float | None = None, graph=None, time_limit_s: float = 20.0) -> Plan:
    """Plan on rank 0 (capture + search), the same `Plan` on every rank; rank 0 logs it."""

    def plan_json() -> dict:
        plan = make_plan(model, cluster, example_inputs, global_batch=global_batch, space=space,
                         memory_cap=memory_cap, graph=graph, time_limit_s=time_limit_s)
        log.info("%s", plan_summary(plan))
        return plan.to_json()

    return Plan.from_json(_broadcast_outcome(plan_json), source="the plan broadcast by rank 0")


def check_plan_on_rank0(plan: Plan, model: nn.Module, example_inputs: tuple) -> None:
    """Refuse, on every rank, a plan made for another model: rank 0 captures `model` and compares
    fingerprints (the plan's parameters and modules are also checked on every rank when it is applied)."""
    from autoshard.capture import capture
    from autoshard.runtime.specs import check_fingerprint

    def check() -> None:
        if plan.fingerprint:
            check_fingerprint(plan, capture(model, example_inputs))

    _broadcast_outcome(check)


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
