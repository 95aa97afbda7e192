"""`autoparallel`: the runtime half of the public entry point (autoshard/api.py re-exports it).

It resolves the cluster, joins (or starts) the process group, checks that the job matches the plan, captures
the model's graph (the plan names ops; the graph says which op feeds which), builds the mesh and applies the
plan. Planning itself (`plan=None`) belongs to the planner and is hooked up there.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from autoshard.errors import ConfigurationError, RuntimeSetupError
from autoshard.planner.plan import Plan
from autoshard.runtime.apply import apply_plan
from autoshard.runtime.failure import align_group_timeouts, distributed_phase
from autoshard.runtime.mesh import DEFAULT_TIMEOUT_S, build_device_mesh, init_distributed
from autoshard.runtime.parallel_module import ParallelModule

if TYPE_CHECKING:
    from autoshard.capture.ir import OpGraph
    from autoshard.hardware_profiles.cluster import ClusterSpec

__all__ = ["autoparallel", "resolve_cluster"]

log = logging.getLogger(__name__)


def resolve_cluster(cluster: ClusterSpec | str | int) -> tuple[int, str]:
    """(number of ranks, device type) of a `ClusterSpec`, a cluster string ("1x4xcpu") or a plain rank count
    (CPU ranks)."""
    if isinstance(cluster, bool) or (isinstance(cluster, int) and cluster < 1):
        raise ConfigurationError(f"cluster must be a ClusterSpec, a spec such as 1x4xcpu, or a positive number "
                                 f"of CPU ranks; got {cluster!r}")
    if isinstance(cluster, int):
        return cluster, "cpu"
    if isinstance(cluster, (str, os.PathLike)):
        from autoshard.hardware_profiles.cluster import ClusterSpec

        cluster = ClusterSpec.parse(cluster)
    return cluster.num_gpus, "cpu" if cluster.gpu.name == "cpu" else "cuda"


def _load_plan(plan: Plan | str | os.PathLike | None) -> Plan:
    if plan is None:
        raise ConfigurationError("planner not available yet: pass plan= a Plan or a plan file made with "
                                 "`autoshard plan MODEL --cluster SPEC -o plan.json`")
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return Plan.load(plan)
    raise ConfigurationError(f"plan must be a Plan or a path to a plan file, got {type(plan).__name__}")


def _check_job(plan: Plan, num_ranks: int, global_batch: int) -> None:
    world = dist.get_world_size()
    if num_ranks != world or plan.mesh.size != world:
        raise RuntimeSetupError(f"the cluster has {num_ranks} devices, the plan's mesh ({plan.mesh}) "
                                f"{plan.mesh.size} and this job {world} ranks; launch "
                                f"`torchrun --nproc-per-node {plan.mesh.size}` with a matching cluster")
    if global_batch != plan.global_batch:
        raise ConfigurationError(f"global_batch={global_batch} but the plan was made for "
                                 f"{plan.global_batch}; re-plan or pass global_batch={plan.global_batch}")


def autoparallel(model: nn.Module, cluster: ClusterSpec | str | int, *, example_inputs: tuple, global_batch: int,
                 plan: Plan | str | os.PathLike | None = None, space: tuple[str, ...] | None = None,
                 memory_cap: float | None = None, graph: OpGraph | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelModule:
    """Parallelize `model` for this rank of a `cluster` job as `plan` says; call on every rank.

    `example_inputs` are inputs of any batch size (token ids (B, S) for a language model); `graph` skips the
    capture when the caller has the plan's `OpGraph` already. `space` and `memory_cap` steer the planner and are
    ignored when a plan is given. The returned module is `model` itself (same parameter names) with `.plan`,
    `.mesh` and `.shard_inputs(global_inputs)`; its outputs are this rank's batch slice as ordinary tensors.
    """
    plan = _load_plan(plan)
    if space is not None or memory_cap is not None:
        log.info("space / memory_cap steer the planner; ignored because a plan was given")
    num_ranks, device_type = resolve_cluster(cluster)
    init_distributed(device_type=device_type, timeout_s=timeout_s)
    with distributed_phase("autoparallel"):  # a failure on one rank names it on every rank
        _check_job(plan, num_ranks, global_batch)
        if graph is None:
            from autoshard.capture import capture

            graph = capture(model, example_inputs if isinstance(example_inputs, tuple) else (example_inputs,))
        if device_type == "cuda":
            model.to(torch.device("cuda", torch.cuda.current_device()))
        mesh = build_device_mesh(plan.mesh, device_type=device_type)
        align_group_timeouts()  # the mesh's sub-groups get the default group's timeout, not gloo's 30 minutes
        return apply_plan(model, plan, graph=graph, mesh=mesh)
