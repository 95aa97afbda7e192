"""Semantic parameter placements (S(out), S(in)) as the tensor dims they shard, per operator.

Two ops sharing one parameter (a tied embedding and LM head) name its dims differently: the embedding's
vocabulary dim is its input dim, the head's is its output dim. Comparing physical dims is what tells whether
their placements agree.
"""

from __future__ import annotations

from autoshard.capture.ir import Op, OpKind, ParamMeta
from autoshard.plans.layouts import IN, OUT, Layout
from autoshard.plans.plan import OpStrategy

__all__ = ["param_dims", "physical_layout", "physical_key"]


def param_dims(op: Op, param: ParamMeta) -> tuple[int, int]:
    """(output-feature dim, input-feature dim) of `param` in `op`."""
    if len(param.shape) < 2:
        return 0, 0
    if op.kind is OpKind.EMBEDDING:
        return 1, 0
    if op.gemm is not None:
        n, k = op.gemm[1], op.gemm[2]
        if param.shape[0] == n and (param.shape[-1] == k or param.shape[0] != k):
            return 0, 1
        return len(param.shape) - 1, 0
    return 0, 1


def physical_layout(op: Op, param: ParamMeta, lay: Layout) -> tuple[tuple[str, int], ...]:
    out_dim, in_dim = param_dims(op, param)
    return tuple((a, out_dim if p == OUT else in_dim) for a, p in lay.items if p in (OUT, IN))


def physical_key(op: Op, st: OpStrategy, pname: str) -> tuple:
    """What must be equal between two ops sharing parameter `pname`."""
    param = next(p for p in op.params if p.name == pname)
    pp = next(p for p in st.params if p.name == pname)
    return (physical_layout(op, param, pp.storage), physical_layout(op, param, pp.compute), st.zero, st.split)
