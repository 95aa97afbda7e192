"""The template graph the ILP is written on: repeated blocks folded into one, edges merged with multiplicities.

Block k of a group behaves like block 0, so the ILP has one set of variables per block *type*. An edge of
the real graph maps to a template edge (producer's template op -> consumer's template op, input index);
edges that map to the same template edge merge and count how many real edges they stand for, per pipeline
stage. The recurrent edge from block k-1 into block k is one template edge standing for count-1 real ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autoshard.capture.cache import graph_cache
from autoshard.capture.ir import Op, OpGraph, TensorMeta
from autoshard.plans.contract import tp_replicated_ops
from autoshard.plans.plan import PipelineSpec
from autoshard.plans.strategies import PLANNED_KINDS

__all__ = ["TemplateEdge", "TemplateGraph", "build_template", "template_for", "planned_edges", "stage_of"]


def planned_edges(graph: OpGraph):
    """(producer, consumer, input index, meta) for every activation edge the planner prices."""
    for op in graph.ops:
        if op.kind not in PLANNED_KINDS:
            continue
        for i, (src, meta) in enumerate(zip(op.inputs, op.input_meta, strict=True)):
            if graph.op(src).kind in PLANNED_KINDS:
                yield src, op.name, i, meta


def stage_of(graph: OpGraph, pipe: PipelineSpec) -> dict[str, int]:
    """Pipeline chunk of every op: blocks by `stage_layers`, ops before the blocks in the first chunk,
    after them in the last. Chunk c runs on stage c mod degree."""
    chunks = pipe.degree * pipe.virtual_stages
    if chunks == 1 or not pipe.stage_layers:
        return {op.name: 0 for op in graph.ops}
    layer_chunk = {}
    for c, (lo, hi) in enumerate(pipe.stage_layers):
        for layer in range(lo, hi):
            layer_chunk[layer] = c
    out, seen_block = {}, False
    for op in graph.ops:
        if op.layer is not None:
            seen_block = True
            out[op.name] = layer_chunk[op.layer]
        else:
            out[op.name] = chunks - 1 if seen_block else 0
    return out



@dataclass
class TemplateEdge:
    src: str
    dst: str
    index: int
    meta: TensorMeta
    per_stage: list[int]  # real edges per pipeline stage (by consumer)
    # recomputed with the block under full recompute: both ends in one repeated block and the producer before
    # the block's last op that keeps a tensor for backward. The runtime's checkpoint (torch's non-reentrant
    # one) stops recomputing once every kept tensor is back, so what that op's output feeds, its output's
    # redistribution included, does not run again (measured: a Megatron 1D Llama under full recompute
    # all-reduces o_proj's output again, not down_proj's)
    in_block: bool
    fanout: int = 1  # planned consumer inputs reading the producer (edge_cost's `share` is 1 / fanout)
    # of those, the ones that may hand back a partial gradient: all but ops the runtime keeps replicated on
    # the tensor-parallel axes (contract.tp_replicated_ops), whose gradients come back whole (`grad_share`)
    grad_fanout: int = 1

    @property
    def shares(self) -> dict[str, float]:
        """edge_cost's `share` and `grad_share` of this edge."""
        return {"share": 1 / self.fanout, "grad_share": 1 / self.grad_fanout}


@dataclass
class TemplateGraph:
    ops: list[Op]
    per_stage: dict[str, list[int]]  # template op -> real instances per stage
    edges: list[TemplateEdge]
    outputs: list[str]  # template ops whose outputs leave the model
    to_template: dict[str, str]  # real op -> template op
    firsts: set[str] = field(default_factory=set)  # template ops that open a block


def template_for(graph: OpGraph, pipe: PipelineSpec) -> tuple[TemplateGraph, dict[str, int]]:
    """(template graph, stage of every op) for `pipe`, memoized per graph."""
    cache = graph_cache(graph)
    key = ("template", pipe.degree, pipe.virtual_stages, pipe.stage_layers)
    if key not in cache:
        stage = {n: c % pipe.degree for n, c in stage_of(graph, pipe).items()}
        cache[key] = (build_template(graph, stage, pipe.degree), stage)
    return cache[key]


def build_template(graph: OpGraph, stage_of_op: dict[str, int], num_stages: int) -> TemplateGraph:
    to_t: dict[str, str] = {}
    for group in graph.blocks:
        for names in group.op_names:
            for j, n in enumerate(names):
                to_t[n] = group.op_names[0][j]
    for op in graph.ops:
        to_t.setdefault(op.name, op.name)
    per_stage: dict[str, list[int]] = {}
    for op in graph.ops:
        if op.kind not in PLANNED_KINDS:
            continue
        counts = per_stage.setdefault(to_t[op.name], [0] * num_stages)
        counts[stage_of_op[op.name]] += 1
    ops = [graph.op(n) for n in per_stage]
    edges: dict[tuple[str, str, int], TemplateEdge] = {}
    all_edges = list(planned_edges(graph))
    position = {op.name: i for i, op in enumerate(graph.ops)}
    last_keeper: dict[int, int] = {}  # layer -> position of its last op that keeps a tensor for backward
    for i, op in enumerate(graph.ops):
        if op.layer is not None and op.saved:
            last_keeper[op.layer] = i
    # the runtime redistributes a producer's whole output once, to the layout its consumers want, before any
    # of them reads it (runtime/tensor_parallel.py); a consumer reading views of it (rotary embedding's halves
    # of q) reads from that one redistribution: every edge prices the producer's output, shared by all inputs
    consumers: dict[str, int] = {}
    partial_consumers: dict[str, int] = {}
    replicated = tp_replicated_ops(graph)
    for src, dst, _, _ in all_edges:
        consumers[src] = consumers.get(src, 0) + 1
        partial_consumers[src] = partial_consumers.get(src, 0) + (dst not in replicated)
    for src, dst, i, _ in all_edges:
        key = (to_t[src], to_t[dst], i)
        e = edges.get(key)
        if e is None:
            same_block = graph.op(src).layer is not None and graph.op(src).layer == graph.op(dst).layer \
                and position[src] < last_keeper.get(graph.op(src).layer, -1)
            e = edges[key] = TemplateEdge(src=key[0], dst=key[1], index=i, meta=graph.op(src).output_meta,
                                          per_stage=[0] * num_stages, in_block=same_block,
                                          fanout=consumers[src], grad_fanout=max(1, partial_consumers[src]))
        e.per_stage[stage_of_op[dst]] += 1
    outputs = sorted({to_t[n] for n in graph.outputs})
    firsts = {group.op_names[0][0] for group in graph.blocks}
    return TemplateGraph(ops=ops, per_stage=per_stage, edges=list(edges.values()), outputs=outputs,
                         to_template=to_t, firsts=firsts)
