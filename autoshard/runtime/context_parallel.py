"""Context parallelism on the runtime: each sequence's tokens over the ranks of a cp group.

What runs (the `allgather` variant of cost_models/context_parallel.py, as Llama 3 trained):

- `shard_inputs` gives a cp rank two of the 2·cp equal chunks of every sequence, chunk r and 2·cp − 1 − r
  (head-tail, so a causal mask leaves every rank the same work), of the inputs and of the targets alike;
- the model's own forward runs on those tokens, with their positions passed as `position_ids` (rotary and
  learned position embeddings see the tokens' places in the whole sequence);
- attention, through transformers' attention interface (`AttentionInterface`, registered as "autoshard_cp"),
  all-gathers the keys and values over the cp group (torch's functional all-gather with autograd: the backward
  reduce-scatters their gradients), restores the sequence order, and computes each local query chunk against
  the keys up to its end with a lower-right causal mask (`torch.nn.attention.bias.causal_lower_right`, which
  SDPA runs as a causal flash / memory-efficient kernel on GPUs);
- outside attention a cp rank is a data-parallel rank over its tokens: the plan's data-parallel wrappers
  (FSDP2 / replicate) run on dp x cp, the mesh with cp folded into dp (`MeshSpec.folded_cp`), and average the
  gradients of ranks that each took the mean loss over equally many tokens.

Models: those whose attention goes through transformers' attention interface with a causal mask (Hugging Face
Llama, GPT-2, Qwen2, Mistral within its sliding window, ...), without padding masks. Anything else is refused
with a clear error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoshard.errors import RuntimeSetupError

__all__ = ["CP_ATTENTION_NAME", "head_tail_positions", "shard_sequence", "apply_context_parallel",
           "context_parallel_blocker"]

CP_ATTENTION_NAME = "autoshard_cp"


def head_tail_positions(seq: int, cp: int, rank: int, *, device=None) -> torch.Tensor:
    """Positions (in the whole sequence of `seq` tokens) of the tokens cp rank `rank` holds, in its order."""
    if seq % (2 * cp):
        raise RuntimeSetupError(f"context parallel {cp} cuts each sequence into {2 * cp} equal chunks; a sequence "
                                f"of {seq} tokens does not split so: use a length divisible by {2 * cp}")
    c = seq // (2 * cp)
    tail = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange(tail * c, (tail + 1) * c, device=device)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, *, dim: int = 1) -> torch.Tensor:
    """The tokens of `x` (sequence along `dim`) that cp rank `rank` holds."""
    return x.index_select(dim, head_tail_positions(x.shape[dim], cp, rank, device=x.device))


def _all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along the sequence dim (2 of (B, heads, S, d)), with autograd (backward: reduce-scatter)."""
    from torch.distributed import _functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return gather(x.contiguous(), gather_dim=2, group=group)


def _cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  is_causal: bool | None = None, **kwargs):
    """transformers' attention-interface signature: (B, heads, L, d) local queries, keys and values of this
    rank's 2 chunks; returns (B, L, heads, d) as `sdpa_attention_forward` does."""
    state = getattr(module, "_autoshard_cp", None)
    if state is None:
        raise RuntimeSetupError(f"{type(module).__name__} runs context-parallel attention but was not set up for "
                                "it; apply the plan with apply_plan / autoparallel")
    if isinstance(query, DTensor):  # a tensor-parallel plan in SPMD mode: this rank's tokens and heads
        return _cp_attention_on_dtensors(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    group, cp, rank = state
    if attention_mask is not None:
        raise RuntimeSetupError("context parallelism runs causal attention without a padding mask; pass no "
                                "attention_mask (pack sequences to full length)")
    local = query.shape[2]
    window = kwargs.get("sliding_window")
    if window is not None and window < local * cp:
        raise RuntimeSetupError(f"context parallelism runs full causal attention; this model's sliding window of "
                                f"{window} tokens is shorter than its {local * cp}-token sequences: plan with cp=1")
    c = local // 2
    keys, values = _all_gather_seq(key, group), _all_gather_seq(value, group)
    # gathered in rank order (rank i: chunks i and 2cp-1-i) -> sequence order
    order = torch.cat([head_tail_positions(local * cp, cp, i, device=key.device) for i in range(cp)])
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    keys, values = keys.index_select(2, back), values.index_select(2, back)
    if keys.shape[1] != query.shape[1]:  # grouped-query attention: repeat K/V heads to the query heads
        rep = query.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
    outs = []
    for i, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        end = (chunk + 1) * c  # this chunk's queries see the keys up to its own end
        q = query[:, :, i * c:(i + 1) * c]
        outs.append(F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end],
                                                   attn_mask=_lower_right(c, end),
                                                   dropout_p=dropout if module.training else 0.0, scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _cp_attention_on_dtensors(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """`_cp_attention` on (B, heads, L, d) DTensors: on the local tensors of this rank's samples, tokens and
    heads (a tensor-parallel axis shards the heads, or replicates them), the output a DTensor laid out as the
    query was, with the heads dim moved to 2. A mesh dim sharding the sequence (dim 2) is gathered first:
    the cp ranks' tokens are the only split of the sequence attention can take."""
    mesh = query.device_mesh
    placements = tuple(Replicate() if isinstance(p, Shard) and p.dim in (2, 3) or p.is_partial() else p
                       for p in query.placements)
    local = [x.redistribute(mesh, placements).to_local() if isinstance(x, DTensor) else x
             for x in (query, key, value)]
    if attention_mask is not None:
        raise RuntimeSetupError("context parallelism runs causal attention without a padding mask; pass no "
                                "attention_mask (pack sequences to full length)")
    out, _ = _cp_attention(module, *local, None, dropout, scaling, **kwargs)
    out_placements = tuple(Shard(2) if isinstance(p, Shard) and p.dim == 1 else p for p in placements)
    return DTensor.from_local(out, mesh, out_placements, run_check=False), None


def _lower_right(queries: int, keys: int):
    """A causal mask aligned to the last key (`causal_lower_right`: no mask tensor, SDPA runs its causal
    kernels), made outside any active dispatch mode (a tensor subclass cannot be created inside one, e.g.
    CommDebugMode or the runtime's collective recorder)."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return causal_lower_right(queries, keys)


def _no_mask(*args, **kwargs):
    return None  # causality is the CP attention's own (chunk positions); no mask tensor over local keys


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(CP_ATTENTION_NAME, _cp_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CP_ATTENTION_NAME, _no_mask)


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(m, "is_causal", None) is True and hasattr(m, "config")]


def context_parallel_blocker(model: nn.Module) -> str | None:
    """Why the runtime cannot run `model` context-parallel, or None."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return (f"{type(model).__name__} is not a transformers model: context parallelism swaps the attention "
                "through transformers' attention interface")
    if not _attention_modules(model):
        return f"{type(model).__name__} has no causal attention module (is_causal) to split by sequence"
    if getattr(config, "is_encoder_decoder", False):
        return f"{type(model).__name__} is an encoder-decoder; context parallelism runs causal decoders"
    return None


def apply_context_parallel(model: nn.Module, group, cp: int, rank: int) -> None:
    """Make `model`'s attention context-parallel over `group` (cp ranks, this one `rank`), in place."""
    why = context_parallel_blocker(model)
    if why:
        raise RuntimeSetupError(f"context parallel {cp}: {why}; plan with cp=1")
    _register()
    for config in {id(m.config): m.config for m in [model, *_attention_modules(model)]}.values():
        config._attn_implementation = CP_ATTENTION_NAME
    for m in _attention_modules(model):
        m._autoshard_cp = (group, cp, rank)
