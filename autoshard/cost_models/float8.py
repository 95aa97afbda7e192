"""Float8 training of the block Linears (torchao's `Float8Linear`, torchtitan's `float8` converter), priced.

A float8 Linear keeps its weight and its saved input in 16 bits and casts, in every GEMM it runs, both
operands to float8 with a dynamic scale (amax of the tensor, or of each row, over the float8 maximum):

    forward    Y  = cast(X) @ cast(W)^T                 (e4m3 x e4m3)
    backward   dX = cast(dY) @ cast(W)                  (e5m2 x e4m3 tensorwise; e4m3 rowwise)
               dW = cast(dY)^T @ cast(X)                  torchao/float8/float8_linear.py
                                                          `matmul_with_hp_or_float8_args` (it saves X and W in
                                                          high precision and casts again in backward)

Recipes (`Float8LinearConfig.from_recipe_name`): "tensorwise", one scale per tensor: a cast is an amax pass
(read) and a scale-and-cast pass (read, write one byte), the transposed operand of the weight-gradient GEMM a
byte-for-byte transpose of the cast one; "rowwise", one scale per row along the reduced dim: the amax is
row-local and fuses with the cast into one pass, but every tensor is used along both dims and each needs its
own scales, so the column-wise cast pays a separate amax pass. Only tensorwise has FSDP2's float8 all-gather
(`enable_fsdp_float8_all_gather`: the weight's shard is cast before the gather, so the all-gather moves one
byte per parameter, and `precompute_float8_dynamic_scale_for_fsdp` computes every weight's amax with one
all-reduce per step). The gathered weight is a float8 tensor (torchao float8/fsdp_utils.py
`fsdp_post_all_gather` returns a `Float8TrainingTensor` over the gathered bytes), so what a rank holds of it
between uses (ZeRO 0-2, and ZeRO-3 in a pipeline stage) is one byte per element, not 16 bits: measured on
gloo ranks, FSDP2 holds 4,096 bytes for a 4,096-element q_proj weight at ZeRO 0 and 2
(tests/distributed/test_float8_runtime.py); and it is cast once per gather, on the shard, not in every GEMM,
with a scale computed once per step for every weight (torchao's `precompute_float8_dynamic_scale_for_fsdp`:
an inf-norm pass over the shards and one all-reduce, as torchtitan runs it after each optimizer step and the
runtime's `train_step` at its start; without it every gather would add an amax pass and an all-reduce per
weight: runtime/compile.py `float8_weight_scales`).

What the casts cost depends on whether they are compiled: torchtitan requires `--compile` with float8 because
eager PyTorch runs each cast as abs, amax, scale arithmetic, multiply, clamp and convert, each a kernel with
its own pass (torchao/float8/float8_scaling_utils.py `hp_tensor_to_float8_dynamic`, float8_utils.py
`tensor_to_amax`, `to_fp8_saturated`), where Inductor fuses them into the passes above.

GEMMs run on the fp8 tensor cores at `GPUProfile.fp8_gemm_speedup` times the 16-bit GEMM of the same shape
(cost_models/compute.py `gemm_time_s`); GPUs without fp8 tensor cores (before Hopper) have 0 there and are
refused. The head (the vocabulary projection) stays in 16 bits, as torchtitan's `filter_fqns = ["output"]`
keeps it; so do Linears whose dims are not multiples of 16 (`_scaled_mm`'s alignment) and grouped expert
GEMMs (torchao's float8 MoE path is a prototype).
"""

from __future__ import annotations

from autoshard.capture.ir import Op, OpKind
from autoshard.errors import ConfigurationError
from autoshard.plans.contract import is_expert_weight

__all__ = ["FLOAT8_RECIPES", "FLOAT8_ALIGN", "FLOAT8_BYTES", "float8_linear", "cast_bytes_per_elem", "cast_kernels",
           "GATHER_CAST_KERNELS", "gather_cast_bytes_per_elem", "float8_all_gather", "require_fp8_tensor_cores"]

FLOAT8_RECIPES = ("tensorwise", "rowwise")
FLOAT8_ALIGN = 16  # torch._scaled_mm needs both dims of each float8 operand divisible by 16
FLOAT8_BYTES = 1  # e4m3 / e5m2
GATHER_CAST_KERNELS = 3  # multiply, clamp, convert (`gather_cast_bytes_per_elem`)

# Bytes moved per element of each operand, forward (X, W) and backward (dY; X and W again), compiled:
#   tensorwise  amax (read 2) + scale-and-cast (read 2, write 1) = 5 per cast; dY's transposed copy for dW
#               (read 1, write 1) = 2 more. Backward reuses the forward's float8 X and W, transposed (read 1,
#               write 1 = 2): compiled, the partitioner saves the float8 casts rather than recomputing them
#               (torchao Float8LinearConfig: the float8 weight is kept for backward unless
#               `force_recompute_fp8_weight_in_bwd`), and one tensor-wide scale serves both layouts
#   rowwise     row-wise cast (read 2, write 1) = 3; column-wise cast (amax read 2 + cast read 2 write 1) = 5
#               forward: X rows 3, W rows 3; backward: dY rows 3 + columns 5, W columns 5, X columns 5 (a
#               row-scaled cast cannot serve the other layout: every column-wise cast starts from 16 bits)
_COMPILED = {
    "tensorwise": {"fwd": {"x": 5, "w": 5}, "bwd": {"g": 7, "x": 2, "w": 2}},
    "rowwise": {"fwd": {"x": 3, "w": 3}, "bwd": {"g": 8, "x": 5, "w": 5}},
}
# Eager: abs (read 2, write 2), amax (read 2), multiply by the fp32 scale (read 2, write 4), clamp (read 4,
# write 4), convert (read 4, write 1) = 25 bytes in five passes per cast
_EAGER_CAST_BYTES = 25
_EAGER_CAST_KERNELS = 8  # the five passes and three scalar ops on the amax (clamp, divide, reciprocal)
# casts per operand: rowwise casts dY along both dims in backward (its rows for dX, its columns for dW)
_CASTS = {"tensorwise": {"fwd": {"x": 1, "w": 1}, "bwd": {"g": 1, "x": 1, "w": 1}},
          "rowwise": {"fwd": {"x": 1, "w": 1}, "bwd": {"g": 2, "x": 1, "w": 1}}}
_TRANSPOSE_BYTES = 2  # tensorwise dY's float8 transpose for dW (read 1, write 1), compiled or not


def float8_linear(op: Op) -> bool:
    """Whether torchao's conversion (as autoshard's runtime applies it) makes `op` a float8 Linear: a Linear
    inside a repeated block, dims multiples of 16, not a grouped expert GEMM."""
    if op.kind is not OpKind.LINEAR or op.layer is None or op.gemm is None:
        return False
    if any(is_expert_weight(p) for p in op.params):
        return False
    _, n, k = op.gemm
    return n % FLOAT8_ALIGN == 0 and k % FLOAT8_ALIGN == 0


def cast_bytes_per_elem(recipe: str, phase: str, operand: str, *, compiled: bool) -> float:
    """Bytes moved casting one element of `operand` ("x", "w" or "g") in `phase` ("fwd", "bwd")."""
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"unknown float8 recipe {recipe!r}; use one of {', '.join(FLOAT8_RECIPES)}")
    if compiled:
        return _COMPILED[recipe][phase].get(operand, 0)
    casts = _CASTS[recipe][phase].get(operand, 0)
    extra = _TRANSPOSE_BYTES if recipe == "tensorwise" and operand == "g" else 0
    return casts * _EAGER_CAST_BYTES + extra


def cast_kernels(recipe: str, phase: str, *, compiled: bool) -> int:
    """Kernels the casts of one float8 Linear launch in `phase`: compiled, two per cast (amax then cast, or a
    row-wise cast and a transposed copy); eager, `_EAGER_CAST_KERNELS` per cast."""
    casts = sum(_CASTS[recipe][phase].values())
    if not compiled:
        return casts * _EAGER_CAST_KERNELS
    return 2 * casts


def gather_cast_bytes_per_elem(source_bytes: int) -> int:
    """Bytes moved casting one element of a weight's shard to float8 with its scale computed already, as FSDP2's
    float8 all-gather does before each gather (torchao float8/fsdp_utils.py `fsdp_pre_all_gather` with a
    precomputed scale, `hp_tensor_and_scale_to_float8`, eager: FSDP2's hooks run outside compiled blocks):
    multiply by the scale (read the shard's `source_bytes`, write fp32), clamp (fp32 in and out), convert (fp32
    in, one byte out), `GATHER_CAST_KERNELS` kernels."""
    return source_bytes + 4 + 4 + 4 + 4 + FLOAT8_BYTES


def float8_all_gather(recipe: str) -> bool:
    """Whether FSDP2 gathers float8 Linears' weights in float8 (one byte per parameter): tensorwise only."""
    return recipe == "tensorwise"


def require_fp8_tensor_cores(gpu, recipe: str) -> None:
    """Raise ConfigurationError naming the GPU when float8 `recipe` is asked of a GPU without fp8 tensor cores
    (GPUProfile.fp8_gemm_speedup 0): `estimate --float8` and the planner's `Lowering` both ask here."""
    if recipe and not gpu.fp8_gemm_speedup:
        raise ConfigurationError(f"float8={recipe}: {gpu.name} has no fp8 tensor cores (8-bit floating point needs "
                                 "an H100, H200 or newer); drop --float8 or pick such a cluster", params=("float8",))
