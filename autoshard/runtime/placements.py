"""Semantic layouts on named axes -> DTensor placements in mesh order. The only place that does this.

A plan speaks of `S(batch)`, `S(seq)`, `S(feat)` for activations and `S(out)`, `S(in)` for parameters
(`autoshard.plans.layouts`); DTensor wants one `Shard(dim)` / `Replicate()` / `Partial()` per mesh dim, in the
mesh's order. The tensor dim behind a semantic name depends on the tensor:

    activations   (B, H) float: batch 0, feat 1          (B, S) integer ids: batch 0, seq 1
                  (B, S, H): batch 0, seq 1, feat 2      (B, nh, S, hd): batch 0, feat = heads 1, seq 2
    parameters    nn.Linear / nn.ConvNd weight (out, in, ...): out 0, in 1
                  HF Conv1D weight (in, out): out 1, in 0
                  nn.Embedding weight (vocab, h): in = vocab 0 (vocabulary-parallel), out 1
                  1-D parameters (biases, norm weights): out 0

A batch dim of size 1 is a broadcast dim (a position embedding, a shared mask), never a batch: `S(batch)` on
it is replicated instead of sharded unevenly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autoshard.plans.layouts import BATCH, FEAT, IN, OUT, PARTIAL, REPLICATE, SEQ, Layout

__all__ = ["activation_placements", "param_placements", "activation_dim", "param_dim", "replicated"]


def replicated(mesh_names: Sequence[str]) -> tuple[Placement, ...]:
    return tuple(Replicate() for _ in mesh_names)


def activation_dim(placement: str, shape: Sequence[int], *, is_index: bool = False) -> int | None:
    """Tensor dim of `placement` (S(batch) / S(seq) / S(feat)) in an activation of `shape`, None if the
    tensor has no such dim. `is_index` marks integer token ids (B, S), whose dim 1 is the sequence."""
    ndim = len(shape)
    if ndim == 0:
        return None
    if placement == BATCH:
        return 0 if shape[0] != 1 else None
    if placement == SEQ:
        if ndim == 2:
            return 1 if is_index else None
        return {3: 1, 4: 2}.get(ndim)
    if placement == FEAT:
        if ndim == 2:
            return None if is_index else 1
        return 1 if ndim == 4 else ndim - 1
    raise ValueError(f"{placement!r} is not an activation shard placement; allowed: {BATCH}, {SEQ}, {FEAT}")


def activation_placements(layout: Layout, mesh_names: Sequence[str], tensor: torch.Tensor, *,
                          fused: int = 1, batch: bool | None = None) -> tuple[Placement, ...]:
    """Placements of activation `tensor` (global shape) laid out as `layout` on a mesh with `mesh_names`.

    `fused` > 1 marks the output of a fused projection (GPT-2's c_attn: q, k and v side by side in the
    feature dim): `S(feat)` then shards each of the `fused` parts, so every rank holds [q_r, k_r, v_r]
    (`_StridedShard`, Megatron-LM's layout of a fused QKV weight) and splitting it costs nothing.
    `batch`: whether dim 0 is a batch dim, for a local shard (whose size 1 there may be a batch slice); by
    default it is unless its size is 1 (a broadcast dim of a global shape).
    """
    out: list[Placement] = []
    is_index = not (tensor.is_floating_point() or tensor.is_complex())
    for axis in mesh_names:
        pl = layout.get(axis)
        if pl == REPLICATE:
            out.append(Replicate())
        elif pl == PARTIAL:
            out.append(Partial())
        else:
            if pl == BATCH and batch is not None:
                dim = 0 if batch and tensor.dim() > 0 else None
            else:
                dim = activation_dim(pl, tensor.shape, is_index=is_index)
            if dim is None:
                out.append(Replicate())
            elif pl == FEAT and fused > 1:
                out.append(_StridedShard(dim, split_factor=fused))
            else:
                out.append(Shard(dim))
    return tuple(out)


def param_dim(placement: str, module: nn.Module, param_name: str, ndim: int) -> int:
    """Tensor dim of `S(out)` / `S(in)` for parameter `param_name` (local name, e.g. 'weight') of `module`."""
    if placement not in (OUT, IN):
        raise ValueError(f"parameter placement must be R, {OUT} or {IN}, got {placement!r} for {param_name}")
    if ndim == 1:
        if placement == IN:
            raise ValueError(f"1-D parameter {param_name} of {type(module).__name__} has no input dim; "
                             f"a row-parallel bias is replicated (R), not {IN}")
        return 0
    kind = type(module).__name__
    if isinstance(module, nn.Embedding):
        return 0 if placement == IN else 1
    if kind == "Conv1D":  # transformers.pytorch_utils.Conv1D stores (in, out)
        return 0 if placement == IN else 1
    return 0 if placement == OUT else 1


def param_placements(layout: Layout, mesh_names: Sequence[str], module: nn.Module, param_name: str, ndim: int,
                     *, degrees: Sequence[int] | None = None, compute: Layout | None = None,
                     fused: int = 1) -> tuple[Placement, ...]:
    """Placements of parameter `param_name` of `module` laid out as `layout`; the dp axis is replicated here
    (FSDP2 shards it afterwards from the op's `zero` level). `fused` > 1: `S(out)` shards each of the `fused`
    parts of the output features (see `activation_placements`).

    For a storage layout, pass the `compute` layout and the mesh `degrees`: an axis that shards a dim only
    for storage (all-gathered before use, e.g. tp_x of a 3D weight stored x:S(out), y:S(out)) is made the
    *inner* shard of that dim (`_StridedShard`, as FSDP2 does on dp), so gathering it is one all-gather of
    1/q of the weight and its gradient one reduce-scatter. With DTensor's default outer-to-inner order,
    dropping the outer axis takes two all-gathers and an all-gather plus a reduce-scatter in backward.
    """
    out: list[Placement] = []
    for i, axis in enumerate(mesh_names):
        pl = layout.get(axis)
        if axis == "dp" or pl == REPLICATE:
            out.append(Replicate())
            continue
        dim = param_dim(pl, module, param_name, ndim)
        split = 1
        if compute is not None and degrees is not None and compute.get(axis) != pl:
            for j in range(i + 1, len(mesh_names)):
                later = layout.get(mesh_names[j])
                if later in (OUT, IN) and param_dim(later, module, param_name, ndim) == dim \
                        and compute.get(mesh_names[j]) == later:
                    split *= degrees[j]
        if pl == OUT and fused > 1:
            split *= fused
        out.append(_StridedShard(dim, split_factor=split) if split > 1 else Shard(dim))
    return tuple(out)
