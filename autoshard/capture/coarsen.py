"""Coarsen an exported ATen graph into the planner's operators.

Rules, in order:
1. Views (view, transpose, split, getitem, ...) make no operator: they are folded into the edge they sit on,
   and a view of a parameter is that parameter.
2. Nodes that depend on no parameter are off the gradient path: nodes built from constants and buffers
   alone (rotary tables, position ranges) are constants; nodes that read a model input (attention masks built
   from token ids) become `INDEX` operators, one per module call.
3. On the gradient path, every node of one call of a *leaf* module (Linear, Conv1D, LayerNorm, RMSNorm,
   GELU, Dropout, Embedding, ...) forms one operator, typed by its heaviest node.
4. Inside a module's own forward (attention math, residual adds), each compute node is an operator, except
   that connected pointwise nodes of the same module call merge into one fused region (rotary embeddings),
   as long as the region stays convex (nothing leaves it and comes back).

Saved activations follow autograd, with pointwise regions counted as fused kernels (Megatron-LM's fused
bias-GELU, what torch.compile produces): a region keeps its external inputs, not its intermediates. With
16-bit activations this reproduces Korthikanti et al. 2022's 34·s·b·h + 5·a·s²·b bytes per GPT layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import fx, nn

from autoshard.capture import aten_kinds as ak
from autoshard.capture.export import ExportedGraph
from autoshard.capture.flops import attention_flops, conv_flops, einsum_flops, gemm_flops, pointwise_flops
from autoshard.capture.ir import Op, OpKind, TensorMeta

__all__ = ["Coarsened"]

@dataclass(frozen=True)
class _Param:
    fqn: str


@dataclass(frozen=True)
class _Const:
    pass


# Views that must copy a broadcast (expanded) input; every other view shares its input's storage. `contiguous`
# of a transposed attention output shares it too: FlashAttention-2 and PyTorch's fused SDPA kernels write the
# output as (batch, seq, heads, dim) and return it transposed, so `out.transpose(1, 2).contiguous()` is free.
_RESHAPES = frozenset({"reshape", "view", "_unsafe_view", "contiguous", "flatten", "unflatten"})
_PARTS = frozenset({"slice", "select", "split", "split_with_sizes", "chunk", "unbind", "narrow", "getitem",
                    "as_strided"})


@dataclass(frozen=True)
class _Act:
    gid: int
    meta: TensorMeta | None  # None for tuple-valued nodes (split, native_layer_norm)
    grad: bool
    node: str  # name of the fx node holding this value (for de-duplicating inputs)
    base: str = ""  # the node whose storage this value is a view of ("": its own); one saved copy per storage
    expanded: bool = False  # a broadcast view (expand): reshaping it copies
    origin: _Act | None = None  # a view's source before any view (what an expand broadcasts)
    unexpanded: _Act | None = None  # a copy of a broadcast (GQA's repeat_kv): the value it repeats

    @property
    def storage(self) -> str:
        return self.base or self.node


@dataclass
class _Group:
    gid: int
    kind: OpKind | None  # None until finalized from its nodes
    module_path: str
    module_type: str
    call_key: str
    leaf: bool
    nodes: list[fx.Node] = field(default_factory=list)
    inputs: list[_Act] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    saved: list[_Act] = field(default_factory=list)
    output: _Act | None = None
    fwd_flops: int = 0
    gemm: tuple[int, int, int] | None = None
    gemm_flops: int = 0
    unknown: list[str] = field(default_factory=list)
    node_kinds: set = field(default_factory=set)
    saves_internal: bool = False
    eager_saved: list[_Act] = field(default_factory=list)  # what eager autograd keeps, op by op (pointwise)
    variant: str = ""
    kernels: int = 0  # ATen kernels (non-view nodes) eager PyTorch launches for this group
    kernel_io_numel: int = 0  # per-sample elements those kernels read and write (batch-dim tensors)
    kernel_io_wide_numel: int = 0  # of which in float32 while the model computes in 16 bits (upcasts)
    views: int = 0  # view ops (reshape, transpose, ...) on its output: no kernel, but a dispatch each in eager


@dataclass(frozen=True)
class Coarsened:
    ops: tuple[Op, ...]
    outputs: tuple[str, ...]
    unknown: tuple[str, ...]


def _module_info(node: fx.Node) -> tuple[str, str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", "", ""
    key, (path, typ) = list(stack.items())[-1]
    typ_name = typ.rsplit(".", 1)[-1] if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    return path, typ_name, key


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class _Coarsener:
    def __init__(self, eg: ExportedGraph, model: nn.Module) -> None:
        self.eg = eg
        self.leaf_paths = {n for n, m in model.named_modules() if n and next(m.children(), None) is None}
        self.values: dict[str, object] = {}
        self.groups: list[_Group] = []
        self.outputs: list[int] = []
        self.param_shapes: dict[str, tuple[tuple[int, ...], str]] = {}
        self.low_precision = any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters())

    # -- values -----------------------------------------------------------------------------------
    def meta(self, node: fx.Node) -> TensorMeta | None:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or node.name not in self.eg.shapes:
            return None
        shape, batch_dims = self.eg.shapes[node.name]
        return TensorMeta(shape=shape, dtype=_dtype_name(val.dtype), batch_dims=batch_dims)

    def _new_group(self, kind, node: fx.Node, leaf: bool) -> _Group:
        path, typ, key = _module_info(node)
        g = _Group(gid=len(self.groups), kind=kind, module_path=path, module_type=typ, call_key=key, leaf=leaf)
        self.groups.append(g)
        return g

    # -- graph walk --------------------------------------------------------------------------------
    def run(self) -> None:
        for node in self.eg.program.graph.nodes:
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "output":
                self._output(node)
            elif node.op == "call_function":
                self._call(node)
            else:  # get_attr of submodule graphs for higher-order ops: constants
                self.values[node.name] = _Const()

    def _placeholder(self, node: fx.Node) -> None:
        if node.name in self.eg.param_names:
            fqn = self.eg.param_names[node.name]
            val = node.meta["val"]
            self.param_shapes[fqn] = (tuple(int(d) for d in val.shape), _dtype_name(val.dtype))
            self.values[node.name] = _Param(fqn)
        elif node.name in self.eg.input_names:
            g = self._new_group(OpKind.INPUT, node, leaf=False)
            g.module_path, g.call_key = "", f"input:{node.name}"
            g.output = _Act(g.gid, self.meta(node), False, node.name)
            self.values[node.name] = g.output
        else:
            self.values[node.name] = _Const()

    def _output(self, node: fx.Node) -> None:
        for arg in _flatten(node.args):
            val = self.values.get(arg.name) if isinstance(arg, fx.Node) else None
            if isinstance(val, _Act) and val.gid not in self.outputs:
                self.outputs.append(val.gid)

    def _call(self, node: fx.Node) -> None:
        name = ak.aten_name(node.target)
        ins = [self.values.get(a.name, _Const()) for a in node.all_input_nodes]
        meta = self.meta(node)
        if self._is_view(name, node, ins):
            self._fold_view(node, ins, meta)
            return
        acts = [v for v in ins if isinstance(v, _Act)]
        has_param = any(isinstance(v, _Param) for v in ins)
        float_out = _has_float_output(node)
        grad = float_out and (has_param or any(a.grad for a in acts))
        if not acts and not has_param:
            self.values[node.name] = _Const()
            return
        if not grad:
            self._index_node(node, acts, meta)
            return
        kind = ak.classify(name) or OpKind.ELEMENTWISE
        if kind is OpKind.MATMUL and has_param:
            kind = OpKind.LINEAR
        g = self._group_for(node, kind, acts)
        self._add_node(g, node, name, kind, ins, meta)

    def _is_view(self, name: str, node: fx.Node, ins) -> bool:
        if name in ak.VIEW:
            return True
        if name in ak.DTYPE_CASTS and node.all_input_nodes:
            src = node.all_input_nodes[0].meta.get("val")
            out = node.meta.get("val")
            return isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dtype == out.dtype
        return False

    def _fold_view(self, node: fx.Node, ins, meta) -> None:
        src = ins[0] if ins else _Const()
        if not isinstance(src, _Act):
            self.values[node.name] = src
            return
        name = ak.aten_name(node.target)
        origin = src.origin or src
        if name == "clone":  # a copy: storage of its own
            value = _Act(src.gid, meta, src.grad, node.name)
        elif src.expanded and name in _RESHAPES:
            # reshaping a broadcast copies it: GQA's repeat_kv (expand + reshape) materializes each key/value
            # head n_heads / n_kv_heads times; what it repeats is kept for kernels that broadcast themselves
            value = _Act(src.gid, meta, src.grad, node.name, unexpanded=src.unexpanded or origin)
        else:  # a view: the same storage, or a part of it (q, k and v split from one projection count apart)
            base = f"{src.storage}/{node.name}" if name in _PARTS else src.storage
            value = _Act(src.gid, meta, src.grad, node.name, base=base,
                         expanded=src.expanded or name in ("expand", "expand_as"), origin=origin,
                         unexpanded=src.unexpanded)
        self.values[node.name] = value
        self.groups[src.gid].views += 1
        last = self.groups[-1] if self.groups else None
        # A leaf module's closing view (Conv1D's `view(*size_out)`) is its output's real shape.
        if last is not None and last.leaf and last.gid == src.gid and meta is not None \
                and _module_info(node)[2] == last.call_key:
            last.output = value

    def _index_node(self, node: fx.Node, acts, meta) -> None:
        _, _, key = _module_info(node)
        last = self.groups[-1] if self.groups else None
        if last is not None and last.kind is OpKind.INDEX and last.call_key == key:
            g = last
        else:
            g = self._new_group(OpKind.INDEX, node, leaf=False)
        g.nodes.append(node)
        for a in acts:
            if a.gid != g.gid and all(a.node != x.node for x in g.inputs):
                g.inputs.append(a)
        g.output = _Act(g.gid, meta, False, node.name)
        self.values[node.name] = g.output

    def _group_for(self, node: fx.Node, kind: OpKind, acts) -> _Group:
        path, _, key = _module_info(node)
        last = self.groups[-1] if self.groups else None
        if path in self.leaf_paths:
            if last is not None and last.leaf and last.call_key == key:
                return last
            return self._new_group(None, node, leaf=True)
        if kind is OpKind.ELEMENTWISE:
            merged = self._merge_pointwise(node, key, acts)
            if merged is not None:
                return merged
        return self._new_group(kind, node, leaf=False)

    def _merge_pointwise(self, node: fx.Node, key: str, acts) -> _Group | None:
        """Join the pointwise regions of this module call that feed `node`, if the union stays convex."""
        cand = {a.gid for a in acts if a.grad and self.groups[a.gid].kind is OpKind.ELEMENTWISE
                and not self.groups[a.gid].leaf and self.groups[a.gid].call_key == key}
        if not cand:
            return None
        start = min(cand)
        others = [a.gid for a in acts if a.gid not in cand]
        others += [i.gid for c in cand for i in self.groups[c].inputs if i.gid not in cand]
        if any(o >= start for o in others):
            return None  # something the region feeds would come back into it: keep it separate
        target = self.groups[start]
        for gid in sorted(cand - {start}, reverse=True):
            self._absorb(target, self.groups[gid])
        return target

    def _absorb(self, target: _Group, g: _Group) -> None:
        target.nodes.extend(g.nodes)
        target.fwd_flops += g.fwd_flops
        target.saved.extend(g.saved)
        target.saves_internal |= g.saves_internal
        target.eager_saved.extend(g.eager_saved)
        target.node_kinds |= g.node_kinds
        target.kernels += g.kernels
        target.kernel_io_numel += g.kernel_io_numel
        target.kernel_io_wide_numel += g.kernel_io_wide_numel
        target.views += g.views
        for a in g.inputs:
            if a.gid != target.gid and all(a.node != x.node for x in target.inputs):
                target.inputs.append(a)
        for n in g.nodes:  # re-point values to the merged region
            v = self.values.get(n.name)
            if isinstance(v, _Act):
                self.values[n.name] = replace(v, gid=target.gid)
        self.values.update({k: replace(v, gid=target.gid) for k, v in self.values.items()
                            if isinstance(v, _Act) and v.gid == g.gid})
        g.kind, g.nodes = OpKind.INDEX, []  # tombstone: removed when ops are built
        g.call_key = f"merged:{g.gid}"
        g.module_path = "<merged>"

    # -- per-node accounting ----------------------------------------------------------------------
    def _add_node(self, g: _Group, node: fx.Node, name: str, kind: OpKind, ins, meta) -> None:
        g.nodes.append(node)
        g.node_kinds.add(kind)
        if kind is OpKind.OTHER:
            g.unknown.append(name)
        acts = [v for v in ins if isinstance(v, _Act)]
        for a in acts:
            if a.gid != g.gid and all(a.node != x.node for x in g.inputs):
                g.inputs.append(a)
        for v in ins:
            if isinstance(v, _Param) and v.fqn not in g.params:
                g.params.append(v.fqn)
        self._account(g, node, name, kind, meta)
        g.kernels += 1
        for a in (*node.all_input_nodes, node):
            n = self._batch_numel(a)
            g.kernel_io_numel += n
            if n and self._wide(a):
                g.kernel_io_wide_numel += n
        g.output = _Act(g.gid, meta, True, node.name)
        self.values[node.name] = g.output

    def _batch_numel(self, node: fx.Node) -> int:
        """Per-sample elements of a value that grows with the batch (0 for parameters and constants)."""
        shape, batch_dims = self.eg.shapes.get(node.name, ((), ()))
        if not batch_dims:
            return 0
        n = 1
        for d in shape:
            n *= d
        return n

    def _wide(self, node: fx.Node) -> bool:
        """A float32 value in a model whose parameters are 16-bit: an upcast (norm statistics, softmax)."""
        val = node.meta.get("val")
        return self.low_precision and isinstance(val, torch.Tensor) and val.dtype == torch.float32

    def _in_shapes(self, node: fx.Node) -> list[tuple[int, ...]]:
        shapes = []
        for a in node.args:
            if isinstance(a, fx.Node):
                if a.name in self.eg.shapes:
                    shapes.append(self.eg.shapes[a.name][0])
                elif isinstance(a.meta.get("val"), torch.Tensor):
                    shapes.append(tuple(int(d) for d in a.meta["val"].shape))
                else:
                    shapes.append(())
        return shapes

    def _account(self, g: _Group, node: fx.Node, name: str, kind: OpKind, meta) -> None:
        shapes = self._in_shapes(node)
        out_shape = meta.shape if meta is not None else ()
        tensor_args = [a for a in node.args if isinstance(a, fx.Node)]
        vals = [self.values.get(a.name, _Const()) for a in tensor_args]
        if kind in (OpKind.LINEAR, OpKind.MATMUL):
            if name == "einsum":
                flops, mnk = einsum_flops(node.args[0], shapes), None
            else:
                flops, mnk = gemm_flops(name, shapes, out_shape)
            # each activation operand is saved for the other operand's gradient (a weight always has one)
            g.saved.extend(v for v in vals if isinstance(v, _Act))
            self._note_gemm(g, flops, mnk)
        elif kind is OpKind.CONV:
            flops, mnk = conv_flops(shapes[0], shapes[1], out_shape)
            g.saved.extend(v for v in vals[:1] if isinstance(v, _Act))
            self._note_gemm(g, flops, mnk)
        elif kind is OpKind.ATTENTION:
            flops = attention_flops(shapes[0], shapes[1], shapes[2])
            g.variant = "masked" if _has_attn_mask(node) else "flash"
            # grouped-query attention: the fused kernels broadcast each key/value head themselves (PyTorch SDPA's
            # enable_gqa, which Hugging Face takes without a mask, transformers sdpa_attention.use_gqa_in_sdpa;
            # FlashAttention-2; Transformer Engine) and keep the n_kv_heads tensors, not repeat_kv's copies
            g.saved.extend((v.unexpanded or v) if i else v for i, v in enumerate(vals[:3]) if isinstance(v, _Act))
            g.saved.append(_Act(g.gid, meta, True, node.name))  # the output
            lse = TensorMeta(shape=out_shape[:-1], dtype="float32", batch_dims=meta.batch_dims if meta else ())
            g.saved.append(_Act(g.gid, lse, False, node.name + ":lse"))
            g.gemm_flops += flops
        elif kind is OpKind.EMBEDDING:
            flops = 0  # a gather: memory traffic, no arithmetic
        else:
            flops = pointwise_flops(out_shape) if out_shape else 0
            self._pointwise_saved(g, name, kind, vals, meta, node)
        g.fwd_flops += flops

    def _note_gemm(self, g: _Group, flops: int, mnk) -> None:
        if flops > g.gemm_flops:
            g.gemm = mnk
        g.gemm_flops += flops

    def _pointwise_saved(self, g: _Group, name, kind, vals, meta, node) -> None:
        grad_acts = [v for v in vals if isinstance(v, _Act) and v.grad]
        mask = None
        if kind is OpKind.DROPOUT and meta is not None:
            mask = _Act(g.gid, TensorMeta(shape=meta.shape, dtype="bool", batch_dims=meta.batch_dims), False,
                        node.name + ":mask")
        divides = name in ("div", "true_divide") and len(vals) > 1 and vals[1] in grad_acts  # d(a/b)/db: a, b
        if name in ak.SAVES_OUTPUT and meta is not None:
            g.eager_saved.append(_Act(g.gid, meta, True, node.name))
        elif name in ak.SAVES_INPUTS or divides or kind in (OpKind.LOSS, OpKind.OTHER):
            g.eager_saved.extend(grad_acts)
        elif name == "mul":  # each factor, where another factor needs a gradient (a parameter does)
            for i, v in enumerate(vals):
                others = vals[:i] + vals[i + 1:]
                if isinstance(v, _Act) and any(isinstance(o, _Param) or (isinstance(o, _Act) and o.grad)
                                               for o in others):
                    g.eager_saved.append(v)
        elif mask is not None:
            g.eager_saved.append(mask)
        keep: list[_Act] = []
        if mask is not None:
            keep.append(mask)
        elif kind is OpKind.SOFTMAX and meta is not None:
            keep.append(_Act(g.gid, meta, True, node.name))
        elif kind is OpKind.NORM:
            keep.extend(grad_acts[:1])
        elif name in ak.NONLINEAR_POINTWISE or (name == "mul" and len(grad_acts) >= 2) or divides \
                or kind in (OpKind.LOSS, OpKind.REDUCTION, OpKind.OTHER):
            keep.extend(grad_acts)
        for v in keep:
            if v.gid == g.gid and not v.node.endswith((":mask",)) and kind is not OpKind.SOFTMAX:
                g.saves_internal = True
            else:
                g.saved.append(v)


def _has_attn_mask(node: fx.Node) -> bool:
    """PyTorch's SDPA only takes its FlashAttention backend without an explicit mask: a mask tensor sends it
    to the memory-efficient kernel (torch.backends.cuda.sdp_kernel docs; FlashAttention supports causal only)."""
    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    return isinstance(mask, fx.Node)


def _flatten(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flatten(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flatten(y)
    else:
        yield x


def _has_float_output(node: fx.Node) -> bool:
    val = node.meta.get("val")
    vals = list(_flatten(val)) if isinstance(val, (list, tuple)) else [val]
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals)
