"""Work done once, on rank 0, whose outcome every rank needs: a plan made there, and the plan's fingerprint check.

Rank 0 runs the work (planning: a function the caller gives, `autoshard.autoparallel` gives the planner's;
capturing the user's model with `torch.export` on fake tensors to check a plan's fingerprint), and broadcasts
the outcome with `broadcast_object_list` — a plan as its versioned JSON, or an error as its class name and
message — so every rank applies the same plan, or every rank raises the same error instead of waiting in a
collective for a rank that died. The runtime itself imports no planning code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from autoshard import errors
from autoshard.errors import RuntimeSetupError
from autoshard.plans.plan import Plan

__all__ = ["broadcast_outcome", "plan_on_rank0", "check_plan_on_rank0"]

log = logging.getLogger(__name__)


def broadcast_outcome(fn: Callable[[], object]) -> object:
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


def plan_on_rank0(make_plan: Callable[[], Plan]) -> Plan:
    """`make_plan()` on rank 0, the same `Plan` on every rank."""
    return Plan.from_json(broadcast_outcome(lambda: make_plan().to_json()), source="the plan broadcast by rank 0")


def check_plan_on_rank0(plan: Plan, model: nn.Module, example_inputs: tuple) -> None:
    """Refuse, on every rank, a plan made for another model: rank 0 captures `model` and compares
    fingerprints (the plan's parameters and modules are also checked on every rank when it is applied)."""
    from autoshard.capture import capture
    from autoshard.runtime.specs import check_fingerprint

    def check() -> None:
        if plan.fingerprint:
            check_fingerprint(plan, capture(model, example_inputs))

    broadcast_outcome(check)
