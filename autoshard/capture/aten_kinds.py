"""Which ATen targets are views, which compute, and what each keeps for backward.

Names are ATen overload-packet names (`aten.addmm.default` -> "addmm"). A grad-path target not listed here
is classified `OpKind.OTHER`: kept in the graph, priced as memory-bound, and reported by capture.
"""

from __future__ import annotations

import operator

from autoshard.capture.ir import OpKind

__all__ = ["aten_name", "classify", "VIEW", "NONLINEAR_POINTWISE", "GEMM", "ATTENTION"]

VIEW = frozenset({
    "view", "_unsafe_view", "reshape", "transpose", "t", "permute", "unsqueeze", "squeeze", "expand",
    "expand_as", "slice", "select", "split", "split_with_sizes", "chunk", "unbind", "contiguous", "alias",
    "clone", "detach", "flatten", "unflatten", "narrow", "as_strided", "_assert_tensor_metadata",
    "lift_fresh_copy", "view_as", "movedim", "getitem", "_assert_scalar", "sym_constrain_range_for_size",
    "sym_size", "sym_numel", "sym_stride", "_assert_async", "dropout_identity",
    # a weight transposed in the module's own forward (Falcon's `input @ self.weight.T`) stays a parameter
    "numpy_T", "mT", "swapaxes", "swapdims", "adjoint",
})
DTYPE_CASTS = frozenset({"to", "_to_copy", "type_as", "_autocast_to_reduced_precision",
                         "_autocast_to_full_precision"})
GEMM = frozenset({"linear", "addmm", "mm", "matmul", "bmm", "baddbmm", "einsum", "addbmm",
                  # mixture-of-experts expert matmuls: (tokens x top-k, in) @ (experts, in, out), rows grouped by
                  # expert; FLOPs 2 x rows x in x out whatever the routing (transformers' fallback included)
                  "grouped_mm", "_grouped_mm", "grouped_mm_fallback"})
EMBEDDING = frozenset({"embedding", "embedding_bag", "_embedding_bag"})
NORM = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm",
                  "native_group_norm", "batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                  "_native_batch_norm_legit_no_training", "instance_norm"})
ATTENTION = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                       "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
                       "_efficient_attention_forward", "flex_attention"})
SOFTMAX = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"})
DROPOUT = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"})
LOSS = frozenset({"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "nll_loss_forward",
                  "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
                  "binary_cross_entropy_with_logits", "kl_div"})
REDUCTION = frozenset({"sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "norm",
                       "linalg_vector_norm", "logsumexp", "prod", "cumsum", "argmax", "argmin", "all", "any",
                       "topk", "sort", "argsort"})  # selections over a dim (a MoE router's top-k): memory-bound
CONV = frozenset({"conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose2d"})
# What eager autograd saves for a pointwise op (PyTorch's tools/autograd/derivatives.yaml): its output (result)
# or its tensor inputs on the gradient path (self); ops not listed save nothing of the activations (add, sub,
# neg, casts, mean, sum, views). Used for a region of pointwise ops that eager PyTorch runs op by op, where a
# fused kernel would keep the region's inputs only.
SAVES_OUTPUT = frozenset({"tanh", "sigmoid", "exp", "rsqrt", "sqrt", "reciprocal", "relu", "exp2", "expm1",
                          "softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax", "hardtanh"})
SAVES_INPUTS = frozenset({"pow", "log", "log1p", "silu", "gelu", "erf", "sin", "cos", "softplus", "mish", "elu",
                          "leaky_relu", "hardswish", "hardsigmoid", "abs", "clamp", "clamp_min", "clamp_max",
                          "maximum", "minimum", "glu", "relu6", "logit", "atan", "square", "var", "std",
                          "norm", "linalg_vector_norm", "amax", "amin", "max", "min", "prod", "logsumexp"})
# Pointwise ops whose backward needs an input or output value (so autograd saves one).
NONLINEAR_POINTWISE = frozenset({
    "pow", "rsqrt", "sqrt", "exp", "log", "log1p", "tanh", "sigmoid", "silu", "gelu", "relu", "erf", "sin",
    "cos", "softplus", "mish", "elu", "leaky_relu", "hardtanh", "hardswish", "hardsigmoid", "reciprocal",
    "square", "abs", "clamp", "clamp_min", "clamp_max", "maximum", "minimum", "glu", "relu6", "logit", "atan",
    "expm1", "exp2", "sgn", "sign", "round", "floor", "ceil",
})
LINEAR_POINTWISE = frozenset({
    "add", "sub", "rsub", "neg", "mul", "div", "true_divide", "where", "masked_fill", "cat", "stack",
    "constant_pad_nd", "pad", "repeat", "repeat_interleave", "roll", "tril", "triu", "flip", "addcmul",
    "addcdiv", "lerp", "fill", "zeros_like", "ones_like", "full_like", "empty_like", "new_zeros", "new_ones",
    "new_full", "new_empty", "index_select", "gather", "scatter", "scatter_add", "index", "index_put",
    "masked_select", "copy", "fill_", "zero_", "bitwise_not", "logical_not", "eq", "ne", "lt", "le", "gt",
    "ge", "bitwise_and", "bitwise_or", "__and__", "__or__", "logical_and", "logical_or", "arange", "full",
    "zeros", "ones", "empty", "scalar_tensor", "lift_fresh", "polar", "complex", "view_as_real",
    "view_as_complex", "_to_dim_order_copy", "mul_", "add_", "diff", "tensor",
})


def aten_name(target) -> str:
    """'addmm' for aten.addmm.default, 'getitem' for operator.getitem, the name of a higher-order op."""
    if target is operator.getitem:
        return "getitem"
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def classify(name: str) -> OpKind | None:
    """The op kind of one ATen node on the gradient path; None for views (folded into edges). An in-place
    variant (`copy_`, `div_`, `scatter_`: DeepSeek-V3's attention assigns q and k by slices) is its functional
    op's kind."""
    if name.endswith("_") and not name.endswith("__") and name[:-1] and name not in LINEAR_POINTWISE:
        functional = classify(name[:-1])
        if functional is not OpKind.OTHER:
            return functional
    if name in VIEW:
        return None
    for kinds, kind in ((GEMM, OpKind.MATMUL), (EMBEDDING, OpKind.EMBEDDING), (NORM, OpKind.NORM),
                        (ATTENTION, OpKind.ATTENTION), (SOFTMAX, OpKind.SOFTMAX), (DROPOUT, OpKind.DROPOUT),
                        (LOSS, OpKind.LOSS), (REDUCTION, OpKind.REDUCTION), (CONV, OpKind.CONV)):
        if name in kinds:
            return kind
    if name in NONLINEAR_POINTWISE or name in LINEAR_POINTWISE or name in DTYPE_CASTS:
        return OpKind.ELEMENTWISE
    return OpKind.OTHER
