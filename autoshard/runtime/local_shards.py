"""Local shards between planned modules: when the model's own code may run on plain tensors.

SPMD mode (parallel_module.py) runs every op of the forward on DTensors with global shapes. That is right for
any model, including those that reshape with explicit head counts, but every op of the model's own code
(rotary embeddings, attention reshapes, softmax, residual adds) pays DTensor's dispatch in Python. torchtitan
runs that code on each rank's local shards instead, with DTensors only inside the parallelized modules; that
is as fast as Megatron-style code but right only when the code is *shard-local*: it computes on a shard what
it would compute on the whole tensor, e.g. a reshape with `-1` where the head count would be.

`choose_local_shards` turns that on (`RuntimeState.local`) when both of these hold, and says why not otherwise:

1. **the plan**: every op outside the planned modules computes on the layouts its producers hand over, the
   same on each of its inputs on the gradient path and its output, without partial sums. The model's code
   then never needs a redistribution DTensor would have made (and its gradients are replicated or sharded
   exactly like its values).
2. **the code**: on the example inputs, in eval mode without gradients, the forward on local shards gives the
   same outputs as in SPMD mode, on every rank. A reshape with an explicit head count either fails on a shard
   or gives other values here (`view(B, S, heads, -1)` shrinks the head dim instead of the heads).

Nor with compiled blocks (`compiled_blocks`): Dynamo traces DTensor code into the block's graph, while the
local shards' placement tags break it. Nor with dropout: on local shards every rank would draw the same masks
for different heads or samples (the check runs in eval mode, where dropout is off); DTensor's RNG tracker draws
them per shard. An example batch
the plan's tensor-parallel batch shards do not divide into shards of at least 2 is not checked either.

On local shards a planned module call (tensor_parallel.py, `ModuleRuntime._call_local`) turns its activation
inputs into DTensors with the placements their producer recorded (or the plan's layout), and its output back
into a local shard. Modules replicated on every tensor-parallel axis (norms in Megatron-style 1D) compute on
local tensors outright. Gradients: a local value is replicated or sharded like its DTensor; a module output
that only column-parallel modules consume takes its gradient back as a partial sum, so the fan-out to q, k
and v is all-reduced once, as in SPMD mode.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from autoshard.plans.layouts import BATCH, PARTIAL, Layout
from autoshard.plans.plan import Plan
from autoshard.runtime.specs import ModuleSpec, is_call_of, producers_of, sent_layout
from autoshard.runtime.state import RuntimeState

__all__ = ["choose_local_shards", "plan_blocks_local_shards", "uneven_example", "dropout_in"]

log = logging.getLogger(__name__)

RTOL, ATOL = 1e-4, 1e-5  # fp32 ops on the same shards in another order; a wrong layout is off by O(1)


def _tp(layout: Layout) -> tuple:
    """The tensor-parallel part of a layout (dp is this rank's batch slice on local shards and in SPMD mode)."""
    return tuple((a, p) for a, p in layout.items if a != "dp")


def plan_blocks_local_shards(plan: Plan, specs: dict[str, ModuleSpec]) -> str | None:
    """Why the plan needs DTensors in the model's own code (condition 1 of the module docstring), None if
    it does not."""
    by_op = {p.op: p for p in plan.ops}
    producers = producers_of(plan)
    for p in plan.ops:
        if p.module in specs and is_call_of(p.op, p.module):
            continue  # a planned module call
        out = _tp(p.strategy.output)
        if any(pl == PARTIAL for _, pl in out):
            return f"op {p.op} leaves a partial sum"
        for src, lay in zip(producers.get(p.op, ()), p.strategy.inputs, strict=False):
            if src.startswith("input:"):
                sent = Layout()  # the model's inputs reach its code whole on the tensor-parallel axes
            elif src not in by_op or by_op[src].kind == "index":
                continue  # a constant the model makes (mask, positions): the check on example inputs sees it
            else:
                sent = sent_layout(by_op[src], specs)
            if _tp(lay) != out:
                return f"op {p.op} computes on {lay} into {p.strategy.output}"
            if _tp(sent) != _tp(lay):
                return f"op {p.op} wants {lay} but {src} hands over {sent}"
    for spec in specs.values():
        if spec.module_consumers is None and any(pl == PARTIAL for _, pl in _tp(sent_layout(by_op[spec.op], specs))):
            return f"the model's code consumes the partial sums of {spec.op}"
    return None


def compiled_blocks(plan: Plan) -> str | None:
    """Why compiled blocks keep the model's code on DTensors: Dynamo traces the DTensor ops of a block into
    one graph (their Python dispatch, which local shards avoid in eager mode, is then paid once at compile
    time), while local shards tag tensors with their placements (`setattr`), which it does not trace: the
    graph breaks around every planned module and AOTAutograd mistakes a DTensor tangent for a plain tensor
    (pytorch/pytorch#172556, met with FSDP2 x TP on torch 2.13)."""
    return "the plan compiles its blocks (Dynamo traces DTensor code whole)" if plan.compile else None


def choose_local_shards(model: nn.Module, state: RuntimeState, specs: dict[str, ModuleSpec], example_inputs: tuple) -> bool:
    """Check both conditions (module docstring) on every rank and set `state.local`; returns it. Call on every
    rank of the plan's mesh, before FSDP (the check runs two forwards on the parameters as distributed)."""
    reason = (compiled_blocks(state.plan) or plan_blocks_local_shards(state.plan, specs)
              or uneven_example(state.plan, example_inputs) or dropout_in(model))
    if reason is None:
        reason = _outputs_differ(model, state, example_inputs)
    agreed = torch.tensor([0 if reason else 1], device=state.mesh.device_type)
    for dim in range(state.mesh.ndim):  # every rank of the mesh decides the same
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=state.mesh.get_group(dim))
    state.local = bool(agreed.item())
    state.why_not_local = "" if state.local else reason or "another rank's check failed"
    if state.local:
        log.info("the model's own code runs on local shards (checked against SPMD mode on the example inputs)")
    else:
        log.info("the model's own code runs on DTensors (SPMD mode): %s", state.why_not_local)
    return state.local


# Hugging Face config fields that turn on dropout the model applies in its own code (attention probabilities)
_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "hidden_dropout", "resid_pdrop", "embd_pdrop", "dropout")


def dropout_in(model: nn.Module) -> str | None:
    """Why random masks keep the model on DTensors: on local shards every rank draws from the same generator,
    so ranks holding different heads (or different samples) would draw the same masks. DTensor's RNG tracker
    gives each shard its own."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return f"dropout p={m.p} in {name or 'the model'} (set it to 0, or accept DTensors throughout)"
    config = getattr(model, "config", None)
    for field in _DROPOUT_FIELDS:
        p = getattr(config, field, 0.0)
        if isinstance(p, (int, float)) and p > 0:
            return f"dropout {field}={p} in the model's config (set it to 0, or accept DTensors throughout)"
    return None


def uneven_example(plan: Plan, example_inputs: tuple) -> str | None:
    """Why the example inputs cannot be checked: a batch the plan's tensor-parallel batch shards do not divide
    (an uneven shard is not what training runs, and not every rank would get rows), or shards of one sample,
    which broadcast against a tensor the model's code builds for the whole batch (GPT-J's attention mask
    added to half the batch's scores under 2D ran without error on shards of 1, and failed in training)."""
    cut = max((math.prod(plan.mesh.degree(a) for a, pl in lay.items if pl == BATCH and a != "dp")
               for p in plan.ops for lay in (*p.strategy.inputs, p.strategy.output)), default=1)
    first = next((x for x in pytree.tree_leaves(example_inputs) if isinstance(x, torch.Tensor) and x.dim()), None)
    if first is not None and cut > 1 and (first.shape[0] % cut or first.shape[0] < 2 * cut):
        return (f"the example inputs' batch of {first.shape[0]} does not split into shards of at least 2 over "
                f"the {cut} ranks the plan shards the batch on; pass a multiple of {cut} of at least {2 * cut} "
                "to check")
    return None


def _outputs_differ(model: nn.Module, state: RuntimeState, example_inputs: tuple) -> str | None:
    device = torch.device(state.mesh.device_type) if state.mesh.device_type != "cpu" else None
    inputs = pytree.tree_map(lambda x: x.to(device) if device is not None and isinstance(x, torch.Tensor) else x,
                             example_inputs)
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            reference = model(*inputs)
            state.local = True
            try:
                out = model(*inputs)
            except Exception as exc:  # noqa: BLE001 - any failure of the model's code on shards means "no"
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                return f"its forward fails on local shards ({type(exc).__name__}: {first})"
            finally:
                state.local = False
    finally:
        for m, training in modes.items():
            m.training = training
    return _compare(reference, out)


def _compare(reference, out) -> str | None:
    ref_leaves, out_leaves = pytree.tree_leaves(reference), pytree.tree_leaves(out)
    if len(ref_leaves) != len(out_leaves):
        return "its outputs on local shards have another structure"
    for i, (r, o) in enumerate(zip(ref_leaves, out_leaves, strict=True)):
        if not isinstance(r, torch.Tensor):
            continue
        if not isinstance(o, torch.Tensor) or r.shape != o.shape:
            return f"output {i} has shape {tuple(getattr(o, 'shape', ()))} on local shards, {tuple(r.shape)} in SPMD mode"
        if r.is_floating_point():
            scale = max(1.0, float(r.abs().max())) if r.numel() else 1.0
            if not torch.allclose(r, o, rtol=RTOL, atol=ATOL * scale):
                return f"output {i} differs on local shards by {float((r - o).abs().max()):.2e}"
        elif not torch.equal(r, o):
            return f"output {i} differs on local shards"
    return None
