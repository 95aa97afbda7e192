"""Plan -> parallelized module, in one fixed order (STYLE.md rule 7).

    1. the model object becomes a `ParallelModule` (same object, same parameter names);
    2. tensor parallel: parameters become DTensors on the plan's mesh with their storage placement, and every
       planned leaf-module call redistributes its inputs, weights and output (tensor_parallel.py); embeddings
       with sharded rows look up vocabulary-parallel (embedding.py);
    3. statistics-parallel norms, used when a norm's input arrives sharded on the hidden dim (norms.py);
    4. operator splitting of the Linears planned with split > 1 (split.py);
       given example inputs, the choice between running the model's own code on local shards and SPMD mode
       (local_shards.py; it runs two forwards, so before FSDP);
    5. activation recomputation of every repeated block, full or selective (recompute.py), then, if the plan
       says so, `torch.compile` of every repeated block (compile.py);
    6. sharded data parallel per op: FSDP2 in SPMD mode on the dp mesh dim (data_parallel.py), with the
       plan's precision (precision.py: bf16 mixed on GPUs, on a dp dim of one rank when the plan has none).

A plan without tensor-parallel axes skips steps 2 and 3 and runs on plain tensors: its operator splitting
(4) rewrites the Linears and FSDP2 (6) shards them on the dp mesh, no DTensor dispatch per op in between.
An expert-parallel plan (plan.ep > 1) first keeps each rank's experts and routes them by all-to-all
(expert_parallel.py); FSDP2 then runs the experts on the ranks holding the same ones. On a tensor-parallel
mesh the experts of a mixture-of-experts model (any ep, 1 included) stay plain tensors, replicated on the
tensor-parallel axes: their forward takes this rank's tokens out of DTensor and hands its output back.
Pipelined plans go through pipeline.py, which applies steps 2-6 per stage.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autoshard.capture.ir import OpGraph
from autoshard.cost_models.memory import Precision
from autoshard.plans.plan import Plan
from autoshard.runtime.compile import check_compile_plan, check_float8_plan, compile_blocks, convert_float8
from autoshard.runtime.context_parallel import apply_context_parallel
from autoshard.runtime.data_parallel import (
    apply_operator_splitting,
    apply_plain_data_parallel,
    apply_sharded_data_parallel,
    require_spmd_fsdp,
)
from autoshard.runtime.dtensor_ext import register_dtensor_rules
from autoshard.runtime.expert_parallel import apply_expert_parallel, expert_modules
from autoshard.runtime.local_shards import choose_local_shards
from autoshard.runtime.mesh import (
    build_device_mesh,
    context_parallel_group,
    expert_parallel_meshes,
)
from autoshard.runtime.norms import statistics_parallel_forward
from autoshard.runtime.parallel_module import ParallelModule, make_parallel
from autoshard.runtime.precision import compute_dtype, precision_for_device
from autoshard.runtime.recompute import apply_recompute
from autoshard.runtime.specs import ModuleSpec, module_specs
from autoshard.runtime.state import RuntimeState
from autoshard.runtime.tensor_parallel import ModuleRuntime, distribute_parameters, install_module_runtimes

__all__ = ["apply_plan", "materializes_scores"]

log = logging.getLogger(__name__)


def apply_plan(model: nn.Module, plan: Plan, *, mesh: DeviceMesh, graph: OpGraph | None = None,
               example_inputs: tuple | None = None, precision: Precision | None = None) -> ParallelModule:
    """Parallelize `model` in place as `plan` says, on `mesh` (from `build_device_mesh(plan.mesh)`).

    The plan names each op's producers, so it is all the runtime needs; `graph`, the `OpGraph` the plan was made
    from, is optional: when given, the plan's fingerprint is checked against it. `example_inputs` (one batch
    of this rank's inputs, any size) let a tensor-parallel plan run the model's own code on local shards
    when that gives the same outputs (local_shards.py); without them every op runs on DTensors. `precision`:
    what the cost model priced, by default bf16 mixed precision on GPUs and fp32 on CPUs (precision.py). Call on
    every rank.
    """
    precision = precision or precision_for_device(mesh.device_type)
    register_dtensor_rules()
    check_compile_plan(plan)
    check_float8_plan(plan, mesh.device_type)
    convert_float8(model, plan)  # 0: torchao's Float8Linear for the block Linears, before anything else (compile.py)
    specs = module_specs(plan, graph, model)
    if not plan.mesh.tp_axes:  # data parallel and ZeRO only: plain tensors, as torchtitan runs FSDP2
        state = RuntimeState(plan=plan, mesh=mesh, spmd=False)
        if plan.mesh.degree("cp") > 1:  # the mesh's dp dim is dp x cp; attention gathers over the cp group
            group, state.cp_rank = context_parallel_group(plan.mesh, device_type=mesh.device_type)
            state.cp = plan.mesh.degree("cp")
            apply_context_parallel(model, group, state.cp, state.cp_rank)
        experts = None
        if plan.ep > 1:  # each MoE layer's experts over ep of the dp ranks (runtime/expert_parallel.py)
            group, ep_rank, experts, whole = expert_parallel_meshes(plan.mesh, plan.ep, device_type=mesh.device_type)
            apply_expert_parallel(model, group, plan.ep, ep_rank, checkpoint_mesh=whole)
        model = make_parallel(model, state)  # 1
        apply_operator_splitting(model, specs, None, mesh)  # 4
        apply_recompute(model, plan, scores=materializes_scores(plan))  # 5
        compile_blocks(model, plan)
        apply_plain_data_parallel(model, specs, mesh, precision=precision, expert_meshes=experts,  # 6
                                  expert_zero=_expert_zero(plan), whole_blocks=plan.compile)
        log.info("applied plan %s on mesh %s (plain tensors): %d module ops", plan.model, plan.mesh, len(specs))
        return model
    if compute_dtype(precision) is not None and "dp" not in mesh.mesh_dim_names:  # FSDP2 casts the parameters:
        mesh = build_device_mesh(plan.mesh, device_type=mesh.device_type, unit_dp=True)  # give it a dp dim
    if "dp" in mesh.mesh_dim_names:
        require_spmd_fsdp()  # torch 2.11: refused before the model is touched (data_parallel.py)
    state = RuntimeState(plan=plan, mesh=mesh)
    if plan.mesh.degree("cp") > 1:  # the mesh's dp dim is dp x cp; attention gathers over the cp group
        group, state.cp_rank = context_parallel_group(plan.mesh, device_type=mesh.device_type)
        state.cp = plan.mesh.degree("cp")
        apply_context_parallel(model, group, state.cp, state.cp_rank)
    experts, found = None, expert_modules(model)
    if plan.ep > 1 or found:  # the experts run on this rank's tokens, replicated on tp (and over ep of the dp
        # ranks): plain tensors inside, no DTensor grouped matmul (expert_parallel.py)
        group, ep_rank, experts, whole = expert_parallel_meshes(plan.mesh, plan.ep, device_type=mesh.device_type)
        apply_expert_parallel(model, group if plan.ep > 1 else None, plan.ep, ep_rank, spmd=True,
                              checkpoint_mesh=whole if plan.ep > 1 else None)
        specs = _without_experts(specs, [path for path, _ in found])
    model = make_parallel(model, state)  # 1
    plain = {id(p) for _, m in found for p in m.parameters(recurse=False)}  # each rank's experts, after EP
    distribute_parameters(model, specs, mesh, plain=plain)  # 2: storage placements ...
    runtimes = install_module_runtimes(model, specs, mesh, state)  # ... and redistribution around module calls
    _statistics_parallel_norms(specs, runtimes)  # 3
    apply_operator_splitting(model, specs, runtimes, mesh)  # 4
    if example_inputs is not None:  # 4b: the model's own code on local shards if the plan and the code allow
        choose_local_shards(model, state, specs, example_inputs)
    apply_recompute(model, plan, scores=materializes_scores(plan))  # 5
    compile_blocks(model, plan)
    apply_sharded_data_parallel(model, specs, mesh, precision=precision, expert_meshes=experts,  # 6
                                expert_zero=_expert_zero(plan), whole_blocks=plan.compile)
    log.info("applied plan %s on mesh %s: %d module ops", plan.model, plan.mesh, len(specs))
    return model


def _expert_zero(plan: Plan) -> dict[str, int]:
    """Module path -> the highest zero level of its planned ops that hold parameters: read for the experts
    modules, whose grouped matmuls run inside the module's own forward (no leaf-module spec of their own)."""
    out: dict[str, int] = {}
    for p in plan.ops:
        if p.strategy.params:
            out[p.module] = max(out.get(p.module, 0), p.strategy.zero)
    return out


def _without_experts(specs: dict[str, ModuleSpec], paths: list[str]) -> dict[str, ModuleSpec]:
    """`specs` without the experts modules at `paths` and the modules inside them (their activation runs
    inside the experts' own forward on local tensors)."""
    inside = tuple(f"{path}." for path in paths)
    return {p: s for p, s in specs.items() if p not in paths and not p.startswith(inside)}


def materializes_scores(plan: Plan) -> bool:
    """The model computes attention with materialized scores (a softmax op) rather than a fused kernel."""
    return any(p.kind == "softmax" for p in plan.ops)


def _statistics_parallel_norms(specs: dict[str, ModuleSpec], runtimes: dict[str, ModuleRuntime]) -> None:
    for path, spec in specs.items():
        if spec.kind == "norm":
            fn = statistics_parallel_forward(runtimes[path].module)
            if fn is not None:
                runtimes[path].compute = fn
