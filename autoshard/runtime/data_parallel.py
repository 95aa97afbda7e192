"""Sharded data parallelism per op: FSDP2 `fully_shard` in SPMD mode over the `dp` mesh dim, and splitting.

Parameters are already DTensors on the full mesh (replicated on dp), so every op's module gets
`fully_shard(module, mesh=<full mesh>, dp_mesh_dims=...)` (torch >= 2.11's SPMD mode), with

    zero 0     DataParallelMeshDims(replicate="dp")          DDP: gradients all-reduced (averaged)
    zero 1, 2  DataParallelMeshDims(shard="dp"), reshard_after_forward=False   (FSDP2 has no ZeRO-1:
               gradients are sharded too, which only saves memory)
    zero 3     DataParallelMeshDims(shard="dp"), reshard_after_forward=True    FULL_SHARD

all in one FSDP state context, so the levels mix freely per op. FSDP keeps gradients `Partial` on dp until its
own reduction and redistributes the tensor-parallel dims to the parameter's placement. Modules that share a
parameter (a tied embedding and LM head) form one group (`fully_shard([a, b])`). The root gets the remaining
parameters, replicated.

Without a dp axis there is no FSDP; gradients of parameters used on sharded activations (a replicated norm
weight under sequence parallelism) come out `Partial` and are reduced to the parameter's placement by a hook.
"""

from __future__ import annotations

import functools
import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import DataParallelMeshDims, FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autoshard.errors import ConfigurationError
from autoshard.planner.layouts import IN
from autoshard.runtime.specs import ModuleSpec, param_owners
from autoshard.runtime.split import SplitLinear, split_linear
from autoshard.runtime.tensor_parallel import ModuleRuntime

__all__ = ["apply_operator_splitting", "apply_sharded_data_parallel"]

log = logging.getLogger(__name__)


def apply_operator_splitting(model: nn.Module, specs: dict[str, ModuleSpec],
                             runtimes: dict[str, ModuleRuntime], mesh: DeviceMesh) -> None:
    """Rewrite each Linear planned with split S > 1 into a `SplitLinear` (see split.py)."""
    shared = {pid for pid, holders in param_owners(model).items() if len(holders) > 1}
    for path, spec in specs.items():
        if spec.split <= 1:
            continue
        if "dp" not in mesh.mesh_dim_names:
            log.info("op %s: split %d ignored without a dp axis (nothing is gathered)", spec.op, spec.split)
            continue
        module, runtime = model.get_submodule(path), runtimes[path]
        if spec.kind != "linear" or any(id(p) in shared for p in module.parameters(recurse=False)):
            raise ConfigurationError(f"op {spec.op}: operator splitting needs an untied Linear, got "
                                     f"{type(module).__name__}; plan it with split=1")
        if _input_dim_sharded(module, spec):
            # the slices would cut across the tensor-parallel shards of the input dim: run the Linear whole
            # (the same collectives and bytes in one call instead of S; its gathered weight is not cut to 1/S)
            log.warning("op %s: split %d ignored: its weight's input dim is sharded on a tensor-parallel axis",
                        spec.op, spec.split)
            continue
        split = split_linear(model, path, spec.split)
        runtime.module, runtime.compute = split, functools.partial(SplitLinear.forward, split)
        split.forward = runtime


def _input_dim_sharded(module: nn.Module, spec: ModuleSpec) -> bool:
    """Is the weight's input dim sharded on a tensor-parallel axis where it is stored or computed?"""
    weight = spec.params.get("weight")
    return weight is not None and any(p == IN for lay in (weight.storage, weight.compute) for _, p in lay.items)


def _groups(model: nn.Module, specs: dict[str, ModuleSpec]) -> list[tuple[list[nn.Module], int]]:
    """FSDP groups: one per planned module (one per slice of a split Linear), merged where they share a
    parameter; each with its op's zero level."""
    units: list[tuple[nn.Module, int, str]] = []
    for path, spec in specs.items():
        module = model.get_submodule(path)
        if isinstance(module, SplitLinear):
            units += [(s, spec.zero, spec.op) for s in module.slices]
        if any(True for _ in module.parameters(recurse=False)):
            units.append((module, spec.zero, spec.op))
    groups: list[tuple[list[nn.Module], int]] = []
    seen: dict[int, int] = {}  # id(param) -> group index
    for module, zero, op in units:
        pids = [id(p) for p in module.parameters(recurse=False)]
        hit = next((seen[p] for p in pids if p in seen), None)
        if hit is None:
            groups.append(([module], zero))
            hit = len(groups) - 1
        else:
            mods, z = groups[hit]
            if z != zero:
                log.warning("op %s shares a parameter with an op planned with zero=%d; using zero=%d for both",
                            op, z, max(z, zero))
            groups[hit] = ([*mods, module], max(z, zero))
        seen.update({p: hit for p in pids})
    return groups


def _dp_shard_dim(param: nn.Parameter) -> Shard | None:
    """dp shards dim 0 unless a tensor-parallel axis shards it part by part (a fused projection's weight):
    two strided shards of one dim compose into a layout DTensor cannot describe."""
    if isinstance(param, DTensor) and param.dim() > 1 and any(
            isinstance(p, _StridedShard) and p.dim == 0 for p in param.placements):
        return Shard(1)
    return None


def _dims(zero: int) -> DataParallelMeshDims:
    return DataParallelMeshDims(shard="dp") if zero > 0 else DataParallelMeshDims(replicate="dp")


def apply_sharded_data_parallel(model: nn.Module, specs: dict[str, ModuleSpec], mesh: DeviceMesh) -> None:
    """fully_shard every planned module per its zero level, then the root (see the module docstring)."""
    if "dp" not in mesh.mesh_dim_names:
        _reduce_grads_to_param_placement(model)
        return
    for modules, zero in _groups(model, specs):
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh, dp_mesh_dims=_dims(zero),
                    reshard_after_forward=zero == 3, shard_placement_fn=_dp_shard_dim if zero > 0 else None)
    fully_shard(model, mesh=mesh, dp_mesh_dims=_dims(0), reshard_after_forward=False)
    for module in model.modules():  # gradients are exact global sums already (parallel_module._to_local)
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM


def _to_param_placement(param: nn.Parameter) -> None:
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(grad.device_mesh, param.placements)


def _reduce_grads_to_param_placement(model: nn.Module) -> None:
    for param in model.parameters():
        if isinstance(param, DTensor):
            param.register_post_accumulate_grad_hook(_to_param_placement)
