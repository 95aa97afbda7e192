"""Hand-given configurations (Megatron-LM / DeepSpeed style) as assignments over the planner's strategies.

`megatron_assignment` reproduces what Megatron-LM does on a (dp, tp) mesh: Linears that read the replicated
residual stream are column-parallel, Linears that read a column-parallel result (attention heads, the MLP's
activation) are row-parallel; attention splits heads; everything on the residual stream is replicated, or
sequence-sharded with sequence parallelism; the token embedding is vocabulary-parallel. Strategies are picked
from `strategies_in`, so a hand configuration is priced by exactly the functions the planner optimizes.
"""

from __future__ import annotations

from autoshard.capture.cache import graph_cache
from autoshard.capture.ir import OpGraph, OpKind
from autoshard.cost_models.template import template_for
from autoshard.errors import ConfigurationError
from autoshard.plans.layouts import FEAT, REPLICATE, SEQ, Layout, MeshSpec
from autoshard.plans.plan import OpStrategy, PipelineSpec
from autoshard.plans.strategies import fits, rebind, strategies_in, with_dp

__all__ = ["megatron_assignment", "tp_origins"]

_ORIGIN_TP_KINDS = (OpKind.ATTENTION, OpKind.MATMUL)
_ORIGIN_REP_KINDS = (OpKind.NORM, OpKind.EMBEDDING, OpKind.INPUT, OpKind.INDEX, OpKind.CONV, OpKind.LOSS,
                     OpKind.REDUCTION, OpKind.OTHER)


def tp_origins(graph: OpGraph) -> dict[str, str]:
    """'tp' for ops whose output is split by heads / hidden under Megatron, 'rep' for the residual stream."""
    origin: dict[str, str] = {}
    for op in graph.ops:
        ins = [origin[s] for s in op.inputs if graph.op(s).kind not in (OpKind.INDEX, OpKind.INPUT)]
        if op.kind is OpKind.LINEAR:
            origin[op.name] = "rep" if ins and all(x == "tp" for x in ins) else "tp"  # row -> reduced
        elif op.kind in _ORIGIN_TP_KINDS:
            origin[op.name] = "tp" if "tp" in ins else "rep"
        elif op.kind in _ORIGIN_REP_KINDS:
            origin[op.name] = "rep"
        else:
            origin[op.name] = "tp" if ins and all(x == "tp" for x in ins) else "rep"
    return origin


def _linear_role(graph: OpGraph, origin: dict[str, str], name: str) -> str:
    op = graph.op(name)
    ins = [origin[s] for s in op.inputs if graph.op(s).kind not in (OpKind.INDEX, OpKind.INPUT)]
    return "row" if ins and all(x == "tp" for x in ins) else "col"


def _pick(cands: list[OpStrategy], *, name: str | None = None, output: Layout | None = None) -> OpStrategy | None:
    for st in cands:
        if (name is None or st.name == name) and (output is None or st.output == output):
            return st
    return None


def megatron_assignment(graph: OpGraph, mesh: MeshSpec, micro_batch: int, *, sequence_parallel: bool = False,
                        zero: int = 0, regather: bool = True) -> dict[str, OpStrategy]:
    """Megatron-LM's layout of every planned op on `mesh` (axes among pp, dp, tp).

    `regather` (with `sequence_parallel`): each column-parallel Linear keeps its input's sequence shard for
    backward and gathers it again there (`col+sp`: Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication,
    Korthikanti et al. 2022 sec. 4.2.2). False: the shard is gathered once where it is produced, for every
    column-parallel Linear that reads it (q, k and v; gate and up), and kept gathered for backward (`col`:
    torchtitan's PrepareModuleInput on attention and feed-forward, autoshard's runtime for `col` Linears,
    `runtime/specs.py`), its gradient summed over them before one reduce-scatter."""
    origin = _origins(graph)
    tp = mesh.degree("tp")
    tg, _ = template_for(graph, PipelineSpec())
    chosen: dict[str, OpStrategy] = {}
    for op in tg.ops:
        cands = strategies_in(graph, op, mesh, micro_batch, zero_options=(zero,))
        cands = [c for c in cands if c.split == 1]
        st = _choose(graph, op, cands, origin, mesh, micro_batch, sequence_parallel and tp > 1, regather)
        tied = next((chosen[o] for o in chosen if op.kind is OpKind.EMBEDDING and _shares_param(graph, o, op)),
                    None)
        if tied is not None:  # one storage for a tied embedding (BART's encoder and decoder tokens)
            st = _pick(cands, name=tied.name) or st
        if st is None:
            raise ConfigurationError(
                f"no Megatron-style strategy fits {op.name} ({op.kind.value}, output {op.output_meta.shape}) "
                f"with tp={tp} and micro-batch {micro_batch}; check that tp divides the heads, hidden and "
                "vocabulary sizes")
        chosen[op.name] = st
    return {real: (chosen[t] if real == t else rebind(chosen[t], graph.op(real)))
            for real, t in tg.to_template.items() if t in chosen}


def _shares_param(graph: OpGraph, other: str, op) -> bool:
    names = {p.name for p in graph.op(other).params}
    return any(p.name in names for p in op.params)


def _origins(graph: OpGraph) -> dict[str, str]:
    cache = graph_cache(graph)
    if "origins" not in cache:
        cache["origins"] = tp_origins(graph)
    return cache["origins"]


def _choose(graph, op, cands, origin, mesh, micro_batch, sp, regather):
    if mesh.degree("tp") == 1:
        return _pick(cands)
    if op.kind in (OpKind.LINEAR, OpKind.CONV):
        role = _linear_role(graph, origin, op.name)
        if role == "col":
            return _pick(cands, name="col+sp" if sp and regather else "col") or _pick(cands, name="col") or \
                _pick(cands, name="replicate")
        return _pick(cands, name="row") or _pick(cands, name="replicate")
    if op.kind is OpKind.EMBEDDING:
        token = any(graph.op(s).kind is OpKind.INPUT for s in op.inputs)
        return (_pick(cands, name="vocab") if token else None) or _pick(cands, name="replicate")
    tp_place = FEAT if origin[op.name] == "tp" else (SEQ if sp else REPLICATE)
    want = with_dp(Layout() if tp_place == REPLICATE else Layout((("tp", tp_place),)), mesh)
    if tp_place == SEQ and not all(fits(m, want, mesh, micro_batch) for m in (*op.input_meta, op.output_meta)
                                   if m.batch_dims):
        want = with_dp(Layout(), mesh)
    return _pick(cands, output=want) or _pick(cands, output=with_dp(Layout(), mesh))
