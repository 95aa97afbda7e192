"""`train_step`: forward, loss and backward of one global batch, with or without pipeline stages.

    pipelined      the schedule (pipeline.py) runs the micro-batches through this rank's stages; the last
                   stage computes loss_fn(output, target) / m per micro-batch; afterwards the copies of
                   parameters tied across stages get the sum of their gradients, and the loss (sum over the
                   m micro-batches = their mean) is broadcast from the last stage and averaged over dp;
    not pipelined  the ParallelModule's forward and `backward()` per micro-batch (depth-first gradient
                   accumulation; each FSDP unit reduces and re-gathers as its ZeRO level says:
                   data_parallel.set_microbatch), the loss averaged over dp.

Either way the gradients end up in this rank's parameters under their original names, summed into `.grad`
like `backward()` does, and the returned loss is a 0-dim tensor equal on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from autoshard.errors import ConfigurationError
from autoshard.plans.plan import Plan
from autoshard.runtime.compile import float8_weight_scales
from autoshard.runtime.data_parallel import set_microbatch
from autoshard.runtime.failure import distributed_phase
from autoshard.runtime.pipeline_split import ChunkFamily, PipelineChunk, TiedCopy

__all__ = ["PipelineState", "TiedSync", "train_step", "attach_loss_fn"]

log = logging.getLogger(__name__)

_GROUPS: dict[tuple, object] = {}  # (ranks, world group) -> process group of tied copies


def attach_loss_fn(model: nn.Module, loss_fn: Callable | None) -> None:
    """Remember `loss_fn(model_output, target) -> scalar` for `train_step` on a model without pipeline."""
    model._autoshard_loss_fn = loss_fn


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _group_of(ranks: tuple[int, ...]):
    key = (ranks, dist.group.WORLD)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks))
    return _GROUPS[key]


@dataclass
class TiedSync:
    """Sums the gradients of a parameter's copies (one per chunk using it) after each step.

    Only this step's contribution is exchanged (the gradient minus what `.grad` held before the step), so
    gradients accumulated over several steps are not summed twice."""

    local: list[list[tuple[PipelineChunk, str, str]]] = field(default_factory=list)  # per group: local copies
    groups: list[object | None] = field(default_factory=list)  # per group: process group across stages
    _before: list[list[torch.Tensor | None]] = field(default_factory=list)

    @classmethod
    def build(cls, tied: list[TiedCopy], chunks: list[PipelineChunk], full: DeviceMesh, degree: int) -> TiedSync:
        """Call on every rank with the same `tied` (process groups are created collectively)."""
        by_index = {c.index: c for c in chunks}
        sync = cls()
        spmd_size = full.size() // degree
        me = dist.get_rank()
        for group in tied:
            stages = sorted({c % degree for c in group.chunks()})
            pg = None
            if len(stages) > 1:
                for j in range(spmd_size):  # one group per position inside a stage, created on every rank
                    ranks = tuple(s * spmd_size + j for s in stages)
                    created = _group_of(ranks)
                    if me in ranks:
                        pg = created
            sync.local.append([(by_index[c], path, name) for c, path, name in group.holders if c in by_index])
            sync.groups.append(pg)
        return sync

    @staticmethod
    def _param(holder: tuple[PipelineChunk, str, str]) -> nn.Parameter:
        chunk, path, name = holder
        return chunk.get_submodule(path)._parameters[name]

    def before_step(self) -> None:
        self._before = [[None if self._param(h).grad is None else _local(self._param(h).grad).clone()
                         for h in holders] for holders in self.local]

    @torch.no_grad()
    def after_step(self) -> None:
        for holders, pg, before in zip(self.local, self.groups, self._before, strict=True):
            if not holders:
                continue
            params = [self._param(h) for h in holders]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            deltas = [_local(p.grad) - (b if b is not None else 0) for p, b in zip(params, before, strict=True)]
            total = torch.stack(deltas).sum(0)
            if pg is not None:
                dist.all_reduce(total, group=pg)
            for p, b in zip(params, before, strict=True):
                _local(p.grad).copy_(total if b is None else b + total)


@dataclass
class PipelineState:
    """What `train_step` needs of a pipelined model (built by pipeline.apply_pipeline_plan)."""

    plan: Plan
    mesh: DeviceMesh  # the full mesh, pp outermost
    family: ChunkFamily
    chunks: list[PipelineChunk]
    stages: list
    schedule_name: str
    loss_fn: Callable
    example_shape: tuple[int, ...]  # one sample's input shape (the stages' static shapes depend on it)
    tied: TiedSync
    schedule: object = None

    def micro_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The user's loss of one micro-batch, as a term of the mean over the micro-batches."""
        out = self.family.wrap_output(output)
        return self.loss_fn(out, target) / self.plan.num_microbatches


def _dp_mean(loss: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    names = mesh.mesh_dim_names or ()
    if "dp" in names and mesh.size(names.index("dp")) > 1:
        dist.all_reduce(loss, group=mesh.get_group("dp"))
        loss /= mesh.size(names.index("dp"))
    return loss


def _check_batch(x: torch.Tensor, state: PipelineState) -> None:
    plan = state.plan
    rows = plan.num_microbatches * plan.micro_batch
    if x.shape[0] != rows or tuple(x.shape[1:]) != state.example_shape:
        raise ConfigurationError(f"this rank's inputs have shape {tuple(x.shape)}; the pipeline was built for "
                                 f"{plan.num_microbatches} micro-batches of {plan.micro_batch} samples of "
                                 f"shape {state.example_shape}, i.e. {(rows, *state.example_shape)}: pass "
                                 "pm.shard_inputs(global batch) of the plan's global batch and sequence length")


def _pipeline_step(state: PipelineState, inputs: tuple, target: torch.Tensor) -> torch.Tensor:
    if len(inputs) != 1:
        raise ConfigurationError(f"a pipelined model takes one input tensor, got {len(inputs)}")
    (x,) = inputs
    _check_batch(x, state)
    state.tied.before_step()
    losses: list[torch.Tensor] = []
    state.schedule.step(x, target=target, losses=losses, return_outputs=False)
    state.tied.after_step()
    loss = torch.stack([t.detach().float() for t in losses]).sum() if losses else \
        torch.zeros((), dtype=torch.float32, device=state.mesh.device_type)  # NCCL reduces device tensors only
    degree = state.mesh.size(0)
    if degree > 1:  # the last stage holds the loss
        dist.broadcast(loss, group=state.mesh.get_group("pp"), group_src=degree - 1)
    return _dp_mean(loss, state.mesh)


def _split(x, n: int) -> list:
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return [x] * n
    if x.shape[0] % n:
        raise ConfigurationError(f"a batch of {x.shape[0]} rows does not split into {n} micro-batches; pass "
                                 f"a multiple of {n} rows per data-parallel rank")
    return list(x.chunk(n))


def _spmd_step(model: nn.Module, inputs: tuple, target: torch.Tensor) -> torch.Tensor:
    loss_fn = getattr(model, "_autoshard_loss_fn", None)
    if loss_fn is None:
        raise ConfigurationError("train_step needs a loss: pass autoparallel(..., loss_fn=fn) with "
                                 "fn(model_output, target) -> scalar")
    n = model.plan.num_microbatches
    pieces = [_split(x, n) for x in inputs]
    targets = _split(target, n)
    fsdp = isinstance(model, FSDPModule) and n > 1
    total = torch.zeros((), dtype=torch.float32, device=model.mesh.device_type)  # the ranks' device, not the default
    for i in range(n):
        if fsdp:
            set_microbatch(model, last=i == n - 1)
        loss = loss_fn(model(*(p[i] for p in pieces)), targets[i]) / n
        loss.backward()
        total += loss.detach().float()
    return _dp_mean(total, model.mesh)


def train_step(model: nn.Module, inputs, target: torch.Tensor) -> torch.Tensor:
    """Forward, loss and backward of this rank's slice of one global batch; the mean loss on every rank.

    `inputs` is a tuple of model inputs (this rank's dp slice, from `model.shard_inputs`), `target` what the
    loss function takes as its second argument, sliced the same way."""
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    state = getattr(model, "_autoshard_pipeline", None)
    # a failure on one rank names it on every rank; float8 weights gathered with scales computed once per step
    with distributed_phase("train_step"), float8_weight_scales(model):
        if state is None:
            return _spmd_step(model, inputs, target)
        return _pipeline_step(state, inputs, target)
