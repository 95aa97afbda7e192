"""The planner's IR: an operator graph with shapes, FLOPs and saved bytes, per sample.

`OpGraph` holds operators in topological order. Every size in it is **per sample** (batch 1): the graph is
captured with a symbolic batch dimension, so every dim that scales with the batch is known and listed in
`TensorMeta.batch_dims`, and costs for a micro-batch of b samples are b times the per-sample figures (the
parameters excepted). Sequence length is fixed at capture time.

Repeated blocks (transformer layers with identical structure and shapes) are recorded in `BlockGroup`s so the
ILP can tie their decisions: one set of variables per block type, multiplied by the count.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from enum import Enum

__all__ = ["OpKind", "TensorMeta", "ParamMeta", "Op", "BlockGroup", "OpGraph", "DTYPE_BYTES", "is_call_of"]

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8,
}


class OpKind(str, Enum):
    """What an operator does, as far as the planner cares."""

    LINEAR = "linear"  # y = x W^T (+ b); owns a weight
    MATMUL = "matmul"  # activation x activation (attention scores, weighted sum)
    EMBEDDING = "embedding"
    ATTENTION = "attention"  # fused scaled-dot-product attention
    NORM = "norm"  # layer norm / RMS norm
    SOFTMAX = "softmax"
    ELEMENTWISE = "elementwise"  # pointwise math, activations, residual adds, rotary embeddings
    DROPOUT = "dropout"
    REDUCTION = "reduction"  # sum / mean / max over a dim
    LOSS = "loss"
    CONV = "conv"  # patch embeddings and other convolutions
    INPUT = "input"  # a user input of the model (token ids, pixels)
    INDEX = "index"  # work off the gradient path: masks, positions, rotary tables
    OTHER = "other"  # known to exist, unknown to the planner: kept, priced as memory-bound, reported


def is_call_of(op: str, module: str) -> bool:
    """Op `op` is named after a call of `module` (`path`, or `path_N` for a later call): capture names the op
    of a whole leaf-module call after the module, and an op inside a module's forward `path.target`."""
    return op == module or re.fullmatch(re.escape(module) + r"_\d+", op) is not None


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    """Shape of one tensor for ONE sample; `batch_dims` are the dims that grow with the batch."""

    shape: tuple[int, ...]
    dtype: str
    batch_dims: tuple[int, ...] = ()
    wide: bool = False  # a float32 copy a 16-bit model makes (a norm's upcast): 4 bytes at any precision

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {sorted(DTYPE_BYTES)}")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def bytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, kw_only=True)
class ParamMeta:
    """A parameter, under the name `model.named_parameters()` gives it (the first name, if tied)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    owner: bool = True  # False in every op but the first that uses a shared (tied) parameter

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, kw_only=True)
class Op:
    """One coarsened operator: a leaf module call (Linear, LayerNorm, ...) or one compute node of a
    module's own forward (SDPA, a residual add), with its view ops folded in."""

    name: str
    kind: OpKind
    module_path: str  # innermost nn.Module path from nn_module_stack, "" for the root
    module_type: str  # class name of that module
    layer: int | None  # index of the repeated block this op belongs to, None outside blocks
    inputs: tuple[str, ...]  # names of producer ops (activation inputs, in argument order)
    input_meta: tuple[TensorMeta, ...]
    output_meta: TensorMeta
    params: tuple[ParamMeta, ...] = ()
    fwd_flops: int = 0  # per sample
    bwd_flops: int = 0  # per sample
    saved: tuple[TensorMeta, ...] = ()  # per sample: activations this op keeps for backward
    # what it keeps when its pointwise ops run as one fused kernel (Megatron-LM's, Transformer Engine's,
    # torch.compile's), where that differs from eager PyTorch (a norm written as pointwise ops); None: the same
    saved_fused: tuple[TensorMeta, ...] | None = None
    needs_input_grad: bool = True  # False when no activation input is on the gradient path
    aten: tuple[str, ...] = ()  # the ATen targets coarsened into this op
    gemm: tuple[int, int, int] | None = None  # (M per sample, N, K) of the main GEMM, for efficiency
    variant: str = ""  # kernel choice that changes speed: attention "flash" (causal/no mask) or "masked"
    kernels: int = 0  # ATen kernels eager PyTorch launches for it in forward (views excluded)
    kernel_io_numel: int = 0  # per sample: elements those kernels read and write (batch-dim tensors only)
    kernel_io_wide_numel: int = 0  # of which float32 in a 16-bit model (upcasts): 4 bytes at any precision
    views: int = 0  # view ops on its output (reshape, transpose, ...): no kernel, one eager dispatch each

    @property
    def dispatches(self) -> int:
        """ATen ops eager PyTorch dispatches for it in forward: its kernels and the views of its output."""
        return self.kernels + self.views

    @property
    def param_numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def saved_numel(self) -> int:
        return sum(t.numel for t in self.saved)


@dataclass(frozen=True, kw_only=True)
class BlockGroup:
    """`count` repeated blocks with identical structure: `op_names[i]` lists the ops of block i, and the
    j-th op of every block plays the same role (same kind, shapes, parameters)."""

    name: str  # module path prefix, e.g. "transformer.h"
    module_type: str  # class of the block, e.g. "GPT2Block"
    op_names: tuple[tuple[str, ...], ...]

    @property
    def count(self) -> int:
        return len(self.op_names)

    @property
    def ops_per_block(self) -> int:
        return len(self.op_names[0]) if self.op_names else 0


@dataclass(frozen=True, kw_only=True)
class OpGraph:
    """The captured model: ops in topological order, repeated blocks, and what capture could not name."""

    model_name: str
    ops: tuple[Op, ...]
    blocks: tuple[BlockGroup, ...] = ()
    seq_len: int | None = None
    outputs: tuple[str, ...] = ()  # ops whose values the model returns
    unknown_ops: tuple[str, ...] = ()  # ATen targets classified OpKind.OTHER (reported, never dropped)
    tied_params: tuple[tuple[str, str], ...] = ()  # (alias, owner) for shared parameters
    root_type: str = ""  # class of the captured module
    root_kwargs: tuple[str, ...] = ()  # the parameter names of its forward (plans/contract.py reads them)
    capture_s: float = 0.0
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        names = [op.name for op in self.ops]
        if len(set(names)) != len(names):
            raise ValueError("OpGraph has duplicate op names")
        self._index.update({n: i for i, n in enumerate(names)})

    def op(self, name: str) -> Op:
        return self.ops[self._index[name]]

    def position(self, name: str) -> int:
        return self._index[name]

    @property
    def num_params(self) -> int:
        """Parameters counted once each (a tied embedding and LM head share one)."""
        seen: dict[str, int] = {}
        for op in self.ops:
            for p in op.params:
                seen.setdefault(p.name, p.numel)
        return sum(seen.values())

    @property
    def fwd_flops_per_sample(self) -> int:
        return sum(op.fwd_flops for op in self.ops)

    @property
    def matmul_flops_per_sample(self) -> int:
        """Forward FLOPs of every matmul (linear layers, attention scores and weighted sums, convolutions):
        the count Megatron-LM and the scaling-law papers use."""
        kinds = (OpKind.LINEAR, OpKind.MATMUL, OpKind.ATTENTION, OpKind.CONV)
        return sum(op.fwd_flops for op in self.ops if op.kind in kinds)

    @property
    def num_layers(self) -> int:
        return max((b.count for b in self.blocks), default=0)

    def consumers(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {op.name: [] for op in self.ops}
        for op in self.ops:
            for src in op.inputs:
                out[src].append(op.name)
        return out

    def ops_by_kind(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for op in self.ops:
            counts[op.kind.value] = counts.get(op.kind.value, 0) + 1
        return dict(sorted(counts.items()))

    def fingerprint(self) -> str:
        """Hash of the structure (kinds, shapes, parameters, edges): equal models give equal fingerprints, in
        any dtype: an op that only casts its input (`.to(dtype)`, which the same model in the cast's dtype does
        not trace at all; transformers' MoE layers end with one) is left out and its consumers read its input.
        Index ops (sizes and positions, no cost) are left out too: torch.export shares one between layers or
        not depending on the dtype (a MoE layer's row count, computed once in the first layer that needs it)."""
        h = hashlib.sha256()
        alias: dict[str, str] = {}
        index = {op.name for op in self.ops if op.kind is OpKind.INDEX}
        for op in self.ops:
            if op.name in index:
                continue
            if op.aten == ("to",) and not op.params and len(op.inputs) == 1 and \
                    op.input_meta[0].shape == op.output_meta.shape:
                alias[op.name] = alias.get(op.inputs[0], op.inputs[0])
                continue
            inputs = [alias.get(i, i) for i in op.inputs if i not in index]
            rec = [op.kind.value, op.module_path, inputs, list(op.output_meta.shape),
                   [[p.name, list(p.shape)] for p in op.params]]
            h.update(json.dumps(rec).encode())
        return h.hexdigest()[:16]

    def binding_ops(self) -> tuple[Op, ...]:
        """The ops the runtime binds a plan to: those holding parameters (it places them) and those that are
        a whole call of a module (it hooks them). Index ops are left out, as in `fingerprint`; so are the
        parameter-free ops of a module's own forward, which run on the layouts their producers hand over."""
        return tuple(op for op in self.ops if op.kind is not OpKind.INDEX
                     and (op.params or is_call_of(op.name, op.module_path)))

    def binding_fingerprint(self) -> str:
        """Hash of `binding_ops` (name, kind, module, output shape, parameter names and shapes), not of edges:
        two graphs that differ only in how a module's forward is written (another transformers version adds a
        masked_fill inside the MoE experts) have the same binding fingerprint, and a plan made on one places
        the other's parameters and module calls alike. Dtype-insensitive like `fingerprint` (no dtypes)."""
        h = hashlib.sha256()
        for op in self.binding_ops():
            rec = [op.name, op.kind.value, op.module_path, list(op.output_meta.shape),
                   [[p.name, list(p.shape)] for p in op.params]]
            h.update(json.dumps(rec).encode())
        return h.hexdigest()[:16]
