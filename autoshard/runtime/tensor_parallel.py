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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, distribute_tensor
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from autoshard.errors import PlanFileError
from autoshard.planner.layouts import Layout
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


def distribute_parameters(model: nn.Module, specs: dict[str, ModuleSpec], mesh: DeviceMesh) -> None:
    """Replace every parameter by a DTensor with its storage placement (tied parameters stay tied)."""
    names = mesh.mesh_dim_names
    storage = _storage_of(specs, model, mesh)
    for pid, holders in param_owners(model).items():
        param = holders[0][0]._parameters[holders[0][1]]
        if isinstance(param, DTensor):
            continue
        placements = storage.get(pid, (tuple(Replicate() for _ in names), ""))[0]
        # src_data_rank=0: rank 0's values win, so ranks that initialized differently still agree
        dt = nn.Parameter(distribute_tensor(param.detach(), mesh, placements), requires_grad=param.requires_grad)
        for module, local, _ in holders:
            module._parameters[local] = dt


@contextmanager
def _swapped(module: nn.Module, tensors: dict[str, torch.Tensor]):
    """Temporarily register `tensors` (compute-placed weights) under the module's parameter names."""
    saved = {k: module._parameters[k] for k in tensors}
    module._parameters.update(tensors)
    try:
        yield
    finally:
        module._parameters.update(saved)


class ModuleRuntime:
    """The forward of one planned module call (installed as the module's `forward`)."""

    def __init__(self, module: nn.Module, spec: ModuleSpec, mesh: DeviceMesh) -> None:
        self.module, self.spec, self.mesh = module, spec, mesh
        self.names = mesh.mesh_dim_names
        self.compute: Callable = functools.partial(type(module).forward, module)  # norms/splits replace it
        if isinstance(module, nn.Embedding):
            self.compute = functools.partial(vocab_parallel_lookup, module)
        self.compute_placements: dict[str, tuple[Placement, ...]] = {}
        for local in spec.params:
            storage, compute = param_layouts(spec, module, local, mesh)
            if storage != compute:
                self.compute_placements[local] = compute

    def _replicated(self, x):
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            return DTensor.from_local(x, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        return x

    def __call__(self, *args, **kwargs):
        flat, tree = flatten_call(args, kwargs)
        flat = [self._replicated(x) for x in flat]
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
                with _swapped(self.module, weights):
                    return self.compute(*a, **kw)

        out = checkpoint(run, *tensors, use_reentrant=False) if self.spec.regather else run(*tensors)

        def send(y):
            return redistribute_activation(settle_masked_partial(y), self.spec.output, self.names, output=True,
                                           fused=self.spec.fused)

        return send(out) if isinstance(out, torch.Tensor) else pytree.tree_map(send, out)


def install_module_runtimes(model: nn.Module, specs: dict[str, ModuleSpec], mesh: DeviceMesh) -> dict[str, ModuleRuntime]:
    runtimes = {}
    for path, spec in specs.items():
        module = model.get_submodule(path)
        runtime = ModuleRuntime(module, spec, mesh)
        module.forward = runtime
        runtimes[path] = runtime
    return runtimes
