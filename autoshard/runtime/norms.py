"""Statistics-parallel LayerNorm / RMSNorm over a sharded hidden dim (Optimus, Xu et al. 2021, section 3.2).

DTensor's `native_layer_norm` and `_fused_rms_norm` rules shard only the dims before the normalized ones, so
a hidden-sharded input would be all-gathered. Instead each rank reduces its slice of the hidden dim to partial
statistics (DTensor gives `Partial` for a mean over a sharded dim), the statistics are all-reduced (B*S values,
not B*S*H), and the normalization and affine map stay sharded. The math is `torch.nn.functional.layer_norm`'s
(biased variance, eps inside the square root) and `rms_norm`'s; the result matches the fused kernels to a few
ulps. Autograd through the DTensor ops gives the matching backward collectives.

Norm modules are recognised by type (`nn.LayerNorm`, `nn.RMSNorm`) or, for Hugging Face RMSNorm classes
(`LlamaRMSNorm`, `Qwen2RMSNorm`, ...), by a `weight` and a `variance_epsilon`; any other norm class keeps its
own forward, which DTensor runs correctly (possibly gathering the hidden dim).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from autoshard.runtime.dtensor_ext import redistribute

__all__ = ["statistics_parallel_forward"]

log = logging.getLogger(__name__)


def _mean(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Mean over `dims`, all-reduced where they are sharded.

    Written as an all-reduced sum over the count: a mean over a sharded dim is `Partial(avg)`, and DTensor's
    backward cannot turn the `Partial(sum)` gradients that flow back from linear ops into `Partial(avg)`.
    """
    count = 1
    for d in dims:
        count *= x.shape[d]
    total = x.sum(dim=dims, keepdim=True)
    if isinstance(total, DTensor) and any(p.is_partial() for p in total.placements):
        total = redistribute(total, tuple(Replicate() if p.is_partial() else p for p in total.placements))
    return total / count


def _layer_norm(module: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    dims = tuple(range(-len(module.normalized_shape), 0))
    mean = _mean(x, dims)  # (B, S, 1)
    centered = x - mean
    var = _mean(centered * centered, dims)  # biased, as F.layer_norm
    y = centered * torch.rsqrt(var + module.eps)
    if module.weight is not None:
        y = y * module.weight
    if getattr(module, "bias", None) is not None:
        y = y + module.bias
    return y


def _rms_norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None)
    if eps is None:
        eps = torch.finfo(x.dtype).eps  # nn.RMSNorm's default
    dtype = x.dtype
    h = x.float()  # HF RMSNorms normalize in fp32 and cast back before the weight
    var = _mean(h.pow(2), (-1,))
    y = (h * torch.rsqrt(var + eps)).to(dtype)
    return y * module.weight if module.weight is not None else y


def _norm_fn(module: nn.Module):
    if isinstance(module, nn.LayerNorm):
        return _layer_norm
    if isinstance(module, nn.RMSNorm):
        return _rms_norm
    if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon") \
            and isinstance(getattr(module, "weight", None), nn.Parameter) and "Gemma" not in type(module).__name__:
        return _rms_norm  # Gemma's RMSNorm scales by (1 + weight): not this formula
    return None


def _hidden_sharded(module: nn.Module, x) -> bool:
    """Is `x` sharded on a dim `module` normalizes over?"""
    if not isinstance(x, DTensor):
        return False
    count = len(module.normalized_shape) if isinstance(module, nn.LayerNorm) else 1
    return any(p.is_shard() and p.dim >= x.ndim - count for p in x.placements)


def _dispatch(module: nn.Module, fn, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if _hidden_sharded(module, x) and not args and not kwargs:
        return fn(module, x)
    return type(module).forward(module, x, *args, **kwargs)


def statistics_parallel_forward(module: nn.Module):
    """The forward of norm `module` (a callable of its input) that reduces statistics when the input arrives
    sharded on the normalized dim and runs the module's own forward otherwise; None if its class is unknown,
    in which case it keeps its own forward (DTensor may then gather the hidden dim). The choice is made per
    call, on the layout the input really has (a plan may leave a layout to DTensor's propagation)."""
    fn = _norm_fn(module)
    if fn is None:
        log.info("%s is not a known norm class: keeping its forward (DTensor may gather the hidden dim)",
                 type(module).__name__)
        return None
    return functools.partial(_dispatch, module, fn)
