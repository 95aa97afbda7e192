"""What the runtime can run, stated once: the planner offers only plans that pass these checks, `estimate`
rejects a hand-given configuration that fails one, and the runtime raises the same reason when handed a plan
that does not (a plan file from elsewhere, an edited one).

- Tensor parallelism splits attention by heads: every head count the model's attention reads (query heads
  and, with grouped-query or multi-query attention, key/value heads), and the number of head-sized slices of
  every projection in a block (a fused q/k/v), must divide by the degree of every tensor-parallel axis that
  splits them (Megatron-LM: `--tensor-model-parallel-size` must divide
  `--num-query-groups`). A degree that does not divide is never offered.
- Pipeline stages are cut from the captured graph's one list of repeated blocks: chunk 0 also holds what
  runs before the blocks, the last chunk what runs after them. The runtime enters a later chunk through
  the model's own forward with `inputs_embeds=` (every decoder in `transformers` takes it), or through the
  explicit description of one of autoshard's own test models; a model with two block lists (an encoder and
  a decoder) or none, whose list holds blocks that differ from the others (RWKV's first block has an extra
  LayerNorm, DeepSeek-V3's first layers are dense), or whose forward takes no `inputs_embeds`, is not pipelined.
- Mixture-of-experts layers: the grouped expert matmul `grouped_mm` of `transformers` has no DTensor
  sharding rule in fp32 (its meta kernel takes only bf16), so the experts module's forward always runs on
  plain tensors: on a tensor-parallel mesh it takes this rank's tokens out of DTensor, replicated on the
  tensor-parallel axes, and every op of the experts module is planned replicated there (`tp_replicated_ops`).
  Expert parallelism (runtime/expert_parallel.py) spreads the experts of every MoE layer over ep consecutive
  ranks of the dp group (at one tensor-parallel position), ep dividing dp and the experts per layer; not
  with context parallelism. No pipeline is offered for a MoE model.
- Convolutions are replicated on the tensor-parallel axes (the runtime has no channel-parallel convolution;
  plans/strategies.py offers only those strategies for them).
- Schedules: 1F1B needs at least as many micro-batches as stages; interleaved 1F1B a number of
  micro-batches that is a multiple of micro-batches // stages (torch.distributed.pipelining's rounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoshard.capture.cache import graph_cache
from autoshard.capture.ir import OpGraph, OpKind

__all__ = ["attention_kernel", "ATTENTION_KERNELS", "is_expert_weight", "expert_ops", "ExpertRole",
           "expert_roles", "tp_replicated_ops",
           "num_experts", "expert_parallel_degrees", "attention_head_counts", "kv_head_fraction", "projection_head_slices", "largest_head_divisor",
           "pipeline_blocker", "schedule_blocker", "OWN_PIPELINE_CLASSES", "PIPELINE_ENTRY"]

# autoshard's own test models whose chunk forwards runtime/pipeline_split.py describes by hand
OWN_PIPELINE_CLASSES = ("GQAGPT", "MLP")
PIPELINE_ENTRY = "inputs_embeds"  # the keyword a later chunk enters the model's forward with


def is_expert_weight(param) -> bool:
    """A stack of expert weights (a 3-D parameter: experts x out x in)."""
    return len(param.shape) == 3


def expert_ops(graph: OpGraph) -> list[str]:
    """Ops holding a stack of expert weights, as capture records the grouped expert matmuls of
    mixture-of-experts layers."""
    return [op.name for op in graph.ops if op.kind is OpKind.LINEAR and any(map(is_expert_weight, op.params))]


@dataclass(frozen=True)
class ExpertRole:
    """An op between (and including) the first and last grouped expert matmul of one MoE layer: it runs on the
    rows routed to this rank's experts, which expert parallelism moves (cost_models/expert_parallel.py)."""

    module: str  # the experts module's path
    experts: int  # E: experts of the layer
    dispatch: int = 0  # > 0 on the first grouped matmul: the hidden size of the rows dispatched to it
    combine: int = 0  # > 0 on the last: the hidden size of the rows combined back after it
    unit_numel: int = 0  # the layer's expert weights (one FSDP unit under expert parallelism)


def expert_roles(graph: OpGraph) -> dict[str, ExpertRole]:
    """Op -> its ExpertRole, for the ops of every MoE layer that run on routed rows (the grouped expert
    matmuls and the pointwise ops between them); empty for a dense model."""
    cache = graph_cache(graph)
    if "expert_roles" not in cache:
        by_module: dict[str, list[int]] = {}
        names = set(expert_ops(graph))
        for i, op in enumerate(graph.ops):
            if op.name in names:
                by_module.setdefault(op.module_path, []).append(i)
        out: dict[str, ExpertRole] = {}
        for module, idx in by_module.items():
            first, last = graph.ops[idx[0]], graph.ops[idx[-1]]
            experts = next(p.shape[0] for p in first.params if is_expert_weight(p))
            unit = sum(graph.ops[i].param_numel for i in idx)
            for op in graph.ops[idx[0]:idx[-1] + 1]:
                if op.module_path == module or op.module_path.startswith(module + "."):
                    out[op.name] = ExpertRole(module, experts,
                                              dispatch=op.input_meta[0].shape[-1] if op is first else 0,
                                              combine=op.output_meta.shape[-1] if op is last else 0,
                                              unit_numel=unit)
        cache["expert_roles"] = out
    return cache["expert_roles"]


def tp_replicated_ops(graph: OpGraph) -> frozenset[str]:
    """Ops the runtime runs replicated on the tensor-parallel axes: every op of a mixture-of-experts layer's
    experts module (their forward runs on this rank's tokens as plain tensors, runtime/expert_parallel.py),
    and the router: an op whose output the experts read, with a weight of one row per expert (the graph holds
    transformers' router module as one op, its softmax and top-k included: a column split would leave the
    top-k to DTensor, which gathers the logits inside the module where no edge prices it)."""
    cache = graph_cache(graph)
    if "tp_replicated" not in cache:
        roles = expert_roles(graph).values()
        modules, counts = {r.module for r in roles}, {r.experts for r in roles}
        inside = tuple(f"{m}." for m in modules)
        experts = {op.name for op in graph.ops if op.module_path in modules or op.module_path.startswith(inside)}
        by_name = {op.name: op for op in graph.ops}
        routers = {src for op in graph.ops if op.name in experts for src in op.inputs
                   if src not in experts and src in by_name
                   and any(len(p.shape) == 2 and p.shape[0] in counts for p in by_name[src].params)}
        cache["tp_replicated"] = frozenset(experts | routers)
    return cache["tp_replicated"]


def num_experts(graph: OpGraph) -> int:
    """Experts per MoE layer (the gcd over layers that differ), 0 for a dense model."""
    counts = {r.experts for r in expert_roles(graph).values()}
    return math.gcd(*counts) if counts else 0


def expert_parallel_degrees(graph: OpGraph, dp: int) -> tuple[int, ...]:
    """ep degrees the runtime runs on a dp group of `dp` ranks: > 1, dividing dp and the experts per layer."""
    experts = num_experts(graph)
    return tuple(e for e in range(2, dp + 1) if dp % e == 0 and experts and experts % e == 0)


def _heads_and_head_dims(graph: OpGraph) -> tuple[set[int], set[int]]:
    """(head counts, head dims) of the attention ops' (B, heads, S, head_dim) tensors; for attention written
    as matmuls (eager), q @ k^T's heads and q's head_dim; for batched matmuls over batch x heads (BLOOM), the
    softmax's heads and the scores-times-values matmul's head_dim."""
    head_dims, counts = set(), set()
    for op in graph.ops:
        if op.kind is OpKind.ATTENTION:
            for meta in (*op.input_meta, op.output_meta):
                if len(meta.shape) == 4 and meta.shape[1] > 1:
                    head_dims.add(meta.shape[3])
                    counts.add(meta.shape[1])
    if not counts:
        for op in graph.ops:
            if op.kind is OpKind.MATMUL and len(op.output_meta.shape) == 4 and op.output_meta.shape[1] > 1:
                counts.add(op.output_meta.shape[1])
                if op.input_meta and len(op.input_meta[0].shape) == 4:
                    head_dims.add(op.input_meta[0].shape[3])
    if not counts:  # batched matmuls over (batch x heads, S, d), as BLOOM's baddbmm / bmm: the scores' softmax
        for op in graph.ops:  # is (B, heads, S, S), the scores-times-values matmul (batch x heads, S, head_dim)
            shape = op.output_meta.shape
            if op.kind is OpKind.SOFTMAX and op.layer is not None and len(shape) == 4 and shape[1] > 1 \
                    and shape[2] == shape[3]:
                counts.add(shape[1])
        for op in graph.ops:
            shape = op.output_meta.shape
            if counts and op.kind is OpKind.MATMUL and not op.params and op.layer is not None and len(shape) == 3 \
                    and shape[2] != shape[1] and any(shape[0] % h == 0 for h in counts):
                head_dims.add(shape[2])
    return counts, head_dims


def attention_head_counts(graph: OpGraph) -> tuple[int, ...]:
    """Head counts of the (B, heads, S, head_dim) tensors of the model's attention: every 4-D tensor an op
    makes with the attention's head_dim last. Key/value heads of grouped-query attention show here even
    where the model repeats them to the query heads before its attention kernel (Mistral, Qwen2 through
    `repeat_kv`), as rotary embedding's outputs of k. 1 (a broadcast mask, multi-query k/v) is no constraint."""
    counts, head_dims = _heads_and_head_dims(graph)
    for op in graph.ops:
        shape = op.output_meta.shape
        if op.layer is None or len(shape) != 4 or shape[3] not in head_dims:
            continue
        heads = shape[2] if shape[1] == graph.seq_len else shape[1]  # (B, S, heads, d) before a transpose
        if heads > 1:
            counts.add(heads)
    return tuple(sorted(counts))


def kv_head_fraction(graph: OpGraph) -> float:
    """The share of the attention kernel's K and V inputs the model really holds: key/value heads over the
    kernel's key heads, below 1 where a grouped-query model repeats its K/V heads to the query heads before
    the kernel (`repeat_kv`). Context parallelism gathers the K and V before any repeat."""
    cache = graph_cache(graph)
    if "kv_head_fraction" not in cache:
        attn = next((op for op in graph.ops if op.kind is OpKind.ATTENTION and len(op.input_meta) >= 3
                     and len(op.input_meta[1].shape) == 4), None)
        fraction = 1.0
        if attn is not None:
            k = attn.input_meta[1].shape[1]  # the kernel's key heads: repeated to the query heads or not
            kv = min([h for h in attention_head_counts(graph) if h < k and k % h == 0], default=k)
            fraction = kv / k
        cache["kv_head_fraction"] = fraction
    return cache["kv_head_fraction"]


def _attention_projections(graph: OpGraph) -> set[str]:
    """The block projections whose outputs reach the attention of their block through ops without parameters:
    q, k and v, separate or fused (for attention written as matmuls, the block's matmuls of two activations).
    Not the MLP's, nor the output projection after the attention."""
    attn = [op for op in graph.ops if op.kind is OpKind.ATTENTION]
    if not attn:  # attention written as matmuls: a block's matmuls of two activations (q @ k^T, p @ v)
        attn = [op for op in graph.ops if op.kind is OpKind.MATMUL and not op.params and op.layer is not None]
    names = {op.name for op in graph.ops}
    out, seen = set(), set()
    stack = [(src, a.layer) for a in attn if a.layer is not None for src in a.inputs]
    while stack:
        name, layer = stack.pop()
        if name in seen or name not in names:
            continue
        seen.add(name)
        op = graph.op(name)
        if op.layer != layer:
            continue
        if op.kind in (OpKind.LINEAR, OpKind.MATMUL) and op.params:
            out.add(name)
        else:
            stack.extend((src, layer) for src in op.inputs)
    return out


def projection_head_slices(graph: OpGraph) -> dict[str, int]:
    """Op -> number of head-sized slices of its output, for every projection feeding the attention
    (`_attention_projections`) whose output is a whole number of heads: a column split must cut whole heads
    (Falcon's fused multi-query q/k/v is heads + 2 slices, reshaped in a view the graph folds away). An MLP's
    width is no such constraint: Llama 2 7B's 11,008 is 86 heads of 128, and Megatron-LM and torchtitan run
    it at tp 8."""
    cache = graph_cache(graph)  # read per candidate by the search's strategies
    if "head_slices" not in cache:
        head_dims = _heads_and_head_dims(graph)[1]
        hd = min(head_dims) if head_dims else 0
        feeding = _attention_projections(graph) if hd else set()
        cache["head_slices"] = {
            op.name: op.gemm[1] // hd for op in graph.ops
            if op.name in feeding and op.gemm and op.gemm[1] % hd == 0}
    return cache["head_slices"]


ATTENTION_KERNELS = {
    "flash": "flash (fused kernel, causal, no mask)",
    "masked": "sdpa (fused kernel with a mask)",
    "eager": "eager (materialized scores and softmax)",
    "none": "none (no attention)",
}


def attention_kernel(graph: OpGraph) -> str:
    """The attention kernel the graph was priced with: "flash" (fused, causal without a mask tensor), "masked"
    (fused, reading a mask), "eager" (scores materialized, a softmax kernel) or "none"."""
    variants = {op.variant or "flash" for op in graph.ops if op.kind is OpKind.ATTENTION}
    if variants:
        return "masked" if "masked" in variants else "flash"
    return "eager" if any(op.kind is OpKind.SOFTMAX for op in graph.ops) else "none"


def largest_head_divisor(graph: OpGraph) -> int:
    """The gcd of the head counts and projections' head slices (0 for a model without attention): what a
    head-splitting degree divides."""
    counts = (*attention_head_counts(graph), *projection_head_slices(graph).values())
    return math.gcd(*counts) if counts else 0


def pipeline_blocker(graph: OpGraph) -> str | None:
    """Why the runtime cannot cut this model into pipeline stages, or None when it can."""
    experts = expert_ops(graph)
    if experts:
        return (f"it has mixture-of-experts layers ({experts[0]} and {len(experts) - 1} more grouped expert "
                "matmuls), which the runtime does not run in pipeline stages")
    if not graph.blocks:
        return "it has no list of repeated blocks to cut"
    if len(graph.blocks) > 1:
        names = ", ".join(b.name for b in graph.blocks)
        return f"it has {len(graph.blocks)} lists of repeated blocks ({names}); stages cut one list"
    group = graph.blocks[0]
    in_list = sorted({op.layer for op in graph.ops
                      if op.layer is not None and op.module_path.startswith(f"{group.name}.")})
    if len(in_list) > group.count:  # the list holds blocks that capture did not find repeated
        repeated = {graph.op(names[0]).layer for names in group.op_names}
        odd = [i for i in in_list if i not in repeated]
        return (f"{len(odd)} of the {len(in_list)} blocks of {group.name} ({', '.join(map(str, odd[:4]))}"
                f"{', ...' if len(odd) > 4 else ''}) differ from the others; stages cut a list of identical blocks")
    if graph.root_type in OWN_PIPELINE_CLASSES or PIPELINE_ENTRY in graph.root_kwargs:
        return None
    return (f"its forward ({graph.root_type or 'the model'}) takes no {PIPELINE_ENTRY}= to enter a later "
            "stage with hidden states")


def schedule_blocker(schedule: str, degree: int, num_microbatches: int) -> str | None:
    """Why torch.distributed.pipelining cannot run `schedule` on `degree` stages with that many micro-batches."""
    m = num_microbatches
    if schedule == "1f1b" and m < degree:
        return (f"1F1B needs at least as many micro-batches as stages: {m} < {degree}; raise the global batch, "
                "lower the micro-batch or use gpipe")
    rounds = max(1, m // degree)
    if schedule == "interleaved-1f1b" and m % rounds:
        return (f"interleaved 1F1B needs a number of micro-batches that is a multiple of {rounds} "
                f"(micro-batches // pp degree), got {m}")
    return None
