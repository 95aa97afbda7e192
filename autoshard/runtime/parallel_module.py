"""The model a user gets back: same object, same parameter names, a forward that speaks local tensors.

`apply_plan` puts `ParallelModule` in front of the model's class (as FSDP2 does with `FSDPModule`), so the
module keeps its identity, attributes and parameter FQNs. Its forward

- takes this rank's data-parallel slice as ordinary tensors (`shard_inputs` cuts it from a global batch) and
  makes them DTensors on the plan's mesh: batch-sharded on dp, replicated on the tensor-parallel axes;
- runs the original forward under `SPMDMode` (see dtensor_ext.py), so every op of the model works on
  DTensors with global shapes: models that reshape with explicit head counts and with -1 both work;
  or, when the plan and a check on the example inputs allow it (`local`, local_shards.py), runs the model's
  own code on plain local shards with DTensors only inside the planned modules, as torchtitan does;
- returns ordinary tensors for this rank's batch slice with full feature dims (logits over the whole
  vocabulary), gathered from the tensor-parallel axes, so the loss is computed as usual.

A plan without tensor-parallel axes (data parallel and ZeRO only) needs none of that: its forward is the
model's own on ordinary tensors, with FSDP2 around its blocks as torchtitan applies it (`spmd=False`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils import _pytree as pytree

from autoshard.capture.export import training_outputs
from autoshard.errors import ConfigurationError
from autoshard.plans.plan import Plan
from autoshard.runtime.context_parallel import head_tail_positions, shard_sequence
from autoshard.runtime.dtensor_ext import SPMDMode
from autoshard.runtime.state import RuntimeState
from autoshard.runtime.tensor_parallel import from_local_shard

__all__ = ["ParallelModule", "make_parallel"]


class ParallelModule:
    """Mixin in front of the model's class; see the module docstring."""

    _autoshard: RuntimeState

    @property
    def plan(self) -> Plan:
        return self._autoshard.plan

    @property
    def mesh(self) -> DeviceMesh:
        return self._autoshard.mesh

    @property
    def execution(self) -> str:
        """How the model's own code runs between the planned modules, for logs."""
        state = self._autoshard
        if not state.spmd:
            return "plain tensors (no tensor-parallel axis)"
        if state.local:
            return "local shards, DTensors inside the planned modules"
        return f"DTensors throughout (SPMD mode): {state.why_not_local}"

    def shard_inputs(self, global_inputs) -> tuple:
        """This rank's part of a global batch: the dp slice of dim 0 of every tensor (others unchanged); with
        context parallelism also this rank's tokens along dim 1 of every tensor of two or more dims (head-tail
        chunks, runtime/context_parallel.py), targets included."""
        inputs = global_inputs if isinstance(global_inputs, tuple) else (global_inputs,)
        state = self._autoshard
        dp = state.dp_degree // state.cp  # data-parallel replicas; with context parallelism, cp ranks each
        if state.dp_degree == 1:
            return inputs
        rank = state.mesh.get_local_rank("dp") // state.cp

        def cut(x):
            if not isinstance(x, torch.Tensor) or x.dim() == 0:
                return x
            if x.shape[0] % dp:
                raise ConfigurationError(f"a global batch of {x.shape[0]} does not split over dp={dp} ranks; "
                                         f"use a multiple of {dp}")
            x = x.chunk(dp)[rank]
            if state.cp > 1 and x.dim() > 1:  # this cp rank's tokens (sequence dim 1) of inputs and targets
                x = shard_sequence(x, state.cp, state.cp_rank)
            return x

        return tuple(pytree.tree_map(cut, x) for x in inputs)

    def train_step(self, inputs, target: torch.Tensor) -> torch.Tensor:
        """Forward, loss and backward of this rank's slice of one global batch (`shard_inputs` of it), in the
        plan's micro-batches, with the `loss_fn(output, target)` given to `autoparallel`; returns the global
        batch's mean loss on every rank. Pipelined plans train only this way; the optimizer step is the
        caller's."""
        from autoshard.runtime.pipeline_train import train_step

        return train_step(self, inputs, target)

    def forward(self, *args, **kwargs):
        state = self._autoshard
        # no key/value cache: it would hold DTensors between steps, and a recomputed block (activation
        # checkpointing) would append its keys and values to it a second time
        with training_outputs(self):
            if state.cp > 1 and "position_ids" not in kwargs and args and isinstance(args[0], torch.Tensor):
                ids = args[0]  # this rank's tokens (shard_inputs): where they sit in the whole sequence
                pos = head_tail_positions(ids.shape[1] * state.cp, state.cp, state.cp_rank, device=ids.device)
                kwargs = {**kwargs, "position_ids": pos.unsqueeze(0).expand(ids.shape[0], -1)}
            if not state.spmd:  # data parallel only: FSDP2 on ordinary tensors, inputs and outputs as they are
                return super().forward(*args, **kwargs)  # type: ignore[misc]
            return self._spmd_forward(state, args, kwargs)

    def _spmd_forward(self, state, args, kwargs):
        if state.local:
            first = next((x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)), None)
            state.local_batch = first.shape[0] if first is not None and first.dim() > 0 else None
            out = super().forward(*args, **kwargs)  # type: ignore[misc]
            return pytree.tree_map(lambda y: _local_output(y, state), out)
        with SPMDMode():
            args, kwargs = pytree.tree_map(lambda x: _to_dtensor(x, state), (args, kwargs))
            out = super().forward(*args, **kwargs)  # type: ignore[misc]
            return pytree.tree_map(lambda y: _to_local(y, state), out)


def _to_dtensor(x, state: RuntimeState):
    if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
        return x
    return DTensor.from_local(x, state.mesh, state.input_placements(x), run_check=False)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.detach()  # an alias, not a view: FSDP2 warns about views a module returns

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def _to_local(y, state: RuntimeState):
    """This rank's slice of output `y`, replicated over the tensor-parallel axes.

    A loss computed on the slice is one dp rank's term of the global loss, which is their *mean*: its gradient
    is scaled by 1/dp here, so every gradient in the model is exact in DTensor's global sense and the dp
    reduction sums (data_parallel.py sets FSDP's divide factor to 1). Averaging at the reduction instead
    would be wrong wherever DTensor reduces a dp-partial gradient earlier itself (an embedding without a
    batch dim, whose gradient is summed over the batch).
    """
    if not isinstance(y, DTensor):
        return y
    target = state.output_placements(y)
    if tuple(y.placements) != tuple(target):
        y = y.redistribute(y.device_mesh, target)
    local = y.to_local()
    batch_sharded = state.dp_degree > 1 and Shard(0) in [p for n, p in zip(state.mesh.mesh_dim_names, target,
                                                                           strict=True) if n == "dp"]
    factor = 1.0 / state.dp_degree if batch_sharded else 1.0
    if not local.requires_grad or state.dp_degree == 1:
        return local  # nothing to scale, and no FSDP to warn about a returned view
    return _ScaleGrad.apply(local, factor)


def _local_output(y, state: RuntimeState):
    """A model output in local mode: a module's shard goes the way of `_to_local`; a tensor the model's own code
    made is this rank's already (its 1/dp gradient scale applied)."""
    if not isinstance(y, torch.Tensor):
        return y
    dp_dims = tuple(n == "dp" for n in state.mesh.mesh_dim_names)
    return _to_local(from_local_shard(y, state.mesh, None, state.local_batch, dp_dims), state)


def make_parallel(model: nn.Module, state: RuntimeState) -> nn.Module:
    """Put `ParallelModule` in front of `model`'s class, in place; returns the same object."""
    cls = type(model)
    if not issubclass(cls, ParallelModule):
        model.__class__ = type(f"AutoShard{cls.__name__}", (ParallelModule, cls), {})
    model._autoshard = state
    return model
