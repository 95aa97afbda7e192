"""`autoparallel` on the ranks: parallelize a model for this rank of a job, with a plan.

It resolves the cluster, joins (or starts) the process group, gets the plan (given, or made on rank 0 by the
caller's `make_plan` and broadcast: rank0.py), checks that the job and the model match it, builds the mesh and
applies the plan (apply.py; pipeline.py for plans with pipeline stages). The public `autoshard.autoparallel`
(api.py) calls it with the planner's `make_plan`; the runtime imports no planning code.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from autoshard.capture.export import positional_inputs
from autoshard.errors import ConfigurationError, RuntimeSetupError
from autoshard.plans.plan import Plan
from autoshard.runtime.apply import apply_plan
from autoshard.runtime.failure import align_group_timeouts, distributed_phase
from autoshard.runtime.mesh import DEFAULT_TIMEOUT_S, build_device_mesh, init_distributed
from autoshard.runtime.parallel_module import ParallelModule
from autoshard.runtime.rank0 import check_plan_on_rank0, plan_on_rank0
from autoshard.runtime.specs import check_fingerprint

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
    return cluster.num_gpus, cluster.gpu.device


def _load_plan(plan: Plan | str | os.PathLike) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return Plan.load(plan)
    raise ConfigurationError(f"plan must be None (plan now), a Plan or a path to a plan file, got "
                             f"{type(plan).__name__}")


def _check_job(plan: Plan, num_ranks: int, global_batch: int) -> None:
    world = dist.get_world_size()
    if num_ranks != world or plan.mesh.size != world:
        raise RuntimeSetupError(f"the cluster has {num_ranks} devices, the plan's mesh ({plan.mesh}) "
                                f"{plan.mesh.size} and this job {world} ranks; launch "
                                f"`torchrun --nproc-per-node {plan.mesh.size}` with a matching cluster")
    if global_batch != plan.global_batch:
        raise ConfigurationError(f"global_batch={global_batch} but the plan was made for "
                                 f"{plan.global_batch}; re-plan or pass global_batch={plan.global_batch}")


def _cluster_spec(cluster, num_ranks: int):
    from autoshard.hardware_profiles.cluster import ClusterSpec

    if isinstance(cluster, ClusterSpec):
        return cluster
    return ClusterSpec.parse(f"1x{num_ranks}xcpu" if isinstance(cluster, int) else cluster)


def autoparallel(model: nn.Module, cluster: ClusterSpec | str | int, *, example_inputs, global_batch: int,
                 plan: Plan | str | os.PathLike | None = None, loss_fn: Callable | None = None,
                 graph: OpGraph | None = None, timeout_s: float | None = None,
                 make_plan: Callable[..., Plan] | None = None, compile: bool | None = None) -> ParallelModule:
    """Parallelize `model` for this rank of a `cluster` job with `plan`; call on every rank.

    A given `Plan` or plan file is checked against the model (rank 0 captures it and compares fingerprints;
    `graph`, the plan's `OpGraph`, skips that capture). `plan=None`: rank 0 calls `make_plan(model, cluster,
    inputs, graph=graph)` and broadcasts its plan (`autoshard.autoparallel` passes the planner's). The returned
    module is `model` itself (same parameter names) with `.plan`, `.mesh` and `.shard_inputs(global_inputs)`;
    its outputs are this rank's batch slice as ordinary tensors. `loss_fn(output, target)` is needed by
    pipelined plans, which train through `train_step`. `compile`: True / False overrides the plan's `compile`
    (every repeated block torch.compile'd, runtime/compile.py); None keeps it.
    """
    inputs = positional_inputs(model, example_inputs)
    num_ranks, device_type = resolve_cluster(cluster)
    init_distributed(device_type=device_type, timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    with distributed_phase("autoparallel"):  # a failure on one rank names it on every rank
        if plan is None:
            if make_plan is None:
                raise ConfigurationError("no plan given: pass plan= (a Plan or a plan file), or call "
                                         "autoshard.autoparallel, which plans on rank 0")
            spec = _cluster_spec(cluster, num_ranks)
            plan = plan_on_rank0(lambda: make_plan(model, spec, inputs, graph=graph))
        else:
            plan = _load_plan(plan)
            if graph is None:
                check_plan_on_rank0(plan, model, inputs)
            else:
                check_fingerprint(plan, graph)
        if compile is not None and compile != plan.compile:  # the prediction was priced the other way
            log.info("compile=%s overrides the plan's compile=%s", compile, plan.compile)
            plan = dataclasses.replace(plan, compile=compile)
        _check_job(plan, num_ranks, global_batch)
        if device_type == "cuda":
            model.to(torch.device("cuda", torch.cuda.current_device()))
        if _pipelined(plan):
            from autoshard.runtime.pipeline import apply_pipeline_plan

            return apply_pipeline_plan(model, plan, graph=graph, example_inputs=inputs, loss_fn=loss_fn,
                                       device_type=device_type)
        mesh = build_device_mesh(plan.mesh, device_type=device_type)
        align_group_timeouts()  # the mesh's sub-groups get the default group's timeout, not gloo's 30 minutes
        pmodel = apply_plan(model, plan, mesh=mesh, example_inputs=inputs)
        align_group_timeouts()  # and the groups apply_plan made (a replicated-dp mesh for ZeRO-0 on plain tensors)
        if loss_fn is not None:
            from autoshard.runtime.pipeline_train import attach_loss_fn

            attach_loss_fn(pmodel, loss_fn)
        return pmodel


def _pipelined(plan: Plan) -> bool:
    """The plan needs pipeline stages (pp axis, several chunks or layered accumulation)."""
    try:
        from autoshard.runtime.pipeline import uses_pipeline
    except ImportError:  # no pipeline runtime: build_device_mesh rejects a pp axis with a clear error
        return False
    return uses_pipeline(plan)
