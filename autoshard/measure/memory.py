"""What a parallelized model really holds per rank, for checking the planner's memory prediction."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["local_param_bytes"]


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank stores: the sum of local shard sizes (each tied parameter once).

    FSDP2's padding for uneven dp shards is not counted: it is a transient all-gather buffer, not a parameter.
    """
    total = 0
    for p in model.parameters():  # parameters() yields a tied parameter once
        local = p._local_tensor if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total
