"""Compiled blocks and float8 Linears, as torchtitan applies them.

Compile (`Plan.compile`): every repeated block is `torch.compile`d on its own, in place (`nn.Module.compile`,
so parameter names and module paths stay as they were), after tensor parallelism and activation checkpointing
and before FSDP2 (torchtitan's `apply_compile` between `apply_ac` and `apply_fsdp`): the block's forward and
backward become Inductor graphs with fused pointwise kernels, FSDP2's hooks stay outside them. Graph breaks are
allowed (a model's own code may have some); each is a second graph of its own, not an error.

On DTensors (tensor-parallel axes, pipeline stages of several ranks) Dynamo traces the runtime's own tensor-
parallel code into the block's graph: the redistributions around each planned module, the checkpoint that
regathers a sequence-parallel input, DTensor's dispatch (the model's code stays on DTensors: local_shards.py
`compiled_blocks`); a block whose parameters share one zero level is one FSDP unit on the block module itself
(data_parallel.py `_as_block`), so that FSDP2's hooks sit at the graph's edge. `check_compile_plan` refuses what
still breaks a block's graph there.

Float8 (`Plan.float8`): torchao's `convert_to_float8_training` swaps the Linears inside the repeated blocks for
`Float8Linear`s before anything else is applied (torchtitan's model converters run before `parallelize`); the
head stays in 16 bits (torchtitan's `filter_fqns = ["output"]`), and so does any Linear whose dims are not
multiples of 16. Tensorwise scaling gathers the weights in float8 under FSDP2
(`enable_fsdp_float8_all_gather`), and `train_step` computes every such weight's scale once per step, with one
all-reduce, before its first gather (`float8_weight_scales`: torchao's `precompute_float8_dynamic_scale_for_fsdp`,
which torchtitan runs after each optimizer step), instead of an amax pass and an all-reduce per weight in every
gather. The cost model prices the same conversion (cost_models/float8.py `float8_linear`). torchao is an optional
dependency (`pip install torchao`), needed only by float8 plans.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from torch import nn

from autoshard.cost_models.float8 import FLOAT8_ALIGN
from autoshard.errors import ConfigurationError
from autoshard.plans.plan import Plan
from autoshard.runtime.recompute import block_paths

__all__ = ["compile_blocks", "convert_float8", "check_float8_plan", "check_compile_plan", "float8_weight_scales"]

log = logging.getLogger(__name__)


def compile_blocks(model: nn.Module, plan: Plan) -> int:
    """`torch.compile` every repeated block of `model` in place when the plan says so; returns how many."""
    if not plan.compile:
        return 0
    paths = block_paths(plan, model)
    for path in paths:
        model.get_submodule(path).compile()
    log.info("compiled %d blocks", len(paths))
    return len(paths)


def check_compile_plan(plan: Plan) -> None:
    """Refuse, before the model is touched, compiled blocks the runtime cannot run, naming why and the fix.

    Compiled blocks compose with data parallelism, ZeRO, operator splitting, pipelines, recompute, context and
    expert parallelism on plain tensors, and with 1D / 2D / 3D tensor and sequence parallelism (with ZeRO and
    pipelines) on DTensors (tests/distributed). On DTensors a graph break inside a block is fatal where the
    graph before it returns a view of a DTensor input: AOTAutograd regenerates such an output with
    `as_strided` (a DTensor output carries no view-replay record), which DTensor does not implement
    (torch 2.13). The runtime's own tensor-parallel code traces whole (no break), and a block's FSDP2 hooks sit
    at its edge when the block is one FSDP unit (data_parallel.py `_as_block`); what still breaks, refused:

    - a block of several FSDP units (ops of one block at different zero levels, or split ops): FSDP2's hooks,
      `torch._dynamo.disable`d, break the graph at every unit inside the block;
    - context parallelism (its attention's dispatch mode returns non-tensors Dynamo does not trace) and expert
      parallelism (the experts are FSDP units of their own inside each block) with tensor-parallel axes."""
    if not plan.compile or not plan.mesh.on_dtensors:
        return
    axes = ", ".join(plan.mesh.tp_axes)
    for what, degree in (("context", plan.mesh.degree("cp")), ("expert", plan.ep)):
        if degree > 1 and axes:
            raise ConfigurationError(
                f"the plan compiles its blocks with {what} parallelism and tensor-parallel axes {axes}, which "
                "break each block's graph where DTensor cannot regenerate a view (as_strided); re-plan with "
                "--compile off, or without tensor parallelism", params=("compile",))
    units: dict[int, set] = {}
    for op in plan.ops:
        if op.layer is not None and op.strategy.params:
            units.setdefault(op.layer, set()).add((op.strategy.zero, op.strategy.split > 1))
    mixed = sorted(layer for layer, found in units.items() if len(found) > 1 or any(split for _, split in found))
    if mixed:
        where = f"tensor-parallel axes {axes}" if axes else "pipeline stages of more than one rank"
        raise ConfigurationError(
            f"the plan compiles its blocks on DTensors ({where}), but block {mixed[0]} mixes zero levels or splits "
            "ops, so FSDP2's hooks inside it break its graph where DTensor cannot regenerate a "
            "view (as_strided); re-plan (autoshard plan keeps each compiled block one FSDP unit) or with "
            "--compile off", params=("compile",))


def check_float8_plan(plan: Plan, device_type: str) -> None:
    """Refuse, before the model is touched, a float8 plan this runtime cannot run, naming why and the fix."""
    if not plan.float8:
        return
    if plan.mesh.tp_axes:
        raise ConfigurationError(
            f"the plan trains in float8 with tensor-parallel axes {', '.join(plan.mesh.tp_axes)}: autoshard's runtime "
            "runs float8 with data parallelism, ZeRO and pipelines only; re-plan with --float8 none or without "
            "tensor parallelism", params=("float8",))
    if plan.ep > 1:
        raise ConfigurationError("the plan trains in float8 with expert parallelism, which autoshard's runtime does "
                                 "not run; re-plan without --float8", params=("float8",))
    if device_type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        name = torch.cuda.get_device_name()
        raise ConfigurationError(f"the plan trains in float8, which {name} has no tensor cores for (compute "
                                 "capability 8.9 or newer: H100, H200); re-plan without --float8",
                                 params=("float8",))
    _torchao_float8()


def _torchao_float8():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise ConfigurationError(f"the plan trains in float8, which needs torchao ({exc}); `pip install torchao`, "
                                 "or re-plan without --float8", params=("float8",)) from exc
    return Float8LinearConfig, convert_to_float8_training


def convert_float8(model: nn.Module, plan: Plan) -> int:
    """Swap the block Linears of `model` for torchao's Float8Linear as `plan.float8` says; returns how many."""
    if not plan.float8:
        return 0
    config_cls, convert = _torchao_float8()
    if plan.float8 == "tensorwise":
        config = config_cls(enable_fsdp_float8_all_gather=True)
    else:
        config = config_cls.from_recipe_name(plan.float8)
    prefixes = tuple(f"{p}." for p in block_paths(plan, model))
    converted = []

    def in_blocks(module: nn.Module, fqn: str) -> bool:
        ok = isinstance(module, nn.Linear) and fqn.startswith(prefixes) and \
            module.in_features % FLOAT8_ALIGN == 0 and module.out_features % FLOAT8_ALIGN == 0
        if ok:
            converted.append(fqn)
        return ok

    convert(model, config=config, module_filter_fn=in_blocks)
    log.info("float8 (%s): %d Linears", plan.float8, len(converted))
    return len(converted)


@contextmanager
def float8_weight_scales(model: nn.Module):
    """Within the block, FSDP2 gathers each tensorwise float8 weight with a scale computed on entry for all of
    them (torchao's `precompute_float8_dynamic_scale_for_fsdp`: one inf-norm pass over the shards, one
    all-reduce) instead of an amax pass and an all-reduce of its own per gather; on exit the scales are dropped,
    so a gather after the optimizer's next step computes its own again. A no-op for other models."""
    weights = _float8_gathered_weights(model)
    if not weights:
        yield
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
    try:
        yield
    finally:
        for w in weights:
            w._precomputed_scale = None


def _float8_gathered_weights(model: nn.Module) -> list:
    """The local shards of the weights FSDP2 gathers in float8 (torchao's `WeightWithDynamicFloat8CastTensor`)."""
    from torch.distributed.tensor import DTensor

    found = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        local = weight._local_tensor if isinstance(weight, DTensor) else None
        if local is not None and type(local).__name__ == "WeightWithDynamicFloat8CastTensor":
            found.append(local)
    return found
