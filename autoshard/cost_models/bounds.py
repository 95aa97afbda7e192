"""Cheap lower bounds on a configuration's iteration time and memory, for pruning the search.

Time: every op at the best split any strategy could give it (all tensor-parallel axes), at perfect GEMM
efficiency (peak x the profile's large-GEMM efficiency) or full HBM bandwidth, no communication, perfectly
balanced pipeline stages, plus the schedule's fill. No plan of the configuration can beat it.
Memory: model states sharded as far as the allowed ZeRO levels go, activations at the smallest the recompute
mode allows, on the first pipeline stage (which holds the most micro-batches in flight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoshard.capture.cache import graph_cache
from autoshard.capture.ir import OpGraph, OpKind
from autoshard.cost_models.compute import FLASH_BACKWARD_FLOPS_FACTOR, max_attention_efficiency
from autoshard.cost_models.memory import Precision, model_state_bytes, tensor_bytes
from autoshard.cost_models.opcost import score_shaped
from autoshard.plans.strategies import PLANNED_KINDS

__all__ = ["GraphTotals", "graph_totals", "time_lower_bound_s", "memory_lower_bound_bytes", "block_costs",
           "knapsack_lp_min"]

_GEMM = (OpKind.LINEAR, OpKind.CONV, OpKind.MATMUL)


@dataclass(frozen=True)
class GraphTotals:
    """Per-sample totals over the graph, split into repeated-block and other ops."""

    gemm_fwd: float
    gemm_bwd: float
    gemm_fwd_block: float  # recomputed under full recompute
    attn_fwd: float
    attn_fwd_block: float
    io_elems: float  # memory-bound elements read + written (x activation bytes later)
    io_elems_block: float
    score_fwd: float  # forward FLOPs of ops that selective recompute repeats
    sac_gemm_fwd: float  # op-level selective recompute (fused attention): GEMM FLOPs of the ops it repeats
    sac_io_block: float  # ... and memory-bound elements of the ops it repeats
    params: float
    saved_elems: float  # activation elements kept (bytes at the precision)
    saved_score_elems: float
    block_input_elems: float  # what full recompute keeps per block


def _totals(graph: OpGraph) -> GraphTotals:
    from autoshard.cost_models.evaluate import pointwise_region_inputs, selective_keeps  # evaluate sits above

    g = dict.fromkeys(GraphTotals.__dataclass_fields__, 0.0)
    seq = graph.seq_len
    keeps, regions = selective_keeps(graph), pointwise_region_inputs(graph)
    for op in graph.ops:
        if op.kind not in PLANNED_KINDS:
            continue
        blk = op.layer is not None
        repeated = blk and keeps.get(op.name) is False  # op-level selective recompute runs it again
        if op.kind in _GEMM:
            g["gemm_fwd"] += op.fwd_flops
            g["gemm_bwd"] += op.bwd_flops
            g["gemm_fwd_block"] += op.fwd_flops if blk else 0.0
            g["sac_gemm_fwd"] += op.fwd_flops if repeated else 0.0
        elif op.kind is OpKind.ATTENTION:
            g["attn_fwd"] += op.fwd_flops
            g["attn_fwd_block"] += op.fwd_flops if blk else 0.0
        else:
            io = sum(m.numel for m in (*op.input_meta, op.output_meta) if m.batch_dims)
            g["io_elems"] += io
            g["io_elems_block"] += io if blk else 0.0
            g["sac_io_block"] += io if repeated else 0.0
        scored = False
        # the fused kernels' saves (never more than eager's), less what a compiled block's fused regions
        # recompute; non-float tensors (1-byte masks) at a quarter element: never above their bytes
        tensors = list(op.saved if op.saved_fused is None else op.saved_fused)
        for meta in regions.get(op.name, ()):
            if meta in tensors:
                tensors.remove(meta)
        for t in tensors:
            w = t.numel if t.dtype.startswith(("float", "bfloat")) else t.numel / 4
            g["saved_elems"] += w
            if score_shaped(t, seq):
                g["saved_score_elems"] += w
                scored = True
        g["score_fwd"] += op.fwd_flops if scored else 0.0
    g["params"] = float(graph.num_params)
    for group in graph.blocks:
        first = graph.op(group.op_names[0][0])
        if first.input_meta:
            g["block_input_elems"] += first.input_meta[0].numel * group.count
    return GraphTotals(**g)


def graph_totals(graph: OpGraph) -> GraphTotals:
    cache = graph_cache(graph)
    if "totals" not in cache:
        cache["totals"] = _totals(graph)
    return cache["totals"]


def time_lower_bound_s(graph: OpGraph, gpu, precision: Precision, *, tp_degree: int, pp: int, micro_batch: int,
                       num_microbatches: int, fill: float, recompute: str, gemm_speedup: float = 1.0) -> float:
    """`gemm_speedup`: the GEMMs' rate over 16-bit (float8 Linears: GPUProfile.fp8_gemm_speedup, applied to every
    GEMM so the bound stays below any plan's time)."""
    t = graph_totals(graph)
    gemm = t.gemm_fwd + t.gemm_bwd + (t.gemm_fwd_block if recompute == "full" else 0.0)
    attn = t.attn_fwd * (1 + FLASH_BACKWARD_FLOPS_FACTOR) + (t.attn_fwd_block if recompute == "full" else 0.0)
    io = t.io_elems * 3 + (t.io_elems_block if recompute == "full" else 0.0)
    if recompute == "selective":
        gemm += t.score_fwd + t.sac_gemm_fwd
        io += t.sac_io_block
    peak = gpu.sustained_tflops * 1e12 * gpu.best_gemm_efficiency * gemm_speedup
    attn_peak = gpu.sustained_tflops * 1e12 * max_attention_efficiency(gpu)
    per_sample = gemm / peak + attn / attn_peak + \
        io * precision.act_bytes / (gpu.hbm_gbps * 1e9 * gpu.hbm_efficiency)
    per_mb_stage = per_sample * micro_batch / (tp_degree * pp)
    return (num_microbatches + fill) * per_mb_stage


def memory_lower_bound_bytes(graph: OpGraph, precision: Precision, *, tp_degree: int, pp: int, dp: int,
                             max_zero: int, micro_batch: int, inflight: float, recompute: str) -> float:
    t = graph_totals(graph)
    local = t.params / (tp_degree * pp)
    states = min(sum(model_state_bytes(local, precision, zero=z, dp=dp)) for z in range(min(max_zero, 3) + 1))
    if recompute == "full":
        acts = t.block_input_elems
    elif recompute == "selective" and t.saved_score_elems == 0:
        acts = t.block_input_elems  # op-level policy (fused attention): keeps at least what full recompute keeps
    elif recompute == "selective":
        acts = t.saved_elems - t.saved_score_elems
    else:
        acts = t.saved_elems
    acts *= precision.act_bytes * micro_batch / (tp_degree * pp) * inflight
    return states + acts


def knapsack_lp_min(items: list[list[tuple[float, float]]], capacity: float) -> float:
    """LP relaxation of a multiple-choice knapsack: pick one (cost, weight) option per item, fractions allowed,
    total weight <= capacity, minimum total cost; +inf when even the lightest options do not fit.

    Dantzig's greedy is exact for the relaxation: start every item at its cheapest option and walk each item's
    lower convex hull towards lighter options, cheapest cost per unit of weight saved first, until the weight
    fits (the last step fractionally). A lower bound on the integer problem."""
    cost = weight = lightest = 0.0
    moves: list[tuple[float, float]] = []  # (cost per unit weight saved, weight saved)
    for options in items:
        hull = _lower_hull(options)  # lightest first, cost falling
        lightest += hull[0][1]
        cost, weight = cost + hull[-1][0], weight + hull[-1][1]
        for (c_light, w_light), (c_heavy, w_heavy) in zip(hull, hull[1:], strict=False):
            moves.append(((c_light - c_heavy) / (w_heavy - w_light), w_heavy - w_light))
    if lightest > capacity * (1 + 1e-9):
        return math.inf
    for slope, saved in sorted(moves):
        if weight <= capacity:
            break
        step = min(saved, weight - capacity)
        cost, weight = cost + slope * step, weight - step
    return cost


def _lower_hull(options: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(cost, weight) options on the lower-left convex hull, lightest first, each cheaper than the last."""
    frontier: list[tuple[float, float]] = []
    for c, w in sorted(options, key=lambda cw: (cw[1], cw[0])):
        if frontier and c >= frontier[-1][0]:
            continue  # heavier and no cheaper: never worth it
        while len(frontier) >= 2:  # drop the middle point when it lies on or above the chord
            (c1, w1), (c2, w2) = frontier[-2], frontier[-1]
            if (c2 - c1) * (w - w1) >= (c - c1) * (w2 - w1):
                frontier.pop()
            else:
                break
        frontier.append((c, w))
    return frontier


def block_costs(graph: OpGraph) -> tuple[float, float, float]:
    """(before the blocks, one block, after the blocks) in forward FLOP-equivalents, for stage balancing.
    Memory-bound work counts at a 100 FLOP/byte exchange rate (an A100's ridge point is ~150)."""
    cache = graph_cache(graph)
    if "block_costs" not in cache:
        cache["block_costs"] = _block_costs(graph)
    return cache["block_costs"]


def _block_costs(graph: OpGraph) -> tuple[float, float, float]:
    pre = block = post = 0.0
    seen_block = False
    first_layer = None
    for op in graph.ops:
        w = op.fwd_flops if op.kind in (*_GEMM, OpKind.ATTENTION) else 100.0 * sum(
            tensor_bytes(m, _BYTES2) for m in (*op.input_meta, op.output_meta))
        if op.layer is None:
            if seen_block:
                post += w
            else:
                pre += w
        else:
            seen_block = True
            if first_layer is None:
                first_layer = op.layer
            if op.layer == first_layer:
                block += w
    return pre, block, post


_BYTES2 = Precision(name="count", act_bytes=2, param_bytes=2, grad_bytes=2, master_bytes=4, optim_bytes=8)
