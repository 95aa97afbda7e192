"""Vocabulary-parallel embedding lookups (Megatron-LM's VocabParallelEmbedding, Shoeybi et al. 2019 §3).

When a plan shards an embedding's vocabulary dim (`S(in)` on one or more tensor-parallel axes: the "vocab",
"2d" and "3d-*" lookups), every rank looks up the tokens that fall in its slice of rows, zeroes the others,
and the output is a partial sum over those axes, reduced where the consumers want it. DTensor's own rule
(`_MaskPartial`) covers one vocabulary axis only (two axes share one mask buffer and collide), applies its mask
at the reduction and then forgets it, so an output reduced twice fails; this lookup has neither limit. The
backward is local: the replicated output gradient gives this rank's rows their gradient, no communication.

Other placements follow the tensors: a hidden dim sharded on an axis (`S(out)`) shards the output's features
there, token ids sharded on an axis (`S(batch)`) shard the output's batch; the weight's gradient is a partial
sum on axes that shard the tokens but not the weight (FSDP or the storage redistribution reduces it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.overrides import TorchFunctionMode

__all__ = ["shards_vocabulary", "vocab_parallel_lookup"]


def shards_vocabulary(weight: torch.Tensor) -> bool:
    """Is this embedding weight (vocab, hidden) sharded on its vocabulary dim on some mesh axis?"""
    return isinstance(weight, DTensor) and any(p.is_shard(0) for p in weight.placements)


def _output_placements(ids: DTensor, weight: DTensor) -> list[Placement]:
    out: list[Placement] = []
    for ip, wp in zip(ids.placements, weight.placements, strict=True):
        if wp.is_shard(0):
            out.append(Partial())  # rows of other ranks' tokens are zero here
        elif wp.is_shard(1):
            out.append(Shard(ids.ndim))  # hidden features
        else:
            out.append(ip)  # the token ids' own sharding (batch), or replicated
    return out


def _weight_grad_placements(ids: DTensor, weight: DTensor) -> list[Placement]:
    """Partial where the tokens (or, on dp, the samples that use them) are spread over ranks that hold the
    same rows: each rank's gradient is its own tokens' share."""
    dp_dims = _dp_dims(weight)
    return [Partial() if isinstance(wp, Replicate) and (isinstance(ip, Shard) or dp) else wp
            for ip, wp, dp in zip(ids.placements, weight.placements, dp_dims, strict=True)]


def _dp_dims(x: DTensor) -> tuple[bool, ...]:
    return tuple(n == "dp" for n in (x.device_mesh.mesh_dim_names or ()))


def _replicated_on_dp(ids: DTensor) -> bool:
    """The same ids on every dp rank (positions): DTensor's rule would give every dp rank the whole batch's
    weight gradient, which the dp reduction then sums a second time."""
    if ids.ndim == 0 or ids.shape[0] == 1:  # (1, S) positions broadcast over the batch: DTensor's rule is right
        return False
    return any(d and isinstance(p, Replicate) for d, p in zip(_dp_dims(ids), ids.placements, strict=True))


class _FromLocal(torch.autograd.Function):
    """`DTensor.from_local` whose backward leaves the dp dim's gradient partial where the output is replicated
    on dp (position ids: every dp rank looks up the same rows, and each rank's gradient is its own samples'
    share). `DTensor.from_local` would all-reduce it there, and FSDP would then sum it over dp a second time."""

    @staticmethod
    def forward(ctx, local, mesh, placements, shape, stride):
        ctx.placements = placements
        ctx.dp_dims = tuple(n == "dp" for n in (mesh.mesh_dim_names or ()))
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    @staticmethod
    def backward(ctx, grad):
        mesh = grad.device_mesh
        keep = [dp and isinstance(p, Replicate) for p, dp in zip(ctx.placements, ctx.dp_dims, strict=True)]
        # a partial output (rows of other ranks' tokens) takes its gradient whole: every rank's rows need it
        want = [g if k and (g.is_partial() or isinstance(g, Replicate)) else Replicate() if p.is_partial() else p
                for p, g, k in zip(ctx.placements, grad.placements, keep, strict=True)]
        if list(grad.placements) != want:
            grad = grad.redistribute(mesh, want)
        local = grad.to_local()
        for dim, (k, g) in enumerate(zip(keep, want, strict=True)):
            if k and isinstance(g, Replicate):  # the same gradient on every dp rank: as a sum, each holds 1/n
                local = local / mesh.size(dim)
        return local, None, None, None, None


def vocab_parallel_lookup(module: nn.Embedding, *args, **kwargs) -> torch.Tensor:
    """`module(*args, **kwargs)` with the weight's vocabulary rows sharded (see the module docstring).

    A subclass of `nn.Embedding` runs its own forward (Gemma scales the rows by sqrt(hidden), OPT's positional
    embedding computes its ids from the attention mask): only its lookups of this weight are replaced."""
    if type(module) is nn.Embedding:
        return _lookup(module, *args, **kwargs)
    with _RouteLookups(module):
        return type(module).forward(module, *args, **kwargs)


class _RouteLookups(TorchFunctionMode):
    """Sends `F.embedding(ids, module.weight, ...)` made inside a subclass's forward to `_lookup`."""

    def __init__(self, module: nn.Embedding) -> None:
        super().__init__()
        self.module = module

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding:
            ids = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if weight is self.module.weight:
                return _lookup(self.module, ids)
        return func(*args, **kwargs)


def _plain_forward(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    return nn.Embedding.forward(module, ids)


def _lookup(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """The lookup of `ids` in `module.weight`, as `nn.Embedding.forward` does it, vocabulary-parallel."""
    weight = module.weight
    if isinstance(weight, DTensor) and not isinstance(ids, DTensor) and module.max_norm is None:
        # ids the forward made itself (OPT's positions from its attention mask): the same on every rank; each
        # rank's weight gradient is its own samples' share (see _FromLocal), not the whole batch's
        ids = DTensor.from_local(ids, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim, run_check=False)
    elif not isinstance(ids, DTensor) or module.max_norm is not None:
        return _plain_forward(module, ids)
    elif not shards_vocabulary(weight) and not _replicated_on_dp(ids):
        return _plain_forward(module, ids)  # DTensor's own rule: outputs follow the ids, gradients partial on dp
    if any(isinstance(p, Shard) and wp.is_shard(0) for p, wp in zip(ids.placements, weight.placements, strict=True)):
        return _plain_forward(module, ids)  # tokens and rows sharded on one axis: DTensor's business
    mesh = weight.device_mesh
    rows, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    lo, hi = offset[0], offset[0] + rows[0]
    local_ids = ids.to_local()
    outside = (local_ids < lo) | (local_ids >= hi)  # tokens whose rows live on other ranks
    index = (local_ids - lo).masked_fill(outside, 0)
    pad = module.padding_idx
    pad = pad - lo if pad is not None and lo <= pad < hi else None
    local_weight = weight.to_local(grad_placements=_weight_grad_placements(ids, weight))
    out = F.embedding(index, local_weight, pad, None, module.norm_type, module.scale_grad_by_freq, module.sparse)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # (B, S, H / hidden shards)
    shape = torch.Size((*ids.shape, weight.shape[1]))
    return _FromLocal.apply(out, mesh, tuple(_output_placements(ids, weight)), shape,
                            torch.empty(shape, device="meta").stride())
