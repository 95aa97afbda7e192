"""Turn the coarsener's groups into `Op`s: final kind, stable names, FLOPs, saved tensors."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from autoshard.capture import aten_kinds as ak
from autoshard.capture.coarsen import Coarsened, _Act, _Coarsener, _Group
from autoshard.capture.export import ExportedGraph
from autoshard.capture.ir import Op, OpKind, ParamMeta, TensorMeta

__all__ = ["build_ops", "coarsen"]

_KIND_PRIORITY = [OpKind.LINEAR, OpKind.MATMUL, OpKind.CONV, OpKind.EMBEDDING, OpKind.ATTENTION, OpKind.NORM,
                  OpKind.LOSS, OpKind.SOFTMAX, OpKind.DROPOUT, OpKind.REDUCTION, OpKind.OTHER,
                  OpKind.ELEMENTWISE]


def _final_kind(g: _Group) -> OpKind:
    if g.kind is not None and g.kind in (OpKind.INPUT, OpKind.INDEX):
        return g.kind
    kinds = set(g.node_kinds) | ({g.kind} if g.kind is not None else set())
    if g.leaf and "norm" in g.module_type.lower():
        return OpKind.NORM
    for k in _KIND_PRIORITY:
        if k in kinds:
            return k
    return OpKind.OTHER


def build_ops(c: _Coarsener) -> Coarsened:
    live = [g for g in c.groups if not (g.kind is OpKind.INDEX and not g.nodes and g.module_path == "<merged>")]
    names = _op_names(live)
    ops, unknown = [], []
    stored: set[str] = set()  # storages some earlier op already keeps (q/k/v projections share their input)
    for g in live:
        kind = _final_kind(g)
        ops.append(_to_op(c, g, kind, names, stored))
        unknown.extend(g.unknown)
    outputs = tuple(names[gid] for gid in c.outputs if gid in names)
    return Coarsened(ops=tuple(ops), outputs=outputs, unknown=tuple(sorted(set(unknown))))


def _op_names(groups: list[_Group]) -> dict[int, str]:
    names: dict[int, str] = {}
    used: dict[str, int] = {}
    for g in groups:
        if g.kind is OpKind.INPUT:
            base = g.call_key
        elif g.leaf:
            base = g.module_path
        else:
            first = ak.aten_name(g.nodes[0].target) if g.nodes else "op"
            suffix = "index" if g.kind is OpKind.INDEX else first
            base = f"{g.module_path}.{suffix}" if g.module_path else suffix
        n = used.get(base, 0)
        used[base] = n + 1
        names[g.gid] = base if n == 0 else f"{base}_{n}"
    return names


def _to_op(c: _Coarsener, g: _Group, kind: OpKind, names: dict[int, str], stored: set[str]) -> Op:
    ext_inputs = [a for a in g.inputs if a.gid in names and a.gid != g.gid]
    fused = _saved(g, ext_inputs)
    eager = _eager_saves(c, g) if _is_fused(g) else None
    saved_fused = None if eager is None else tuple(a.meta for a in _new(fused, set(stored)))
    saved = _new(eager if eager is not None else fused, stored)
    needs_input_grad = any(a.grad for a in ext_inputs)
    fwd = g.fwd_flops
    if kind is OpKind.LINEAR or kind is OpKind.CONV:
        bwd = (2 if needs_input_grad else 1) * g.gemm_flops + 2 * (fwd - g.gemm_flops)
        fwd = g.gemm_flops  # bias adds are memory traffic, not "matmul FLOPs"
    elif kind in (OpKind.INPUT, OpKind.INDEX):
        bwd = 0
    else:
        bwd = 2 * fwd
    out = g.output.meta if g.output is not None and g.output.meta is not None else TensorMeta(shape=(), dtype="float32")
    params = tuple(ParamMeta(name=p, shape=c.param_shapes[p][0], dtype=c.param_shapes[p][1]) for p in g.params)
    return Op(
        name=names[g.gid], kind=kind, module_path=g.module_path, module_type=g.module_type, layer=None,
        inputs=tuple(names[a.gid] for a in ext_inputs),
        input_meta=tuple(a.meta if a.meta is not None else TensorMeta(shape=(), dtype="float32") for a in ext_inputs),
        output_meta=out, params=params, fwd_flops=int(fwd), bwd_flops=int(bwd),
        saved=tuple(a.meta for a in saved), saved_fused=saved_fused, needs_input_grad=needs_input_grad,
        aten=tuple(ak.aten_name(n.target) for n in g.nodes),
        gemm=g.gemm if kind in (OpKind.LINEAR, OpKind.MATMUL, OpKind.CONV) else None,
        variant=g.variant if kind is OpKind.ATTENTION else "",
        kernels=g.kernels, kernel_io_numel=g.kernel_io_numel, kernel_io_wide_numel=g.kernel_io_wide_numel,
        views=g.views,
    )


def _new(acts: list[_Act], stored: set[str]) -> list[_Act]:
    """`acts` with a shape, less the storages an earlier op keeps: autograd holds a tensor once however many ops
    save it."""
    out = []
    for a in acts:
        if a.meta is not None and a.storage not in stored:
            stored.add(a.storage)
            out.append(a)
    return out


def _eager_saves(c: _Coarsener, g: _Group) -> list[_Act]:
    """What eager autograd keeps for a region of pointwise ops PyTorch runs one by one (Hugging Face's
    LlamaRMSNorm: its float32 upcast, the inverse RMS and the normalized value; transformers' `gelu_new`: the
    input, tanh's output and both factors of the last product), each op by its derivative's rule
    (aten_kinds.SAVES_OUTPUT / SAVES_INPUTS, mul's factors). Float32 values of a 16-bit model are `wide`.
    Measured with torch.autograd.graph.saved_tensors_hooks (tests/test_capture_memory.py)."""
    out = []
    for a in g.eager_saved:
        if a.meta is not None and c.low_precision and a.meta.dtype == "float32":
            a = replace(a, meta=replace(a.meta, wide=True))
        out.append(a)
    return out


def _is_fused(g: _Group) -> bool:
    """A region whose fused kernel would keep less than eager autograd does (its inputs, not intermediates)."""
    return g.saves_internal and g.kind not in (OpKind.LINEAR, OpKind.MATMUL)


def _saved(g: _Group, ext_inputs: list[_Act]) -> list[_Act]:
    """Saved tensors, de-duplicated; a fused pointwise region that would save an intermediate keeps its
    gradient-path inputs instead (a fused kernel recomputes the intermediate from them)."""
    out: list[_Act] = []
    seen: set[str] = set()
    extra = [a for a in ext_inputs if a.grad] if _is_fused(g) else []
    for a in [*g.saved, *extra]:
        if a.node in seen or a.meta is None:
            continue
        seen.add(a.node)
        out.append(a)
    return out


def coarsen(eg: ExportedGraph, model: nn.Module) -> Coarsened:
    """The exported graph as the planner's operators: grouped by coarsen.py, then built into `Op`s here."""
    c = _Coarsener(eg, model)
    c.run()
    return build_ops(c)
