"""Pipeline parallelism: a plan with a `pp` axis (or layered gradient accumulation) -> stages and a schedule.

Apply order (STYLE.md rule 7), in `apply_pipeline_plan`:

    1. the full mesh (pp, dp, tp...) with pp outermost, as `MeshSpec.stride` lays ranks out; a stage computes
       on the sub-mesh of the other axes (mesh.py's mesh for one pipeline slice);
    2. pipeline split: every chunk of `plan.pipeline.stage_layers` becomes a `PipelineChunk` holding the
       model's own submodules under their original names (pipeline_split.py); chunk c runs on pp rank
       c mod degree ("loop" placement: Narayanan et al.'s interleaving, Lamy-Poirier's modular pipeline);
       the model keeps only this rank's chunks; a parameter tied across chunks gets a copy per chunk;
    3. per local chunk, the non-pipeline runtime on the stage's sub-mesh (`apply_plan_to_stage`): tensor
       parallel, statistics-parallel norms, operator splitting, sharded data parallel with the chunk as FSDP
       root (pipelining calls FSDP's post-backward itself once per step: no reduction per micro-batch);
    4. one `PipelineStage` per local chunk (static shapes, inferred with fake tensors from the example
       inputs) and the plan's schedule from torch.distributed.pipelining.

Activations cross stages as plain tensors: this rank's dp slice of the micro-batch, replicated over the
tensor-parallel axes (each tp rank sends its copy to its peer of the next stage). Each stage turns them into
DTensors and back, as `ParallelModule.forward` does for the whole model.

`train_step(model, inputs, target)` runs forward, loss and backward of one global batch (this rank's dp
slice, as `shard_inputs` cuts it): the schedule splits it into `plan.num_microbatches` micro-batches; the
loss `loss_fn(output, target)` of each, divided by their number, is computed on the last stage; gradients
are summed into `.grad` (they accumulate over calls like `backward()`), the copies of tied parameters
summed, and the mean loss is returned on every rank. Without pipeline parallelism it runs the same loop
depth-first on the ParallelModule (pipeline_train.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoshard.cost_models.memory import FP32, Precision
from autoshard.errors import ConfigurationError, PlanFileError, RuntimeSetupError
from autoshard.plans.contract import schedule_blocker
from autoshard.plans.layouts import SEQ, MeshSpec
from autoshard.plans.plan import Plan
from autoshard.runtime.apply import _statistics_parallel_norms, materializes_scores
from autoshard.runtime.compile import check_compile_plan, check_float8_plan, compile_blocks, convert_float8
from autoshard.runtime.data_parallel import (
    apply_operator_splitting,
    apply_plain_data_parallel,
    apply_sharded_data_parallel,
    require_spmd_fsdp,
)
from autoshard.runtime.dtensor_ext import SPMDMode, register_dtensor_rules
from autoshard.runtime.mesh import build_device_mesh
from autoshard.runtime.parallel_module import ParallelModule
from autoshard.runtime.pipeline_split import (
    PipelineChunk,
    TiedCopy,
    build_chunks,
    family_of,
    prune_model,
    untie_across_chunks,
)
from autoshard.runtime.pipeline_train import PipelineState, TiedSync, train_step
from autoshard.runtime.precision import compute_dtype, precision_for_device
from autoshard.runtime.recompute import apply_recompute
from autoshard.runtime.specs import ModuleSpec, module_specs
from autoshard.runtime.state import RuntimeState
from autoshard.runtime.tensor_parallel import distribute_parameters, install_module_runtimes, param_layouts

if TYPE_CHECKING:
    from autoshard.capture.ir import OpGraph

__all__ = ["uses_pipeline", "apply_pipeline_plan", "apply_plan_to_stage", "build_pipeline_mesh",
           "PipelinedModule", "SCHEDULES"]

log = logging.getLogger(__name__)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
             "looped-bfs": ScheduleLoopedBFS}
_MULTI_CHUNK = ("interleaved-1f1b", "looped-bfs")
_MESHES: dict[tuple, tuple[DeviceMesh, object]] = {}  # see mesh.py: one mesh object per value and world
_STAGE_MESHES: dict[int, DeviceMesh] = {}  # id(full mesh in _MESHES) -> its stage sub-mesh


def uses_pipeline(plan: Plan) -> bool:
    """The plan needs stages: a pp axis, several chunks, or layered (breadth-first) gradient accumulation."""
    pipe = plan.pipeline
    return plan.mesh.degree("pp") > 1 or pipe.degree * pipe.virtual_stages > 1 or pipe.layered


def build_pipeline_mesh(plan: Plan, *, device_type: str = "cpu", unit_dp: bool = False) -> DeviceMesh:
    """The mesh ("pp", <the plan's other axes>) over every rank, pp outermost (degree 1 without a pp axis);
    `unit_dp` as in `build_device_mesh`: a dp dim of one rank after pp when the plan has none."""
    spec, pipe = plan.mesh, plan.pipeline
    if spec.degree("pp") != pipe.degree:
        raise PlanFileError(f"the plan's mesh has pp={spec.degree('pp')} but its pipeline degree is "
                            f"{pipe.degree}; re-plan")
    axes = spec.spmd_axes
    names = ("pp", *(("dp",) if unit_dp and "dp" not in axes else ()), *axes)
    shape = tuple(spec.degree(a) for a in names)
    world = dist.get_world_size()
    if math.prod(shape) != world:
        raise RuntimeSetupError(f"the plan's mesh {spec} needs {math.prod(shape)} ranks but this job has "
                                f"{world}; launch torchrun --nproc-per-node {math.prod(shape)} or re-plan")
    key = (device_type, names, shape)
    cached = _MESHES.get(key)
    if cached is not None and cached[1] is dist.group.WORLD:
        return cached[0]
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    _MESHES[key] = (mesh, dist.group.WORLD)
    return mesh


def _stage_mesh(full: DeviceMesh, plan: Plan, device_type: str, unit_dp: bool = False) -> DeviceMesh | None:
    """The sub-mesh one stage computes on; None when it is a single rank (plain tensors, no DTensor).

    One object per value in a process (see mesh.py's `_MESHES`): with pipeline degree 1 it is mesh.py's own
    mesh of the same axes, so a pipelined and a plain plan of equal meshes share it."""
    names = full.mesh_dim_names[1:]
    if math.prod(full.shape[1:]) == 1:
        return None
    if full.size(0) == 1:
        return build_device_mesh(MeshSpec(axes=tuple((a, d) for a, d in plan.mesh.axes if a != "pp")),
                                 device_type=device_type, unit_dp=unit_dp)
    if id(full) not in _STAGE_MESHES:
        _STAGE_MESHES[id(full)] = full[names[0]] if len(names) == 1 else full[names]
    return _STAGE_MESHES[id(full)]


def apply_plan_to_stage(stage: nn.Module, specs: dict[str, ModuleSpec], mesh: DeviceMesh, plan: Plan, *,
                        precision: Precision = FP32) -> None:
    """Steps 2-6 of `apply_plan` on one pipeline chunk, with the chunk as the root (its FSDP root too).

    `specs` are the chunk's own (paths inside the chunk equal the model's, see pipeline_split.py)."""
    distribute_parameters(stage, specs, mesh)
    runtimes = install_module_runtimes(stage, specs, mesh)
    _statistics_parallel_norms(specs, runtimes)
    apply_operator_splitting(stage, specs, runtimes, mesh)
    apply_recompute(stage, plan, scores=materializes_scores(plan))
    compile_blocks(stage, plan)
    apply_sharded_data_parallel(stage, specs, mesh, precision=precision, whole_blocks=plan.compile)


def _gather_once_per_step(chunk: nn.Module) -> None:
    """A pipeline stage gathers a chunk's sharded parameters once per step, not per micro-batch: torch's
    pipelining keeps them gathered after each backward until the step's REDUCE_GRAD
    (`set_reshard_after_backward(False)`, torch/distributed/pipelining/stage.py), so ZeRO-3's resharding after
    every forward only gathers them again for the next backward, m + 1 gathers per step for the same peak.
    torchtitan turns it off under pipelining ("For PP, do not reshard after forward to avoid per-microbatch
    all-gathers", `reshard_after_forward = not pp_enabled`); layered accumulation gathers once per step by
    design (Lamy-Poirier 2021 §3)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    for module in chunk.modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = module._get_fsdp_state()._fsdp_param_groups
        if groups and all(isinstance(g.mesh_info, FSDPMeshInfo) for g in groups):  # sharded, not replicated
            module.set_reshard_after_forward(False, recurse=False)


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward scales the gradient (1/dp on the last stage's output: parallel_module.py)."""

    # a copy of parallel_module._ScaleGrad: that module's private helper may change with the runtime

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


@dataclass
class _SPMDBoundary:
    """A chunk's forward on a stage mesh: the local slice in, DTensors inside, the local slice out. Between
    chunks the hidden states travel as a data-parallel rank's batch slice and, with tensor parallelism, each
    tensor-parallel rank's slice of the sequence (Megatron-LM's scatter/gather of pipeline sends, Narayanan
    et al. 2021 §4.1: 1/t of the bytes): under sequence parallelism the plan's own layout; where the plan
    keeps them replicated, the sender keeps its slice (no communication) and the receiver all-gathers them
    over the tensor-parallel group before its first op, their gradient the reverse way (`cut_send_axes`).
    The first chunk takes the token ids replicated on the tensor-parallel axes; the last hands the loss its
    output at full width, with the gradient scaled by 1/dp, because the loss of one dp rank's slice is its
    term of the global mean (see parallel_module._to_local)."""

    mesh: DeviceMesh
    grad_scale: float = 1.0
    seq_in: tuple[str, ...] = ()  # axes the chunk's input is sequence-sharded on, as the plan lays it out
    seq_out: tuple[str, ...] = ()  # axes its output is sent sequence-sharded on (not the last chunk)
    seq_recv: tuple[str, ...] = ()  # axes its input arrives sequence-sharded on (the previous chunk's seq_out)

    def _placements(self, x: torch.Tensor, seq_axes: tuple[str, ...]) -> list:
        return [Shard(0) if n == "dp" and x.dim() > 0 else Shard(1) if n in seq_axes else Replicate()
                for n in self.mesh.mesh_dim_names]

    def __call__(self, chunk: PipelineChunk, x: torch.Tensor) -> torch.Tensor:
        with SPMDMode():
            x = DTensor.from_local(x, self.mesh, self._placements(x, self.seq_recv), run_check=False)
            if self.seq_recv != self.seq_in:  # a scattered send: all-gather it (its gradient: the local slice)
                x = x.redistribute(self.mesh, self._placements(x, self.seq_in))
            y = chunk.run(x)
            if not isinstance(y, DTensor):
                return y
            target = self._placements(y, self.seq_out)
            local = y.redistribute(self.mesh, target).to_local() if tuple(target) != y.placements else y.to_local()
        # through _ScaleGrad even with a factor of 1: an alias, not the view to_local() makes (FSDP2 warns)
        return _ScaleGrad.apply(local, self.grad_scale) if local.requires_grad else local


def cut_sequence_axes(plan: Plan, stage_layers: tuple[tuple[int, int], ...]) -> list[tuple[str, ...] | None]:
    """Per cut c (chunk c -> c + 1): the tensor-parallel axes the plan's layout shards the hidden states'
    sequence on there, from the last op of chunk c's last block; None where that layout leaves them
    replicated over every tensor-parallel axis (what `cut_send_axes` may scatter)."""
    last = {}
    for op in plan.ops:
        if op.layer is not None:
            last[op.layer] = op
    tp_axes = {a for a in plan.mesh.tp_axes if plan.mesh.degree(a) > 1}
    out: list[tuple[str, ...] | None] = []
    for lo, hi in stage_layers[:-1]:
        op = last.get(hi - 1) if hi > lo else None
        lay = op.strategy.output if op is not None else None
        if lay is None:
            out.append(())
        elif not any(a in tp_axes for a, _ in lay.items):
            out.append(None)
        else:
            out.append(tuple(a for a, p in lay.items if p == SEQ and a != "dp"))
    return out


def cut_send_axes(plan: Plan, planned: list[tuple[str, ...] | None],
                  hidden: list[tuple[int, ...]]) -> list[tuple[str, ...]]:
    """Per cut: the axes the hidden states (shape `hidden[c]`) travel sequence-sharded on. As the plan lays
    them out; where it leaves them replicated over the tensor-parallel group and the pipeline has more than
    one stage, every tensor-parallel axis: each rank sends its 1/t slice and the receiver all-gathers them
    (Megatron-LM's scatter/gather, Narayanan et al. 2021 §4.1; `evaluate.cut_sends` prices the same), unless
    t does not divide the sequence."""
    tp_axes = tuple(a for a in plan.mesh.tp_axes if plan.mesh.degree(a) > 1)
    t = math.prod(plan.mesh.degree(a) for a in tp_axes)
    out = []
    for axes, shape in zip(planned, hidden, strict=True):
        if axes is not None:
            out.append(axes)
        elif plan.pipeline.degree > 1 and t > 1 and len(shape) >= 2 and shape[1] % t == 0:
            out.append(tp_axes)
        else:
            out.append(())
    return out


class PipelinedModule(ParallelModule):
    """The model a pipelined plan returns: this rank's chunks only, trained through `train_step`."""

    def forward(self, *args, **kwargs):
        raise ConfigurationError("a pipelined model runs forward and backward together, micro-batch by "
                                 "micro-batch: call pm.train_step(inputs, target) instead of pm(inputs)")

    def train_step(self, inputs: tuple, target: torch.Tensor) -> torch.Tensor:
        return train_step(self, inputs, target)


def _stage_layers(plan: Plan, num_blocks: int) -> tuple[tuple[int, int], ...]:
    pipe = plan.pipeline
    chunks = pipe.degree * pipe.virtual_stages
    if pipe.stage_layers:
        if len(pipe.stage_layers) != chunks:
            raise PlanFileError(f"the plan's pipeline has {len(pipe.stage_layers)} chunks in stage_layers but "
                                f"degree {pipe.degree} x {pipe.virtual_stages} virtual stages; re-plan")
        return tuple(tuple(x) for x in pipe.stage_layers)
    if chunks == 1:
        return ((0, num_blocks),)
    from autoshard.plans.plan import even_stage_layers

    log.info("the plan gives no stage_layers: %d blocks split evenly into %d chunks", num_blocks, chunks)
    return even_stage_layers(num_blocks, chunks)


def _check_schedule(plan: Plan) -> str:
    """The torch schedule the plan's pipeline runs as, checked against its chunks and micro-batches."""
    pipe = plan.pipeline
    name = "looped-bfs" if pipe.layered else pipe.schedule
    if pipe.layered and pipe.schedule != "looped-bfs":
        log.info("layered gradient accumulation runs the looped-bfs schedule (plan says %s)", pipe.schedule)
    if pipe.virtual_stages > 1 and name not in _MULTI_CHUNK:
        raise ConfigurationError(f"schedule {name!r} runs one chunk per rank but the plan has "
                                 f"{pipe.virtual_stages} virtual stages; use interleaved-1f1b or looped-bfs")
    blocker = schedule_blocker(name, pipe.degree, plan.num_microbatches)
    if blocker:
        raise ConfigurationError(blocker)
    return name


def _chunk_shapes(chunks: list[PipelineChunk], example: torch.Tensor, micro_batch: int) -> list[tuple]:
    """(input, output) of every chunk for one micro-batch of this rank's dp slice, at full width, as meta
    tensors, from a fake-tensor run of the unparallelized chunks."""
    out = []
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        device = next(chunks[0].parameters(), example).device
        x = torch.empty((micro_batch, *example.shape[1:]), dtype=example.dtype, device=device)
        for chunk in chunks:
            y = chunk.run(x)
            out.append((torch.empty(x.shape, dtype=x.dtype, device="meta"),
                        torch.empty(y.shape, dtype=y.dtype, device="meta")))
            x = y
    return out


def _chunk_io(shapes: list[tuple], cut_shards: list[int], *, dtype: torch.dtype | None = None) -> list[tuple]:
    """(input, output) meta tensors of every chunk as the boundary hands them over: the sequence (dim 1)
    divided by `cut_shards[c]` across cut c; floating tensors in `dtype` when given (the compute dtype)."""
    io = []
    last = len(shapes) - 1
    for c, (x, y) in enumerate(shapes):
        x_in = _meta(x, grad=c > 0, seq_shards=cut_shards[c - 1] if c > 0 else 1, dtype=dtype)
        y_out = _meta(y, grad=True, seq_shards=cut_shards[c] if c < last else 1, dtype=dtype)
        io.append((x_in, y_out))
    return io


def _meta(x: torch.Tensor, *, grad: bool, seq_shards: int = 1, dtype: torch.dtype | None = None) -> torch.Tensor:
    shape = list(x.shape)
    if seq_shards > 1:
        if len(shape) < 2 or shape[1] % seq_shards:
            raise ConfigurationError(f"the plan sends hidden states of shape {tuple(shape)} between pipeline "
                                     f"stages split {seq_shards} ways along the sequence, which does not divide; "
                                     "re-plan with a sequence length divisible by the tensor-parallel degree")
        shape[1] //= seq_shards
    dtype = dtype if dtype is not None and x.dtype.is_floating_point else x.dtype
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad and x.dtype.is_floating_point)


def _chunk_specs(specs: dict[str, ModuleSpec], chunk: PipelineChunk) -> dict[str, ModuleSpec]:
    roots = chunk.module_paths()
    return {p: s for p, s in specs.items() if any(p == r or p.startswith(r + ".") for r in roots)}


def apply_pipeline_plan(model: nn.Module, plan: Plan, *, graph: OpGraph | None = None, example_inputs: tuple,
                        loss_fn: Callable | None, device_type: str = "cpu",
                        precision: Precision | None = None) -> PipelinedModule:
    """Build this rank's stages of `model` as `plan` says and the schedule that runs them (module docstring).

    `example_inputs`: one input tensor of any batch size (its other dims fix the stages' static shapes);
    `loss_fn(model_output, target) -> scalar` runs on the last stage. Call on every rank. Returns `model`
    itself, pruned to this rank's chunks, as a `PipelinedModule`. `precision` as in `apply_plan`: stages
    exchange floating tensors in its compute dtype."""
    if loss_fn is None:
        raise ConfigurationError("a pipelined plan computes the loss on the last stage: pass "
                                 "autoparallel(..., loss_fn=fn) with fn(model_output, target) -> scalar")
    example = _single_input(example_inputs)
    name = _check_schedule(plan)  # every user error before the first collective
    check_compile_plan(plan)
    check_float8_plan(plan, device_type)
    convert_float8(model, plan)  # before the model is cut (compile.py)
    family = family_of(model, example)
    stage_layers = _stage_layers(plan, len(model.get_submodule(family.blocks)))
    chunks = build_chunks(model, stage_layers, example)
    seq_axes = cut_sequence_axes(plan, stage_layers)
    specs = module_specs(plan, graph, model)  # on the whole model: tied parameters still tied
    register_dtensor_rules()
    precision = precision or precision_for_device(device_type)
    unit_dp = compute_dtype(precision) is not None  # FSDP2 casts the parameters, on one rank if need be
    full = build_pipeline_mesh(plan, device_type=device_type, unit_dp=unit_dp)  # 1
    degree, pp_rank = plan.pipeline.degree, full.get_local_rank("pp")
    local = [c for c in chunks if c.index % degree == pp_rank]  # 2
    shapes = _chunk_shapes(chunks, example, plan.micro_batch)
    send_axes = cut_send_axes(plan, seq_axes, [tuple(y.shape) for _, y in shapes[:-1]])
    io = _chunk_io(shapes, [math.prod(plan.mesh.degree(a) for a in axes) for axes in send_axes],
                   dtype=compute_dtype(precision))
    tied = untie_across_chunks(chunks, {c.index for c in local})
    mesh = _stage_mesh(full, plan, device_type, unit_dp)
    if mesh is not None and "dp" in mesh.mesh_dim_names:
        require_spmd_fsdp()  # torch 2.11: refused before the model is cut (data_parallel.py)
    _check_tied_layouts(tied, specs, chunks, mesh)
    prune_model(model, chunks[0].family, local)
    dp = full.size(full.mesh_dim_names.index("dp")) if "dp" in full.mesh_dim_names else 1
    for chunk in local:  # 3
        chunk.send_dtype = compute_dtype(precision)
        if mesh is not None:
            apply_plan_to_stage(chunk, _chunk_specs(specs, chunk), mesh, plan, precision=precision)
            c = chunk.index
            chunk.boundary = _SPMDBoundary(mesh, grad_scale=1.0 / dp if chunk.is_last else 1.0,
                                           seq_in=(seq_axes[c - 1] or ()) if c > 0 else (),
                                           seq_out=send_axes[c] if c < len(send_axes) else (),
                                           seq_recv=send_axes[c - 1] if c > 0 else ())
        else:  # a one-rank stage: plain tensors, recomputation, and FSDP2 on one rank to cast the parameters
            apply_recompute(chunk, plan, scores=materializes_scores(plan))
            compile_blocks(chunk, plan)
            if unit_dp:
                apply_plain_data_parallel(chunk, _chunk_specs(specs, chunk), full["dp"], precision=precision,
                                          whole_blocks=plan.compile)
        _gather_once_per_step(chunk)
    stages = _stages(local, io, full, device_type)  # 4
    state = PipelineState(plan=plan, mesh=full, family=chunks[0].family, chunks=local, stages=stages,
                          schedule_name=name, loss_fn=loss_fn, example_shape=tuple(example.shape[1:]),
                          tied=TiedSync.build(tied, local, full, degree))
    state.schedule = _schedule(name, stages, plan.num_microbatches, state.micro_loss)
    return _make_pipelined(model, plan, full, state)


def _check_tied_layouts(tied: list[TiedCopy], specs: dict[str, ModuleSpec], chunks: list[PipelineChunk],
                        mesh: DeviceMesh | None) -> None:
    """The copies of a tied parameter are summed shard by shard: they must be stored alike (same DTensor
    placements, same ZeRO sharding, not split)."""
    for group in tied:
        layouts = set()
        for c, path, name in group.holders:
            spec = specs.get(path)
            if spec is not None and spec.split > 1:
                raise ConfigurationError(f"tied parameter {path}.{name} is planned with operator splitting; "
                                         "plan it with split=1")
            if mesh is None:
                continue
            placed = spec is not None and name in spec.params
            storage = param_layouts(spec, chunks[c].get_submodule(path), name, mesh)[0] if placed else None
            layouts.add((str(storage), spec is not None and spec.zero > 0))
        if len(layouts) > 1:
            paths = " and ".join(f"{path}.{name}" for _, path, name in group.holders)
            raise ConfigurationError(f"{paths} are one parameter on different pipeline stages, planned with "
                                     f"different layouts {sorted(layouts)}; the pipeline runtime needs one "
                                     "(storage placement and ZeRO sharding) to sum their gradients")


def _single_input(example_inputs) -> torch.Tensor:
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor):
        raise ConfigurationError(f"a pipelined model takes one input tensor (token ids or features), got "
                                 f"{len(inputs)} inputs; attention masks are not passed between stages")
    return inputs[0]


def _stages(local: list[PipelineChunk], io: list[tuple], full: DeviceMesh, device_type: str) -> list[PipelineStage]:
    device = torch.device(device_type) if device_type == "cpu" else torch.device("cuda", torch.cuda.current_device())
    group = full.get_group("pp")
    return [PipelineStage(chunk, chunk.index, chunk.num_chunks, device, input_args=io[chunk.index][0],
                          output_args=io[chunk.index][1], group=group) for chunk in local]


def _schedule(name: str, stages: list[PipelineStage], num_microbatches: int, loss_fn: Callable):
    cls = SCHEDULES[name]
    # the loss is divided by the number of micro-batches already (PipelineState.micro_loss): no second scaling
    if name in _MULTI_CHUNK:
        return cls(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)


def _make_pipelined(model: nn.Module, plan: Plan, full: DeviceMesh, state: PipelineState) -> PipelinedModule:
    cls = type(model)
    if not issubclass(cls, PipelinedModule):
        model.__class__ = type(f"AutoShard{cls.__name__}", (PipelinedModule, cls), {})
    model._autoshard = RuntimeState(plan=plan, mesh=full, why_not_local="pipeline stages are not checked on shards")
    model._autoshard_pipeline = state
    log.info("pipelined %s: chunks %s of %d on pp rank %d, schedule %s, %d micro-batches", plan.model,
             [c.index for c in state.chunks], len(plan.pipeline.stage_layers) or 1, full.get_local_rank("pp"),
             state.schedule_name, plan.num_microbatches)
    return model
