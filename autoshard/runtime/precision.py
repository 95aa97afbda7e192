"""The training precision the cost model prices (`planner.context.default_precision`), as the runtime runs it.

    bf16-mixed (GPUs)   every FSDP2 unit gets `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`,
                        torchtitan's default: the parameters, their gradients and AdamW's states stay fp32 and
                        sharded as planned; each unit's parameters are cast to bf16 when gathered, so matmuls,
                        activations and tensor-parallel traffic are bf16; gradients are cast to fp32 before their
                        reduce-scatter / all-reduce and summed across micro-batches in fp32
                        (`cost_models.memory.Precision.reduce_bytes`).
                        A plan without a dp axis gets a dp dim of one rank (mesh.py `unit_dp`), so FSDP2 casts
                        its parameters just the same; sharded over one rank it issues no collective. Pipeline
                        stages hand each other floating tensors in bf16.
    fp32 (CPU ranks)    nothing is cast.

`apply_plan(..., precision=...)` takes either; the default follows the device, as the cost model's does.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from autoshard.cost_models.memory import BF16_MIXED, FP32, Precision

__all__ = ["precision_for_device", "fsdp_policy", "compute_dtype"]


def precision_for_device(device_type: str) -> Precision:
    """What the cost model prices on this device: bf16 mixed precision on GPUs, fp32 on CPU ranks."""
    return FP32 if device_type == "cpu" else BF16_MIXED


def compute_dtype(precision: Precision) -> torch.dtype | None:
    """The dtype matmuls and activations run in, or None when parameters are used as they are (fp32)."""
    return torch.bfloat16 if precision.name == BF16_MIXED.name else None


def fsdp_policy(precision: Precision) -> MixedPrecisionPolicy:
    dtype = compute_dtype(precision)
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

