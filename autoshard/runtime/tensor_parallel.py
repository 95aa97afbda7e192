"""Tensor parallelism: parameters become DTensors, planned module calls redistribute around themselves.

Every parameter of the model becomes a DTensor on the full SPMD mesh (dp and tensor-parallel axes), stored
with its planned `storage` placement and replicated on dp (FSDP2 shards dp afterwards); parameters no op
places are replicated. Each planned leaf-module call is wrapped by a `ModuleRuntime`, which

1. redistributes its activation inputs to the planned compute layouts (plain tensors reaching a module are
   model-made constants, i.e. replicated),
2. redistributes parameters whose compute placement differs from storage (2D / 3D weights) *inside* the call,
   so autograd reduce-scatters their gradients back to the storage placement,
3. runs (1) and (2) and the module's math under a non-reentrant checkpoint when the plan keeps only the
   sharded input for backward (`save_sharded_input`: sequence parallelism, Optimus 2D), so the gathered
   input and weight are freed and gathered again in backward,
4. redistributes the output to the layout its consumers want (see `specs.py`).

When the model's own code runs on local shards (local_shards.py), the call also turns its activation inputs
into DTensors (placements recorded by the producing module on its output's shard, or the plan's layout) and
its output back into a local shard, and a module replicated on every tensor-parallel axis skips DTensor
altogether.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, distribute_tensor
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from autoshard.errors import PlanFileError
from autoshard.plans.layouts import BATCH, Layout
from autoshard.runtime.dtensor_ext import (
    SPMDMode,
    flatten_call,
    redistribute,
    settle_masked_partial,
    unflatten_call,
)
from autoshard.runtime.embedding import vocab_parallel_lookup
from autoshard.runtime.placements import activation_placements, param_placements
from autoshard.runtime.specs import ModuleSpec, param_owners

if TYPE_CHECKING:  # parallel_module imports this module
    from autoshard.runtime.state import RuntimeState

__all__ = ["distribute_parameters", "ModuleRuntime", "install_module_runtimes", "redistribute_activation",
           "param_layouts"]


def redistribute_activation(x, layout: Layout | None, mesh_names, *, output: bool = False, fused: int = 1) -> object:
    """DTensor `x` laid out as `layout` (None: as it is). Non-DTensors pass through.

    A module's *output* always goes through `dtensor_ext.redistribute`, even as a no-op, for the gradient
    placement its backward enforces: the gradients of all consumers are summed by autograd before that node,
    so a replicated output consumed by three column-parallel Linears (q, k, v) gets one all-reduce in backward,
    not three. An *input* only goes through it when the layout changes.
    """
    if not isinstance(x, DTensor):
        return x
    target = tuple(x.placements) if layout is None else activation_placements(layout, mesh_names, x, fused=fused)
    # a planned partial sum is only ever left as produced: DTensor cannot make one, and a nonlinear op handed
    # a layout with P (a norm) is given the values it needs by DTensor's own rules
    target = tuple(cur if isinstance(t, Partial) else t for t, cur in zip(target, x.placements, strict=True))
    if not output and target == tuple(x.placements):
        return x
    return redistribute(x, target)


def param_layouts(spec: ModuleSpec, module: nn.Module, local: str, mesh: DeviceMesh) -> tuple[tuple, tuple]:
    """(storage, compute) placements of parameter `local` of the module `spec` describes.

    A fused projection's bias (1-D, sharded part by part) cannot also be sharded over dp by FSDP2: the two
    strided shards of one dim compose into a layout DTensor cannot describe, and `full_tensor()` / checkpoints
    of it come out scrambled. Under ZeRO > 0 it is therefore stored plainly sharded (what the plan's S(out)
    says) and brought to the part-by-part layout for each use (3H / tp values; its gradient back likewise).
    """
    pp = spec.params[local]
    ndim = module._parameters[local].dim()
    names, degrees = mesh.mesh_dim_names, tuple(mesh.shape)
    plain_bias = ndim == 1 and spec.zero > 0 and "dp" in names
    storage = param_placements(pp.storage, names, module, local, ndim, degrees=degrees, compute=pp.compute,
                               fused=1 if plain_bias else spec.fused)
    compute = param_placements(pp.compute, names, module, local, ndim, fused=spec.fused)
    return storage, compute


def _storage_of(specs: dict[str, ModuleSpec], model: nn.Module, mesh: DeviceMesh) -> dict[int, tuple[tuple, str]]:
    """id(parameter) -> (storage placements, op that asked), checking tied uses agree."""
    storage: dict[int, tuple[tuple, str]] = {}
    for spec in specs.values():
        module = model.get_submodule(spec.path)
        for local, pp in spec.params.items():
            placements = param_layouts(spec, module, local, mesh)[0]
            prev = storage.setdefault(id(module._parameters[local]), (placements, spec.op))
            if prev[0] != placements:
                raise PlanFileError(f"parameter {pp.name} is stored as {prev[0]} by op {prev[1]} but as "
                                    f"{placements} by op {spec.op}; a tied parameter needs one storage layout")
    return storage


def distribute_parameters(model: nn.Module, specs: dict[str, ModuleSpec], mesh: DeviceMesh, *,
                          plain: set[int] = frozenset()) -> None:
    """Replace every parameter by a DTensor with its storage placement (tied parameters stay tied), except
    those whose id is in `plain` (expert weights, which the experts' forward uses on local tensors)."""
    names = mesh.mesh_dim_names
    storage = _storage_of(specs, model, mesh)
    for pid, holders in param_owners(model).items():
        param = holders[0][0]._parameters[holders[0][1]]
        if isinstance(param, DTensor) or pid in plain:
            continue
        placements = storage.get(pid, (tuple(Replicate() for _ in names), ""))[0]
        # src_data_rank=0: rank 0's values win, so ranks that initialized differently still agree
        dt = nn.Parameter(distribute_tensor(param.detach(), mesh, placements), requires_grad=param.requires_grad)
        for module, local, _ in holders:
            module._parameters[local] = dt


@contextmanager
def _swapped(module: nn.Module, tensors: dict[str, torch.Tensor]):
    """Temporarily register `tensors` (compute-placed weights) under the module's parameter names."""
    if not tensors:  # nothing to swap: no mutation for Dynamo to see (a checkpoint's side effect breaks it)
        yield
        return
    saved = {k: module._parameters[k] for k in tensors}
    module._parameters.update(tensors)
    try:
        yield
    finally:
        module._parameters.update(saved)


def _linear_with(module: nn.Module, weights: dict[str, torch.Tensor]) -> Callable | None:
    """The forward of `module` (an `nn.Linear`, or transformers' `Conv1D` of GPT-2) on compute-placed `weights`
    (2D / 3D weights, part-by-part biases) passed in rather than swapped into the module: a swap mutates the
    module inside the call's checkpoint, which Dynamo does not trace in a compiled block (a side effect inside
    a higher-order op). None for any other module, which gets the swap (`_swapped`)."""
    weight = weights.get("weight", module._parameters.get("weight"))
    bias = weights.get("bias", module._parameters.get("bias"))
    if type(module).forward is nn.Linear.forward:
        return lambda x: F.linear(x, weight, bias)
    if type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers"):
        def conv1d(x):  # transformers.pytorch_utils.Conv1D.forward, on the given weights
            y = torch.addmm(bias, x.view(-1, x.size(-1)), weight)
            return y.view(x.size()[:-1] + (module.nf,))
        return conv1d
    return None


class ModuleRuntime:
    """The forward of one planned module call (installed as the module's `forward`)."""

    def __init__(self, module: nn.Module, spec: ModuleSpec, mesh: DeviceMesh,
                 state: RuntimeState | None = None) -> None:
        self.module, self.spec, self.mesh = module, spec, mesh
        self.state = state  # the model's RuntimeState; its `local` flag selects local shards between modules
        self.names = mesh.mesh_dim_names
        self.dp_dims = tuple(n == "dp" for n in self.names)
        self.compute: Callable = functools.partial(type(module).forward, module)  # norms/splits replace it
        if isinstance(module, nn.Embedding):
            self.compute = functools.partial(vocab_parallel_lookup, module)
        self.compute_placements: dict[str, tuple[Placement, ...]] = {}
        for local in spec.params:
            storage, compute = param_layouts(spec, module, local, mesh)
            if storage != compute:
                self.compute_placements[local] = compute
        self.replicated = _replicated_on_tp(spec) and not isinstance(module, nn.Embedding)
        # set by install_module_runtimes, which sees every runtime: whether this output's gradients come back
        # as partial sums, and whether each activation input's producer takes them back so
        self.partial_grads = False
        self.input_partial: tuple[bool, ...] = ()

    def _replicated(self, x):
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            return DTensor.from_local(x, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        return x

    def __call__(self, *args, **kwargs):
        flat, tree = flatten_call(args, kwargs)
        if self.state is not None and self.state.local:
            return self._call_local(flat, tree)
        return self._call_dtensor([self._replicated(x) for x in flat], tree)

    def _call_dtensor(self, flat: list, tree):
        act_pos = [i for i, x in enumerate(flat) if isinstance(x, DTensor)][: len(self.spec.inputs)]
        weight_names = list(self.compute_placements)
        tensors = [flat[i] for i in act_pos] + [self.module._parameters[n] for n in weight_names]

        def run(*tensors):
            with SPMDMode():  # the checkpoint's recompute runs outside the model's forward
                local_flat = list(flat)
                for i, x, lay in zip(act_pos, tensors, self.spec.inputs, strict=False):
                    local_flat[i] = redistribute_activation(x, lay, self.names)
                weights = {n: redistribute(w, self.compute_placements[n])
                           for n, w in zip(weight_names, tensors[len(act_pos):], strict=True)}
                a, kw = unflatten_call(local_flat, tree)
                plain = isinstance(self.compute, functools.partial) and self.compute.func is type(self.module).forward
                direct = _linear_with(self.module, weights) if weights and plain else None
                if direct is not None:
                    return direct(*a, **kw)
                with _swapped(self.module, weights):
                    return self.compute(*a, **kw)

        out = checkpoint(run, *tensors, use_reentrant=False) if self.spec.regather else run(*tensors)
        return self._map_output(self._send, out)

    def _send(self, y):
        return redistribute_activation(settle_masked_partial(y), self.spec.output, self.names, output=True,
                                       fused=self.spec.fused)

    def _map_output(self, fn, out):
        return fn(out) if isinstance(out, torch.Tensor) else pytree.tree_map(fn, out)

    # -- local shards between planned modules (RuntimeState.local) ----------------------------------------------
    def _call_local(self, flat: list, tree):
        """The module call when the model's own code runs on local shards: its activation inputs become
        DTensors here and its output goes back to a local shard tagged with its placements. A module that is
        replicated on every tensor-parallel axis computes on local tensors outright."""
        acts = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)][: len(self.spec.inputs)]
        if self.replicated and all(_replicated_shard(flat[i], self.dp_dims) for i in acts):
            return self._call_replicated(flat, tree)
        for k, i in enumerate(acts):
            if isinstance(flat[i], DTensor):
                continue  # handed over as a DTensor by the model (another module's parameter): as it is
            layout = self.spec.arriving[k] if k < len(self.spec.arriving) else None
            partial = k < len(self.input_partial) and self.input_partial[k]
            flat[i] = from_local_shard(flat[i], self.mesh, layout, self.state.local_batch, self.dp_dims,
                                       partial_grads=partial)
        out = self._call_dtensor([self._replicated(x) for x in flat], tree)
        return self._map_output(self._to_local_shard, out)

    def _call_replicated(self, flat: list, tree):
        """Inputs, parameters and output replicated on the tensor-parallel axes: the module's own forward on
        local tensors (its parameters' local values, their gradients handed back as DTensors), then the
        output's boundary as on the DTensor path (which all-reduces partial gradients coming back)."""
        weights = {n: p.to_local(grad_placements=_local_grad_placements(p.placements, self.dp_dims))
                   for n, p in self.module._parameters.items() if isinstance(p, DTensor)}
        a, kw = unflatten_call(flat, tree)
        with _swapped(self.module, weights):
            out = self.compute(*a, **kw)

        def back(y):
            if not isinstance(y, torch.Tensor):
                return y
            y = from_local_shard(y, self.mesh, None, self.state.local_batch, self.dp_dims)
            return self._to_local_shard(self._send(y))

        return self._map_output(back, out)

    def _to_local_shard(self, y):
        return to_local_shard(y, self.dp_dims, partial_grads=self.partial_grads)


def _replicated_on_tp(spec: ModuleSpec) -> bool:
    """Every activation layout and parameter placement of the op is replicated on the tensor-parallel axes."""
    layouts = [*spec.inputs, *spec.arriving, *([spec.output] if spec.output is not None else [])]
    layouts += [p for pp in spec.params.values() for p in (pp.compute, pp.storage)]
    return not spec.regather and spec.split == 1 and all(
        a == "dp" for lay in layouts if lay is not None for a, _ in lay.items)


def install_module_runtimes(model: nn.Module, specs: dict[str, ModuleSpec], mesh: DeviceMesh,
                            state: RuntimeState | None = None) -> dict[str, ModuleRuntime]:
    runtimes = {}
    for path, spec in specs.items():
        module = model.get_submodule(path)
        runtime = ModuleRuntime(module, spec, mesh, state)
        module.forward = runtime
        runtimes[path] = runtime
    for runtime in runtimes.values():
        # on local shards, an output only modules consume may take its gradients back as partial sums (one
        # reduction at this boundary for all of them, as in SPMD mode) if each of them gives one
        users = runtime.spec.module_consumers
        runtime.partial_grads = bool(users) and all(
            u in runtimes and not runtimes[u].replicated for u in users)
    for runtime in runtimes.values():
        runtime.input_partial = tuple(src is not None and src in runtimes and runtimes[src].partial_grads
                                      for src in runtime.spec.arriving_from)
    return runtimes


# -- local shards between planned modules -------------------------------------------------------------------------
_TAG = "_autoshard_dtensor"  # (placements, grad placements, global shape, stride) of a module output's shard


def _local_grad_placements(placements, dp_dims, *, partial: bool = False) -> tuple[Placement, ...]:
    """Gradient placements of a DTensor crossing to or from the model's code on local shards.

    Tensor-parallel axes: a partial sum's gradient is replicated; a replicated tensor's is replicated, or
    partial (`partial`: every consumer is a module that hands back a partial sum, to be reduced once at the
    producer's boundary). dp: a tensor without a batch dim (replicated) gets this rank's partial gradient (a
    sum over its own samples), left partial for FSDP's one reduction."""
    out = []
    for p, dp in zip(placements, dp_dims, strict=True):
        if p.is_partial():
            out.append(Replicate())
        elif isinstance(p, Replicate) and (dp or partial):
            out.append(Partial())
        else:
            out.append(p)
    return tuple(out)


def to_local_shard(y, dp_dims, *, partial_grads: bool = False):
    """This rank's shard of module output `y`, tagged with its placements for the consuming module."""
    if not isinstance(y, DTensor):
        return y
    grads = _local_grad_placements(y.placements, dp_dims, partial=partial_grads)
    local = _ToLocal.apply(y, grads)
    setattr(local, _TAG, (tuple(y.placements), grads, y.shape, y.stride()))
    return local


class _ToLocal(torch.autograd.Function):
    """`DTensor.to_local(grad_placements=...)` returning an alias instead of a view: FSDP2 warns about views
    a module returns (an in-place op on one would skip its pre-backward hook)."""

    @staticmethod
    def forward(ctx, y: DTensor, grad_placements: tuple[Placement, ...]) -> torch.Tensor:
        ctx.mesh, ctx.grads, ctx.shape, ctx.stride = y.device_mesh, grad_placements, y.shape, y.stride()
        return y._local_tensor.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return DTensor.from_local(grad, ctx.mesh, ctx.grads, run_check=False, shape=ctx.shape,
                                  stride=ctx.stride), None


def _replicated_shard(x: torch.Tensor, dp_dims) -> bool:
    """A local tensor that is whole on the tensor-parallel axes, with replicated gradients (no tag: made by
    the model's code, whose layouts `local_shards.plan_blocks_local_shards` checked against the plan)."""
    if isinstance(x, DTensor):
        return False
    tag = getattr(x, _TAG, None)
    if tag is None:
        return True
    placements, grads = tag[0], tag[1]
    return all(dp or (isinstance(p, Replicate) and isinstance(g, Replicate))
               for p, g, dp in zip(placements, grads, dp_dims, strict=True))


def from_local_shard(x: torch.Tensor, mesh: DeviceMesh, layout: Layout | None, local_batch: int | None,
                     dp_dims, *, partial_grads: bool = False) -> DTensor:
    """DTensor of local shard `x`: as its producer module tagged it, else laid out as `layout` (None: a
    model input or constant, replicated on the tensor-parallel axes); on dp, batch-sharded when its dim 0 is
    this rank's batch. `partial_grads`: the producer takes the gradient back as a partial sum (a view of its
    output, which lost the tag, reaching a module)."""
    tag = getattr(x, _TAG, None)
    if tag is not None:
        placements, grads, shape, stride = tag
        return DTensor.from_local(x, mesh, placements, run_check=False, shape=shape, stride=stride,
                                  grad_placements=grads)
    placements = _untagged_placements(x, mesh, layout, local_batch, dp_dims)
    return DTensor.from_local(x, mesh, placements, run_check=False,
                              grad_placements=_local_grad_placements(placements, dp_dims, partial=partial_grads))


def _untagged_placements(x: torch.Tensor, mesh: DeviceMesh, layout: Layout | None, local_batch: int | None,
                         dp_dims) -> list[Placement]:
    """Placements of a local shard laid out as `layout` (None: replicated on the tensor-parallel axes; on dp,
    every local tensor is this rank's batch slice or a broadcast).

    Its dim 0 is a batch shard when it is this rank's batch (`local_batch`, the model input's) cut by the
    tensor-parallel axes the layout shards the batch on; any other size there is a broadcast dim (a position
    embedding), replicated, as `activation_placements` decides from a global shape."""
    names = mesh.mesh_dim_names
    layout = layout or Layout()
    for name, dp in zip(names, dp_dims, strict=True):
        if dp:
            layout = layout.with_(name, BATCH)
    cuts = math.prod(mesh.size(i) for i, a in enumerate(names) if layout.get(a) == BATCH and not dp_dims[i])
    is_batch = x.dim() > 0 and local_batch is not None and x.shape[0] * cuts == local_batch
    return list(activation_placements(layout, names, x, batch=is_batch))
