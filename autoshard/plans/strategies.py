"""Candidate strategies of each operator on a mesh, as layouts on named axes.

Every family is a choice of *role* per mesh axis; costs follow from the roles (see `opcost.py`):

- `dp` axis: the batch is sharded (`S(batch)`); parameters replicated (ZeRO 0) or sharded (ZeRO 1/2/3, with
  OSDP operator splitting for ZeRO 3).
- 1D (`tp`): Megatron column-parallel Linear (weight `S(out)`, input `R`, output `S(feat)`) and row-parallel
  (weight `S(in)`, input `S(feat)`, output `P`); attention split by heads; norms and pointwise ops
  replicated (`R`), sequence-parallel (`S(seq)`) or statistics-parallel over a sharded hidden dim (`S(feat)`).
- 2D (`tp_r, tp_c`, Optimus/SUMMA on q x q): activations blocked (`tp_r: S(batch), tp_c: S(feat)`); each
  Linear gathers its input over tp_c and its weight over tp_r (stored `tp_r: S(in), tp_c: S(out)`), keeps only
  the shards for backward, and produces the blocked layout again.
- 3D (`tp_x, tp_y, tp_z`, Bian et al. 2021): tp_x holds the batch with weights stored sharded over it;
  a Linear is column-parallel on one of tp_y/tp_z and row-parallel on the other, its partial output
  reduce-scattered onto the batch; consecutive Linears swap the two roles.
- On 2D and 3D meshes a Linear may instead run 1D over all tensor-parallel axes, so the ILP chooses 1D, 2D or
  3D per operator. Pointwise ops follow their producer: they get one strategy per layout in the mesh's
  layout vocabulary and the edge costs make them agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autoshard.capture.ir import Op, OpGraph, OpKind, TensorMeta
from autoshard.plans.contract import projection_head_slices, tp_replicated_ops
from autoshard.plans.layouts import BATCH, FEAT, IN, OUT, PARTIAL, REPLICATE, SEQ, Layout, MeshSpec
from autoshard.plans.layouts import layout as _lay
from autoshard.plans.plan import OpStrategy, ParamPlacement

__all__ = ["TPOption", "linear_tp_options", "layout_vocabulary", "strategies_for", "strategies_in", "fits", "feat_dim", "seq_dim",
           "PLANNED_KINDS", "ZERO_OPTIONS", "SPLIT_OPTIONS", "dp_options", "with_dp", "no_batch", "rebind", "same_strategy"]

# Ops off the gradient path (inputs, masks) have no strategy: every rank computes them locally.
PLANNED_KINDS = tuple(k for k in OpKind if k not in (OpKind.INPUT, OpKind.INDEX))
ZERO_OPTIONS = (0, 1, 2, 3)  # sharded-DP levels: replicated, optimizer states, + gradients, + parameters
SPLIT_OPTIONS = (1, 2, 4)  # OSDP operator splitting of ZeRO-3 Linears


@dataclass(frozen=True)
class TPOption:
    """A Linear's roles on the tensor-parallel axes."""

    name: str
    input: Layout
    w_compute: Layout
    w_storage: Layout
    output: Layout
    save_sharded_input: bool = False


def linear_tp_options(mesh: MeshSpec) -> list[TPOption]:
    tp = mesh.tp_axes
    if not tp:
        return [TPOption("replicate", Layout(), Layout(), Layout(), Layout())]
    every = {a: FEAT for a in tp}
    opts = [
        TPOption("col", Layout(), _lay(**{a: OUT for a in tp}), _lay(**{a: OUT for a in tp}), _lay(**every)),
        TPOption("row", _lay(**every), _lay(**{a: IN for a in tp}), _lay(**{a: IN for a in tp}),
                 _lay(**{a: PARTIAL for a in tp})),
        TPOption("replicate", Layout(), Layout(), Layout(), Layout()),
        # data parallel over the tensor-parallel axes: for a Linear that cannot be split (an odd vocabulary)
        TPOption("batch", _lay(**{a: BATCH for a in tp}), Layout(), Layout(), _lay(**{a: BATCH for a in tp})),
    ]
    if tp == ("tp",):
        opts.insert(1, TPOption("col+sp", Layout(), _lay(tp=OUT), _lay(tp=OUT), _lay(tp=FEAT), True))
    if tp == ("tp_r", "tp_c"):
        opts.append(TPOption("2d", _lay(tp_r=BATCH), _lay(tp_c=OUT), _lay(tp_r=IN, tp_c=OUT),
                             _lay(tp_r=BATCH, tp_c=FEAT), True))
    if tp == ("tp_x", "tp_y", "tp_z"):
        opts.append(TPOption("3d-yz", _lay(tp_x=BATCH, tp_z=FEAT), _lay(tp_y=OUT, tp_z=IN),
                             _lay(tp_x=OUT, tp_y=OUT, tp_z=IN), _lay(tp_x=BATCH, tp_y=FEAT, tp_z=PARTIAL)))
        opts.append(TPOption("3d-zy", _lay(tp_x=BATCH, tp_y=FEAT), _lay(tp_y=IN, tp_z=OUT),
                             _lay(tp_x=OUT, tp_y=IN, tp_z=OUT), _lay(tp_x=BATCH, tp_y=PARTIAL, tp_z=FEAT)))
    return opts


# Ops that mix positions along the sequence cannot run on a sequence shard; reductions of unknown shape and
# unknown ops are kept off the feature dim too.
_NO_SEQ = (OpKind.ATTENTION, OpKind.MATMUL)
_BATCH_ONLY = (OpKind.REDUCTION, OpKind.LOSS, OpKind.OTHER)


def layout_vocabulary(mesh: MeshSpec) -> list[Layout]:
    """Layouts a pointwise op may compute in: what Linears consume and produce (partial sums resolved to the
    batch or replicated), plus sequence parallelism on a 1D mesh. The dp axis is added by the caller."""
    vocab: list[Layout] = [Layout()]
    for opt in linear_tp_options(mesh):
        for lay in (opt.input, opt.output):
            for resolved in {lay.with_(a, BATCH) for a, p in lay.items if p == PARTIAL} | \
                    {_resolve_partial(lay, REPLICATE)}:
                if resolved not in vocab:
                    vocab.append(resolved)
    if mesh.tp_axes == ("tp",):
        vocab.append(_lay(tp=SEQ))
    return vocab


def _resolve_partial(lay: Layout, placement: str) -> Layout:
    out = lay
    for a, p in lay.items:
        if p == PARTIAL:
            out = out.with_(a, placement)
    return out


def with_dp(lay: Layout, mesh: MeshSpec) -> Layout:
    return lay.with_("dp", BATCH) if "dp" in mesh.names else lay


# -- divisibility ---------------------------------------------------------------------------------------
def feat_dim(meta: TensorMeta) -> int:
    """The dim `S(feat)` shards: heads (dim 1) of (B, nh, S, hd) / (B, C, H, W) tensors, else the last dim."""
    return 1 if len(meta.shape) == 4 else len(meta.shape) - 1


def seq_dim(meta: TensorMeta) -> int | None:
    if len(meta.shape) == 3:
        return 1
    if len(meta.shape) == 4:
        return 2
    return None


def fits(meta: TensorMeta, lay: Layout, mesh: MeshSpec, micro_batch: int) -> bool:
    """Can `meta` (per sample) be split as `lay` evenly for a micro-batch of `micro_batch` samples?"""
    if not meta.shape:
        return True
    batch_deg = feat_deg = seq_deg = 1
    for axis, pl in lay.items:
        if axis == "dp":  # the micro-batch is per data-parallel replica
            continue
        d = mesh.degree(axis)
        if pl == BATCH:
            batch_deg *= d
        elif pl == FEAT:
            feat_deg *= d
        elif pl == SEQ:
            seq_deg *= d
    if batch_deg > 1 and (not meta.batch_dims or micro_batch % batch_deg):
        return False
    fd = meta.shape[feat_dim(meta)]
    if feat_deg > 1 and fd != 1 and fd % feat_deg:  # a dim of 1 broadcasts (an attention mask's head dim)
        return False
    sd = seq_dim(meta)
    return not (seq_deg > 1 and (sd is None or meta.shape[sd] % seq_deg))


def _param_dims_ok(shape: tuple[int, ...], lay: Layout, mesh: MeshSpec, out_dim: int, in_dim: int) -> bool:
    out_deg = in_deg = 1
    for axis, pl in lay.items:
        if pl == OUT:
            out_deg *= mesh.degree(axis)
        elif pl == IN:
            in_deg *= mesh.degree(axis)
    return shape[out_dim] % out_deg == 0 and (in_deg == 1 or shape[in_dim] % in_deg == 0)


# -- per op kind ---------------------------------------------------------------------------------------
def dp_options(op: Op, mesh: MeshSpec, zero_options=ZERO_OPTIONS) -> list[tuple[int, int]]:
    """(zero, split) pairs for an op that owns parameters; ops without parameters get (0, 1)."""
    if not op.params or mesh.degree("dp") == 1:
        return [(0, 1)]
    out = []
    for z in zero_options:
        # operator splitting slices an nn.Linear's weight; a stack of experts (3-D) is not split
        splittable = op.kind is OpKind.LINEAR and all(len(p.shape) <= 2 for p in op.params)
        splits = SPLIT_OPTIONS if z == 3 and splittable else (1,)
        out += [(z, s) for s in splits if s == 1 or (op.gemm and op.gemm[2] % s == 0)]
    return out


def _linear_params(op: Op, opt: TPOption, mesh: MeshSpec) -> tuple[ParamPlacement, ...] | None:
    """Weight gets the option's placements; a bias follows the output features (replicated if row).
    The weight comes first: cost functions read the op's split from `params[0]`."""
    n, k = (op.gemm[1], op.gemm[2]) if op.gemm else (0, 0)
    out = []
    for p in sorted(op.params, key=lambda p: -len(p.shape)):
        if len(p.shape) >= 2:
            out_dim = 0 if p.shape[0] == n and (p.shape[-1] == k or p.shape[0] != k) else len(p.shape) - 1
            in_dim = 1 - out_dim if len(p.shape) == 2 else 1
            for lay in (opt.w_compute, opt.w_storage):
                if not _param_dims_ok(p.shape, lay, mesh, out_dim, in_dim):
                    return None
            out.append(ParamPlacement(name=p.name, compute=opt.w_compute, storage=opt.w_storage))
        else:
            bias = _lay(**{a: OUT for a, pl in opt.w_compute.items if pl == OUT})
            if not _param_dims_ok(p.shape, bias, mesh, 0, 0):
                return None
            out.append(ParamPlacement(name=p.name, compute=bias, storage=bias))
    return tuple(out)


def _out_degree(lay: Layout, mesh: MeshSpec) -> int:
    return math.prod(mesh.degree(a) for a, p in lay.items if p == OUT)


def _linear_strategies(op: Op, mesh: MeshSpec, micro_batch: int, zero_options,
                       head_slices: int = 0) -> list[OpStrategy]:
    found = []
    for opt in linear_tp_options(mesh):
        if head_slices and head_slices % _out_degree(opt.w_compute, mesh):
            continue  # a column split must cut whole heads (contract.py), on all axes that split them together
        ins = with_dp(opt.input, mesh)
        outl = with_dp(opt.output, mesh)
        if not all(fits(m, ins, mesh, micro_batch) for m in op.input_meta):
            continue
        if not fits(op.output_meta, _resolve_partial(outl, REPLICATE), mesh, micro_batch):
            continue
        params = _linear_params(op, opt, mesh)
        if params is None:
            continue
        for zero, split in dp_options(op, mesh, zero_options):
            found.append(OpStrategy(name=opt.name, inputs=tuple(ins for _ in op.inputs), output=outl,
                                    params=params, zero=zero, split=split,
                                    save_sharded_input=opt.save_sharded_input))
    return found


_SWAP = {OUT: IN, IN: OUT}
_EMBEDDING_NAME = {"col": "vocab", "col+sp": None, "row": "col"}  # what each Linear option is for a lookup


def _mirror(lay: Layout) -> Layout:
    return Layout(tuple((a, _SWAP.get(p, p)) for a, p in lay.items))


def _embedding_options(mesh: MeshSpec) -> list[tuple[str, Layout, Layout, Layout, Layout]]:
    """An embedding lookup is one-hot(ids) @ W with W (vocab, hidden): a Linear with its dims swapped. Each
    Linear option gives one lookup option whose weight sits on the same tensor dims, so a tied embedding and
    LM head can always agree: (name, ids layout, weight compute, weight storage, output layout)."""
    out = []
    for opt in linear_tp_options(mesh):
        name = _EMBEDDING_NAME.get(opt.name, opt.name)
        if name is None:
            continue
        w_c, w_s = _mirror(opt.w_compute), _mirror(opt.w_storage)
        ids = _lay(**{a: BATCH for a, p in opt.input.items if p == BATCH})
        res = {a: (PARTIAL if p == IN else FEAT) for a, p in w_c.items}
        res.update({a: BATCH for a, p in ids.items})
        out.append((name, ids, w_c, w_s, _lay(**res)))
    return out


def _embedding_strategies(op: Op, mesh: MeshSpec, micro_batch: int, zero_options) -> list[OpStrategy]:
    w = op.params[0]
    found = []
    for name, ids_l, w_c, w_s, outl in _embedding_options(mesh):
        if not (_param_dims_ok(w.shape, w_c, mesh, 1, 0) and _param_dims_ok(w.shape, w_s, mesh, 1, 0)):
            continue
        outl = with_dp(outl, mesh)
        if not fits(op.output_meta, _resolve_partial(outl, REPLICATE), mesh, micro_batch):
            continue
        ids = with_dp(ids_l, mesh) if op.input_meta else Layout()
        for zero, split in dp_options(op, mesh, zero_options):
            found.append(OpStrategy(name=name, inputs=tuple(ids for _ in op.inputs), output=outl,
                                    params=(ParamPlacement(name=w.name, compute=w_c, storage=w_s),),
                                    zero=zero, split=split))
    return found


def _follow_strategies(op: Op, mesh: MeshSpec, micro_batch: int, zero_options) -> list[OpStrategy]:
    """One strategy per layout of the vocabulary that fits every tensor of the op."""
    found = []
    for base in layout_vocabulary(mesh):
        placements = {p for _, p in base.items}
        if op.kind in _NO_SEQ and SEQ in placements:
            continue
        if op.kind in _BATCH_ONLY and placements - {BATCH}:
            continue
        lay = with_dp(base, mesh)
        metas = [op.output_meta, *op.input_meta]
        if not all(fits(m, lay if m.batch_dims else no_batch(lay), mesh, micro_batch) for m in metas):
            continue
        params = []
        for p in op.params:  # norm weights follow the hidden dim
            pl = _lay(**{a: OUT for a, x in base.items if x == FEAT})
            if not _param_dims_ok(p.shape, pl, mesh, 0, 0):
                break
            params.append(ParamPlacement(name=p.name, compute=pl, storage=pl))
        else:
            name = _follow_name(base)
            for zero, split in dp_options(op, mesh, zero_options):
                found.append(OpStrategy(name=name, inputs=tuple(lay for _ in op.inputs), output=lay,
                                        params=tuple(params), zero=zero, split=split))
    return found


def no_batch(lay: Layout) -> Layout:
    """Tensors without a batch dim (position embeddings) are replicated where the layout shards the batch."""
    out = lay
    for a, p in lay.items:
        if p == BATCH:
            out = out.with_(a, REPLICATE)
    return out


def _follow_name(lay: Layout) -> str:
    if not lay.items:
        return "replicate"
    return "+".join(f"{a}:{p}" for a, p in lay.items)


def rebind(st: OpStrategy, op: Op) -> OpStrategy:
    """`st` (chosen for another instance of the same block op) with `op`'s own parameter names."""
    if not st.params:
        return st
    ordered = sorted(op.params, key=lambda p: -len(p.shape))
    return replace(st, params=tuple(replace(pp, name=p.name) for pp, p in zip(st.params, ordered, strict=True)))


def same_strategy(a: OpStrategy, b: OpStrategy) -> bool:
    """Equal up to parameter names (instances of one block op)."""
    return replace(a, params=tuple(replace(p, name="") for p in a.params)) == \
        replace(b, params=tuple(replace(p, name="") for p in b.params))


def _tp_replicated(st: OpStrategy) -> bool:
    layouts = [*st.inputs, st.output, *(x for p in st.params for x in (p.compute, p.storage))]
    return all(axis == "dp" for lay in layouts for axis, _ in lay.items)


def strategies_in(graph: OpGraph, op: Op, mesh: MeshSpec, micro_batch: int, *,
                  zero_options=ZERO_OPTIONS) -> list[OpStrategy]:
    """`strategies_for` with what the runtime allows `op` of `graph` (contract.py): whole heads for a
    projection, replicated on the tensor-parallel axes for a mixture-of-experts layer's experts and router."""
    return strategies_for(op, mesh, micro_batch, zero_options=zero_options,
                          head_slices=projection_head_slices(graph).get(op.name, 0),
                          tp_replicated=op.name in tp_replicated_ops(graph))


def strategies_for(op: Op, mesh: MeshSpec, micro_batch: int, *, zero_options=ZERO_OPTIONS,
                   head_slices: int = 0, tp_replicated: bool = False) -> list[OpStrategy]:
    """Every candidate strategy of `op` on `mesh`; empty for ops that are not planned (inputs, masks).
    `head_slices`: the number of head-sized slices of a projection's output (contract.projection_head_slices;
    0 for none): the product of the degrees splitting its output features must divide it. `tp_replicated`:
    only the strategies replicated on every tensor-parallel axis."""
    if op.kind not in PLANNED_KINDS:
        return []
    if tp_replicated:
        return [st for st in strategies_for(op, mesh, micro_batch, zero_options=zero_options) if _tp_replicated(st)]
    if op.kind is OpKind.CONV and op.gemm is not None:
        # no channel-parallel convolution in the runtime: replicated on the tensor-parallel axes (contract.py)
        return [st for st in _linear_strategies(op, mesh, micro_batch, zero_options) if _tp_replicated(st)]
    if op.kind is OpKind.LINEAR and op.gemm is not None:
        return _linear_strategies(op, mesh, micro_batch, zero_options, head_slices)
    if op.kind is OpKind.EMBEDDING and op.params:
        return _embedding_strategies(op, mesh, micro_batch, zero_options)
    return _follow_strategies(op, mesh, micro_batch, zero_options)
