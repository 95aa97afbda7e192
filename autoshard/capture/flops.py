"""FLOPs of one ATen node, per sample, from its per-sample shapes.

Matmuls count 2 FLOPs per multiply-add, the convention of Megatron-LM (Narayanan et al. 2021, eq. 3) and
of the scaling-law papers. Attention counts the full score matrix (QK^T and the weighted sum), causal or not,
as Megatron does. Backward of a matmul is twice its forward (one GEMM for the input gradient, one for the
weight gradient); pointwise work is counted one FLOP per output element and its backward as two.
"""

from __future__ import annotations

import math

__all__ = ["gemm_flops", "attention_flops", "conv_flops", "pointwise_flops", "einsum_flops"]

Shape = tuple[int, ...]


def _numel(shape: Shape) -> int:
    return math.prod(shape)


def gemm_flops(name: str, in_shapes: list[Shape], out_shape: Shape) -> tuple[int, tuple[int, int, int]]:
    """(forward FLOPs, (M, N, K)) of a GEMM-family node; M is the per-sample row count."""
    if name == "linear":
        k = in_shapes[0][-1]
        n = in_shapes[1][0]
    elif name in ("addmm",) or name in ("baddbmm", "addbmm"):
        k = in_shapes[1][-1]
        n = in_shapes[2][-1]
    elif name == "einsum":
        raise ValueError("use einsum_flops for einsum")
    else:  # mm, matmul, bmm
        k = in_shapes[0][-1]
        n = in_shapes[1][-1] if len(in_shapes[1]) > 1 else 1
    out_numel = _numel(out_shape)
    m = out_numel // max(n, 1)
    return 2 * out_numel * k, (m, n, k)


def einsum_flops(equation: str, in_shapes: list[Shape]) -> int:
    """2 x the product of every index size (each multiply-add over the full index space)."""
    lhs = equation.replace(" ", "").split("->")[0]
    sizes: dict[str, int] = {}
    for term, shape in zip(lhs.split(","), in_shapes, strict=False):
        letters = [c for c in term if c.isalpha()]
        for c, d in zip(letters[-len(shape):] if letters else [], shape, strict=False):
            sizes[c] = max(sizes.get(c, 1), d)
    return 2 * math.prod(sizes.values())


def attention_flops(q: Shape, k: Shape, v: Shape) -> int:
    """QK^T plus the weighted sum: 2*Lq*Lk*E + 2*Lq*Lk*Ev per batch x head."""
    lead = _numel(q[:-2])
    lq, e = q[-2], q[-1]
    lk, ev = k[-2], v[-1]
    return 2 * lead * lq * lk * (e + ev)


def conv_flops(in_shape: Shape, weight_shape: Shape, out_shape: Shape) -> tuple[int, tuple[int, int, int]]:
    """2 x output elements x (input channels per group x kernel size); as a GEMM: M = output positions."""
    c_out = weight_shape[0]
    per_output = _numel(weight_shape[1:])
    out_numel = _numel(out_shape)
    return 2 * out_numel * per_output, (out_numel // max(c_out, 1), c_out, per_output)


def pointwise_flops(out_shape: Shape) -> int:
    return _numel(out_shape)

