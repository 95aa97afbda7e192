"""Sharded data parallelism per block and op: FSDP2 `fully_shard` in SPMD mode over the `dp` mesh dim, and splitting.

Parameters are already DTensors on the full mesh (replicated on dp), so every op's module gets
`fully_shard(module, mesh=<full mesh>, dp_mesh_dims=...)` (FSDP2's SPMD mode, torch >= 2.12), with

    zero 0     DataParallelMeshDims(replicate="dp")          DDP: gradients all-reduced (averaged)
    zero 1, 2  DataParallelMeshDims(shard="dp"), reshard_after_forward=False   (FSDP2 has no ZeRO-1:
               gradients are sharded too, which only saves memory)
    zero 3     DataParallelMeshDims(shard="dp"), reshard_after_forward=True    FULL_SHARD

all in one FSDP state context, so the levels mix freely per op. FSDP keeps gradients `Partial` on dp until its
own reduction and redistributes the tensor-parallel dims to the parameter's placement.

Groups (one `fully_shard` call each, so one all-gather / reduce-scatter per group and step, not per op):

    block ops     the modules of one repeated block (`transformer.h.3.*`, the plan's `OpPlan.layer`) planned
                  with the same zero level: `fully_shard([ln_1, c_attn, ...])`, as torchtitan shards one
                  TransformerBlock at a time. On a 4-layer Llama under ZeRO-3 that is 14 all-gathers and 7
                  reduce-scatters per step instead of per-op units' 78 and 39, for the same bytes
                  (benchmarks/runtime_overhead.md; by hand, with the outside ops in the root: 9 and 5).
    split ops     each slice of an operator-split Linear (split > 1) is its own unit: gathering one slice at a
                  time is what bounds the gathered weight to 1/S (OSDP)
    other ops     ops outside blocks (embeddings, the final norm, the LM head): one unit per module
    shared        modules that share a parameter (a tied embedding and LM head) are merged into one group,
                  whatever the above says, at the highest zero level of their ops

Merging changes the number of collectives, not their bytes (each parameter is padded and sharded on its own).
The root gets the remaining parameters, replicated.

Plans without tensor-parallel axes take `apply_plain_data_parallel` instead: the same groups on plain tensors.

Without a dp axis there is no FSDP; gradients of parameters used on sharded activations (a replicated norm
weight under sequence parallelism) come out `Partial` and are reduced to the parameter's placement by a hook.

Torch 2.11 has no SPMD mode (`DataParallelMeshDims` arrived in 2.12). There, the plans that need it (sharded
data parallelism over a mesh with tensor-parallel axes or over a pipeline stage of several ranks; on GPUs
every tensor-parallel plan, whose parameters FSDP2 casts to bf16 over a one-rank dp axis) are refused with
`RuntimeSetupError` naming the torch to install; data parallelism and ZeRO on plain tensors run on it.
"""

from __future__ import annotations

import functools
import logging
import re

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autoshard.cost_models.memory import FP32, Precision
from autoshard.errors import ConfigurationError, RuntimeSetupError
from autoshard.plans.layouts import IN
from autoshard.runtime.precision import fsdp_policy
from autoshard.runtime.specs import ModuleSpec, param_owners
from autoshard.runtime.split import SplitLinear, split_linear
from autoshard.runtime.tensor_parallel import ModuleRuntime

__all__ = ["apply_operator_splitting", "apply_sharded_data_parallel", "apply_plain_data_parallel", "set_microbatch",
           "require_spmd_fsdp"]

log = logging.getLogger(__name__)

try:  # FSDP2's SPMD mode: torch >= 2.12
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # torch 2.11
    DataParallelMeshDims = None


def require_spmd_fsdp() -> None:
    """Raise `RuntimeSetupError` unless this torch has FSDP2's SPMD mode (module docstring)."""
    if DataParallelMeshDims is None:
        import torch

        raise RuntimeSetupError(
            "this plan shards data-parallel parameters on a mesh with tensor-parallel axes or a multi-rank "
            "pipeline stage (on GPUs: every tensor-parallel plan), which needs FSDP2's SPMD mode, new in torch "
            f"2.12; this is torch {torch.__version__}: install torch>=2.12, or plan with --space dp,zero "
            "(data parallelism and ZeRO run on torch 2.11)")


def apply_operator_splitting(model: nn.Module, specs: dict[str, ModuleSpec],
                             runtimes: dict[str, ModuleRuntime] | None, mesh: DeviceMesh) -> None:
    """Rewrite each Linear planned with split S > 1 into a `SplitLinear` (see split.py). `runtimes`: the
    planned module calls' `ModuleRuntime`s in SPMD mode; None on plain tensors, where the split module's own
    forward runs."""
    shared = {pid for pid, holders in param_owners(model).items() if len(holders) > 1}
    for path, spec in specs.items():
        if spec.split <= 1:
            continue
        if "dp" not in mesh.mesh_dim_names:
            log.info("op %s: split %d ignored without a dp axis (nothing is gathered)", spec.op, spec.split)
            continue
        module = model.get_submodule(path)
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
        if runtimes is not None:
            runtime = runtimes[path]
            runtime.module, runtime.compute = split, functools.partial(SplitLinear.forward, split)
            split.forward = runtime


def _input_dim_sharded(module: nn.Module, spec: ModuleSpec) -> bool:
    """Is the weight's input dim sharded on a tensor-parallel axis where it is stored or computed?"""
    weight = spec.params.get("weight")
    return weight is not None and any(p == IN for lay in (weight.storage, weight.compute) for _, p in lay.items)


# a module in repeated block i of a ModuleList: the outermost indexed path component, as capture/blocks.py
# finds blocks (where the plan's `OpPlan.layer` comes from; a ModuleSpec carries the path, not the layer)
_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def _unit_key(path: str, spec: ModuleSpec, slice_index: int | None) -> tuple:
    """Units with equal keys form one FSDP group: per (block, zero level), as torchtitan shards one
    TransformerBlock at a time; an op outside a block and each slice of a split op stay on their own."""
    block = _BLOCK.match(path)
    if block is None or spec.split > 1:
        return ("op", path, slice_index)
    return ("block", block.group(1), spec.zero)


def _groups(model: nn.Module, specs: dict[str, ModuleSpec], *,
            whole_blocks: bool = False) -> list[tuple[list[nn.Module], int]]:
    """FSDP groups: one per (block, zero level), one per planned module outside blocks, one per slice of a
    split Linear; merged where they share a parameter; each with its ops' zero level. `whole_blocks`: a group
    holding every parameter of its block is the block module itself (`_as_block`)."""
    units: list[tuple[nn.Module, int, str, tuple]] = []
    for path, spec in specs.items():
        module = model.get_submodule(path)
        if isinstance(module, SplitLinear):
            units += [(s, spec.zero, spec.op, _unit_key(path, spec, i)) for i, s in enumerate(module.slices)]
        if any(True for _ in module.parameters(recurse=False)):
            units.append((module, spec.zero, spec.op, _unit_key(path, spec, None)))
    _add_unplanned_holders(model, units)
    parent = list(range(len(units)))  # union-find over units: same key, or a shared parameter

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[object, int] = {}  # key or id(param) -> first unit holding it
    for i, (module, _, _, key) in enumerate(units):
        for k in [key, *(id(p) for p in module.parameters(recurse=False))]:
            parent[root(i)] = root(first.setdefault(k, i))
    members: dict[int, list[int]] = {}
    for i in range(len(units)):
        members.setdefault(root(i), []).append(i)
    groups: list[tuple[list[nn.Module], int]] = []
    for idx in members.values():
        zeros = {units[i][1] for i in idx}
        if len(zeros) > 1:
            log.warning("ops %s share a parameter but are planned with zero levels %s; using zero=%d for all",
                        ", ".join(units[i][2] for i in idx), sorted(zeros), max(zeros))
        groups.append(([units[i][0] for i in idx], max(zeros)))
    if whole_blocks:
        paths = {id(m): name for name, m in model.named_modules()}
        groups = [(_as_block(model, modules, paths), zero) for modules, zero in groups]
    return groups


def _as_block(model: nn.Module, modules: list[nn.Module], paths: dict[int, str]) -> list[nn.Module]:
    """[the block] when `modules` are all the parameter holders of one repeated block, else `modules`.

    For compiled blocks (compile.py): FSDP2's hooks are `torch._dynamo.disable`d, so hooks on the leaves inside
    a compiled block break its graph at every leaf, and with DTensors a graph ending in a view of its input
    fails (AOTAutograd regenerates it with `as_strided`, which DTensor lacks). On the block they sit at the
    compiled region's edge, as in torchtitan (`fully_shard(transformer_block)` after `apply_compile`); the
    group's parameters, hence its collectives, are the same."""
    found = {_BLOCK.match(paths.get(id(m), "")) for m in modules}
    blocks = {f.group(1) for f in found if f is not None}
    if len(blocks) != 1 or None in found:
        return modules
    block = model.get_submodule(blocks.pop())
    holders = {id(m) for m in block.modules() if any(True for _ in m.parameters(recurse=False))}
    return [block] if holders == {id(m) for m in modules} else modules


def _add_unplanned_holders(model: nn.Module, units: list) -> None:
    """A module that holds a parameter some unit holds but is not planned itself (BART's `shared` embedding,
    the decoder's copy of a tied embedding, whose op does not own it in the graph) joins that unit's group:
    FSDP manages each parameter in one group only."""
    in_units = {id(u[0]) for u in units}
    by_param = {id(p): u for u in units for p in u[0].parameters(recurse=False)}
    for pid, holders in param_owners(model).items():
        unit = by_param.get(pid)
        if unit is None:
            continue
        for module, _, _ in holders:
            if id(module) not in in_units:
                in_units.add(id(module))
                units.append((module, unit[1], unit[2], unit[3]))


def _dp_shard_dim(param: nn.Parameter) -> Shard | None:
    """dp shards dim 0 unless a tensor-parallel axis shards it part by part (a fused projection's weight):
    two strided shards of one dim compose into a layout DTensor cannot describe."""
    if isinstance(param, DTensor) and param.dim() > 1 and any(
            isinstance(p, _StridedShard) and p.dim == 0 for p in param.placements):
        return Shard(1)
    return None


def _tag(modules: list[nn.Module], zero: int) -> None:
    """Remember each FSDP unit's ZeRO level: `set_microbatch` steers gradient accumulation by it."""
    for module in modules:
        module._autoshard_zero = zero


def set_microbatch(model: nn.Module, *, last: bool) -> None:
    """Before each micro-batch of a step, what the cost model prices per ZeRO level (cost_models/opcost.py):
    ZeRO-0 all-reduces and ZeRO-1 reduce-scatters the accumulated gradients once, after the last micro-batch;
    ZeRO-2 and -3 reduce-scatter after every micro-batch. ZeRO-1 and -2 keep the parameters gathered from the
    first forward to the last backward (one all-gather per step), ZeRO-3 re-gathers them every time."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            zero = getattr(module, "_autoshard_zero", 0)
            module.set_requires_gradient_sync(last or zero >= 2, recurse=False)
            module.set_reshard_after_backward(last or zero == 3, recurse=False)


def _dims(zero: int, unit: bool = False):
    """ZeRO-0 replicates over dp, except on a dp dim of one rank (`unit`), where FSDP2 is there only to cast the
    parameters (precision.py): sharded over one rank, it issues no collective at all."""
    return DataParallelMeshDims(shard="dp") if zero > 0 or unit else DataParallelMeshDims(replicate="dp")


def _unit_dp(mesh: DeviceMesh) -> bool:
    return mesh.size(mesh.mesh_dim_names.index("dp")) == 1


def apply_sharded_data_parallel(model: nn.Module, specs: dict[str, ModuleSpec], mesh: DeviceMesh, *,
                                precision: Precision = FP32, expert_meshes: tuple | None = None,
                                expert_zero: dict[str, int] | None = None, whole_blocks: bool = False) -> None:
    """fully_shard every planned module per its zero level, then the root (see the module docstring), each with
    the precision's mixed-precision policy (precision.py). Without a dp axis the caller autocasts instead.
    `whole_blocks` (compiled blocks): a block's group is the block module itself (`_as_block`).
    The experts modules of a mixture-of-experts model hold plain tensors (apply.py): each is a unit of plain
    FSDP2 first, on the ranks holding the same experts at its tensor-parallel position (`expert_meshes`, as
    in `apply_plain_data_parallel`), summing the exact global gradients like every other unit."""
    if "dp" not in mesh.mesh_dim_names:
        _reduce_grads_to_param_placement(model)
        return
    require_spmd_fsdp()
    mp, unit = fsdp_policy(precision), _unit_dp(mesh)
    if expert_meshes is not None:
        specs = _shard_experts(model, specs, mesh, expert_meshes, expert_zero or {}, mp)
    for modules, zero in _groups(model, specs, whole_blocks=whole_blocks):
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh, dp_mesh_dims=_dims(zero, unit),
                    reshard_after_forward=zero == 3, mp_policy=mp,
                    shard_placement_fn=_dp_shard_dim if zero > 0 or unit else None)
        _tag(modules, zero)
    fully_shard(model, mesh=mesh, dp_mesh_dims=_dims(0, unit), reshard_after_forward=False, mp_policy=mp,
                shard_placement_fn=_dp_shard_dim if unit else None)
    _tag([model], 0)
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


def apply_plain_data_parallel(model: nn.Module, specs: dict[str, ModuleSpec], mesh: DeviceMesh, *,
                              precision: Precision = FP32, expert_meshes: tuple | None = None,
                              expert_zero: dict[str, int] | None = None, whole_blocks: bool = False) -> None:
    """Data parallelism on plain tensors, for plans without tensor-parallel axes (torchtitan's FSDP2 usage):
    the same groups and zero levels as `apply_sharded_data_parallel`, each `fully_shard` on the 1-D dp mesh
    (ZeRO 1-3) or on the dp ranks as HSDP with a one-rank shard dim (ZeRO 0: replicated, gradients
    all-reduced), then the root. Activations stay ordinary tensors: no DTensor dispatch per op, which on the
    4-rank benchmark cost x1.7 over FSDP2 by hand (benchmarks/runtime_overhead.md). FSDP2 averages gradients
    over dp, the global batch's mean loss gradient.

    Ops outside the repeated blocks planned with ZeRO-2 (embeddings, final norm, LM head) are left to the
    root, as torchtitan leaves them: FSDP2 gathers the root's parameters once per step and keeps them until
    backward, which is ZeRO-2's memory (parameters whole from forward to backward) in one collective instead
    of one per op. Only when every parameter belongs to a planned op: otherwise the root holds replicated
    leftovers (ZeRO-0) and those ops keep units of their own. Every unit gets the precision's mixed-precision
    policy (precision.py).

    The experts modules of a mixture-of-experts model (expert_parallel.py `expert_modules`; their grouped
    matmuls run inside the module's own forward, so no leaf-module spec carries them) get a unit each first, at
    the zero level of their ops (`expert_zero`: module path -> zero): on the dp ranks, or under expert
    parallelism on the ranks that hold the same experts (`expert_meshes`, mesh.expert_parallel_meshes); the
    rest as above. `whole_blocks` as in `apply_sharded_data_parallel`."""
    from autoshard.runtime.mesh import replicate_mesh

    planned = {id(p) for path in specs for p in model.get_submodule(path).parameters()}
    leftovers = any(id(p) not in planned for p in model.parameters())
    mp = fsdp_policy(precision)
    specs = _shard_experts(model, specs, mesh, expert_meshes, expert_zero or {}, mp)
    if not leftovers:
        specs = {path: spec for path, spec in specs.items()
                 if not (spec.zero == 2 and spec.split == 1 and _BLOCK.match(path) is None)}
    unit = _unit_dp(mesh)
    for modules, zero in _groups(model, specs, whole_blocks=whole_blocks):
        fully_shard(modules if len(modules) > 1 else modules[0], reshard_after_forward=zero == 3,
                    mesh=mesh if zero > 0 or unit else replicate_mesh(mesh), mp_policy=mp)
        _tag(modules, zero)
    fully_shard(model, mesh=replicate_mesh(mesh) if leftovers and not unit else mesh, reshard_after_forward=False,
                mp_policy=mp)
    _tag([model], 0 if leftovers else 2)


def _shard_experts(model: nn.Module, specs: dict[str, ModuleSpec], mesh: DeviceMesh, meshes: tuple | None,
                   zeros: dict[str, int], mp) -> dict[str, ModuleSpec]:
    """fully_shard every experts module on `meshes` (shard mesh, replicate mesh; None: the dp mesh): sharded
    (ZeRO 1-3) or replicated (ZeRO-0, HSDP) at `zeros[path]`; on a mesh of one rank a unit that issues no
    collective. Returns `specs` without the experts modules."""
    from autoshard.runtime.expert_parallel import expert_modules
    from autoshard.runtime.mesh import replicate_mesh

    found = expert_modules(model)
    if not found:
        return specs
    shard_mesh, replicate = meshes or (mesh, None if _unit_dp(mesh) else replicate_mesh(mesh))
    paths = set()
    for path, module in found:
        zero = zeros.get(path, 0)
        one = shard_mesh.size() == 1
        fully_shard(module, mesh=shard_mesh if zero > 0 or one else replicate, reshard_after_forward=zero == 3,
                    mp_policy=mp)
        _tag([module], zero)
        paths.add(path)
    return {p: s for p, s in specs.items() if p not in paths}
