"""Cost of one operator under one strategy, and of moving a tensor between two layouts.

The per-axis rules, applied to every mesh axis a of degree d:
- Compute is split d ways when any operand is sharded on a; a Linear's local GEMM is
  (tokens / token shards) x (out / S(out) shards) x (in / S(in) shards).
- A parameter stored sharded on a but computed replicated on a is all-gathered for each use and its gradient
  reduce-scattered (2D/3D weights over tp_r / tp_x; ZeRO-3 over dp); ops that keep only shards for backward
  (`save_sharded_input`) gather again there.
- A parameter replicated on a while the batch or sequence is sharded on a has a partial gradient: all-reduced
  over a (a sequence-parallel norm's weight over tp; every replicated weight over dp, once per iteration).
- An input replicated on a whose op splits the work through the weight (column-parallel) gets a partial input
  gradient: the edge into the op reduces it in backward (Megatron's f operator).
- A norm over a hidden dim sharded on a all-reduces its statistics (2 fp32 values per token).
Data-parallel communication is returned apart from tensor-parallel communication because it overlaps with
compute (FSDP prefetch, gradient reduction during backward); the evaluator decides how much is exposed. It
moves one FSDP unit (gradient bucket) at a time, a whole block's parameters, as the runtime's FSDP2 groups
(runtime/data_parallel.py), torchtitan, llm-foundry and Megatron's gradient buckets do: an op pays its share
of its unit's collective (`unit_numel`), so the per-collective latency is paid per block, not per op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoshard.capture.ir import Op, OpKind, TensorMeta
from autoshard.cost_models.compute import (
    FLASH_BACKWARD_FLOPS_FACTOR,
    fused_attention_time_s,
    gemm_time_s,
    memory_bound_time_s,
)
from autoshard.cost_models.context import PlanContext
from autoshard.cost_models.context_parallel import gathered_kv_bytes, ring_exposed_s
from autoshard.cost_models.expert_parallel import (
    counts_bytes,
    dispatch_bytes,
    ep_load_imbalance,
    grouped_gemm_rows,
)
from autoshard.cost_models.float8 import (
    FLOAT8_BYTES,
    GATHER_CAST_KERNELS,
    cast_bytes_per_elem,
    cast_kernels,
    float8_all_gather,
    float8_linear,
    gather_cast_bytes_per_elem,
)
from autoshard.cost_models.host import (
    BACKWARD_DISPATCHES,
    compiled_host_s,
    forward_host_s,
    hooks_host_s,
    separate_host,
)
from autoshard.cost_models.memory import model_state_bytes, tensor_bytes
from autoshard.cost_models.zero_impl import gathers_overlap, zero3_gather_s
from autoshard.plans.contract import ExpertRole, is_expert_weight
from autoshard.plans.layouts import BATCH, FEAT, IN, OUT, PARTIAL, REPLICATE, SEQ, Layout
from autoshard.plans.plan import OpStrategy

__all__ = ["OpCost", "EdgeCost", "op_cost", "kernel_times_s", "linear_gemm", "repeats_forward", "edge_cost", "grad_partial_axes", "score_shaped"]

_TOKEN = (BATCH, SEQ)
# pointwise ATen ops that evaluate a transcendental function per element (GPUProfile.transcendental_gelem_per_s)
TRANSCENDENTAL = frozenset({"gelu", "silu", "tanh", "sigmoid", "exp", "log", "erf", "softplus", "mish", "sin",
                            "cos", "rsqrt", "sqrt", "pow"})


@dataclass(frozen=True)
class OpCost:
    """Per micro-batch unless named otherwise; seconds and bytes on one GPU."""

    fwd_s: float
    bwd_s: float
    tp_fwd_s: float  # tensor-parallel communication inside the op, forward (critical path)
    tp_bwd_s: float
    dp_fwd_s: float  # ZeRO-3 parameter all-gather before the forward (prefetchable)
    dp_bwd_s: float  # ZeRO-3 gather + gradient reduce-scatter in backward (overlappable)
    dp_iter_s: float  # once per iteration, after the last backward: gradient all-reduce (ZeRO 0), reduce-scatter (1)
    recompute_s: float  # forward work repeated in backward under the context's recompute mode
    param_bytes: float
    grad_bytes: float
    optim_bytes: float
    saved_bytes: float  # activations kept for backward
    transient_bytes: float  # parameters gathered while the op runs
    comm: tuple[tuple[str, float], ...] = ()  # (collective, bytes) issued per micro-batch, for runtime checks
    recompute_peak_bytes: float = 0.0  # activations re-materialized while its block runs backward
    iter_comm: tuple[tuple[str, float], ...] = ()  # (collective, bytes) issued once per iteration
    # ZeRO-3 gathers the step waits for, not overlapped (`estimate --zero-impl deepspeed-2021`; 0 for FSDP2)
    dp_sync_s: float = 0.0
    # once per iteration, in the first forward: ZeRO-1 and -2 gather the parameters, kept until the last backward
    dp_iter_fwd_s: float = 0.0
    # GPUs: host seconds issuing the op's forward, and its backward incl. recompute (cost_models/host.py)
    host_fwd_s: float = 0.0
    host_bwd_s: float = 0.0

    @property
    def time_s(self) -> float:
        return self.fwd_s + self.bwd_s + self.tp_fwd_s + self.tp_bwd_s + self.recompute_s

    @property
    def state_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optim_bytes


@dataclass(frozen=True)
class EdgeCost:
    fwd_s: float
    bwd_s: float
    comm: tuple[tuple[str, float], ...] = ()
    fwd_comm: tuple[tuple[str, float], ...] = ()  # of `comm`, the forward's (issued again when recomputed)
    fwd_compute_s: float = 0.0  # kernels the edge runs in forward besides its collectives (a float8 input cast)

    @property
    def time_s(self) -> float:
        return self.fwd_s + self.bwd_s


def _deg(lay: Layout, ctx: PlanContext, placements: tuple[str, ...]) -> int:
    """Pieces a tensor is cut into inside one data-parallel replica (the micro-batch is per replica already,
    so the dp axis never divides it again)."""
    return math.prod(ctx.mesh.degree(a) for a, p in lay.items if p in placements and a != "dp")


def _axes(lay: Layout, placements: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(a for a, p in lay.items if p in placements)


def score_shaped(meta: TensorMeta, seq: int | None) -> bool:
    """An attention-score tensor (B, heads, s, s): what selective recompute drops (Korthikanti et al. 2022)."""
    return seq is not None and len(meta.shape) >= 4 and meta.shape[-1] == seq and meta.shape[-2] == seq


def grad_partial_axes(strategy: OpStrategy) -> frozenset[str]:
    """Axes on which this op's input gradient is a partial sum (input replicated, weight output-sharded)."""
    if not strategy.params or not strategy.inputs:
        return frozenset()
    w = strategy.params[0].compute
    return frozenset(a for a, p in w.items if p == OUT and strategy.inputs[0].get(a) == REPLICATE)


def _expert_shards(op: Op, ctx: PlanContext) -> int:
    """Ranks a grouped expert matmul's expert weights are split over: ep under expert parallelism, else 1."""
    return ctx.ep if ctx.ep > 1 and any(map(is_expert_weight, op.params)) else 1


def _rank_numel(p, ctx: PlanContext) -> float:
    """Elements of parameter `p` one rank holds of it before any sharding but expert parallelism's."""
    return p.numel / ctx.ep if is_expert_weight(p) else p.numel


def _param_dp(op: Op, ctx: PlanContext) -> tuple[int, bool]:
    """(ranks an op's parameters are data parallel over, whether that is the dp / ep group of the ranks holding
    the same experts rather than dp)."""
    ep = _expert_shards(op, ctx)
    return ctx.mesh.degree("dp") // ep, ep > 1


# -- compute ----------------------------------------------------------------------------------------------
def kernel_times_s(op: Op, st: OpStrategy, ctx: PlanContext, memo: dict | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of the op's own work under `st` (`_compute_s`), without communication,
    recompute or FSDP's copies. `memo`: see `op_cost`; the times depend on the tensor-parallel degrees, the
    micro-batch and whether ops run on DTensors or under FSDP, not on the data-parallel or pipeline degree."""
    if memo is None:
        return _compute_s(op, st, ctx)
    mesh = ctx.mesh
    key = ("compute", op.name, st, ctx.micro_batch, mesh.spmd_signature, ctx.on_dtensors, ctx.fused_pointwise,
           ctx.precision, _expert_shards(op, ctx), ctx.compile, ctx.float8)
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = _compute_s(op, st, ctx)
    return hit


def _compute_s(op: Op, st: OpStrategy, ctx: PlanContext) -> tuple[float, float]:
    """(forward, backward) seconds of the op's kernels, plus, on a mesh with tensor-parallel axes, the host
    cost of running them on DTensors (the runtime's ops run on DTensors there; a backward kernel per forward
    kernel and gradient)."""
    fwd, bwd = _kernels_s(op, st, ctx)
    gpu = ctx.gpu
    if separate_host(gpu):  # dispatch, DTensor and FSDP2 costs are the host's, which the GPU may wait for (`_host_s`)
        return fwd, bwd
    if gpu.device == "cpu":  # the host is the device: views dispatch too (on a GPU the host runs ahead)
        views = op.views * gpu.kernel_launch_us * 1e-6
        fwd, bwd = fwd + views, bwd + views
    if ctx.on_dtensors and gpu.dtensor_us_per_op:
        host = gpu.dtensor_us_per_op * 1e-6 * max(1, op.dispatches)
        fwd, bwd = fwd + host, bwd + 2 * host
    if ctx.mesh.degree("dp") > 1 and gpu.fsdp_us_per_module and any(p.owner for p in op.params):
        hooks = gpu.fsdp_us_per_module * 1e-6 / 2  # FSDP2's hooks on the module: half before forward, half in backward
        fwd, bwd = fwd + hooks, bwd + hooks
    return fwd, bwd


def linear_gemm(op: Op, st: OpStrategy, ctx: PlanContext) -> tuple[int, int, int, bool] | None:
    """(m, n, k, float8) of a Linear's forward GEMM on one rank under `st`: its input's rows (tokens of the
    micro-batch this rank holds), output and input features; None for ops without one GEMM (not a Linear, or
    grouped expert matmuls)."""
    if op.kind not in (OpKind.LINEAR, OpKind.CONV) or op.gemm is None:
        return None
    if any(is_expert_weight(p) for p in op.params):
        return None
    return (*_gemm_dims(op, st, ctx), bool(ctx.float8) and float8_linear(op))


def _gemm_dims(op: Op, st: OpStrategy, ctx: PlanContext) -> tuple[int, int, int]:
    m, n, k = op.gemm
    ins = st.inputs[0] if st.inputs else st.output
    w = st.params[0].compute if st.params else Layout()
    return (max(1, m * ctx.micro_batch // max(1, _deg(ins, ctx, _TOKEN))), max(1, n // _deg(w, ctx, (OUT,))),
            max(1, k // _deg(w, ctx, (IN,))))


def _kernels_s(op: Op, st: OpStrategy, ctx: PlanContext) -> tuple[float, float]:
    gpu, mb, prec = ctx.gpu, ctx.micro_batch, ctx.precision
    ins = st.inputs[0] if st.inputs else st.output
    if op.kind in (OpKind.LINEAR, OpKind.CONV) and op.gemm is not None:
        m_local, n_local, k_local = _gemm_dims(op, st, ctx)
        ab = prec.act_bytes
        experts = next((p.shape[0] for p in op.params if is_expert_weight(p)), 0)
        if experts:  # grouped expert matmul: one GEMM per local expert (cost_models/expert_parallel.py)
            g = experts // _expert_shards(op, ctx)
            rows = max(1, round(grouped_gemm_rows(m_local, g)))
            fwd = gemm_time_s(rows, n_local, k_local, gpu, batch=g, bytes_per_elem=ab)
            dw = gemm_time_s(n_local, k_local, rows, gpu, batch=g, bytes_per_elem=ab)
            dx = gemm_time_s(rows, k_local, n_local, gpu, batch=g, bytes_per_elem=ab) if op.needs_input_grad else 0.0
            return fwd, dw + dx
        f8 = bool(ctx.float8) and float8_linear(op)
        fwd = gemm_time_s(m_local, n_local, k_local, gpu, bytes_per_elem=ab, float8=f8)
        dw = gemm_time_s(n_local, k_local, m_local, gpu, bytes_per_elem=ab, float8=f8)
        dx = gemm_time_s(m_local, k_local, n_local, gpu, bytes_per_elem=ab, float8=f8) if op.needs_input_grad else 0.0
        if f8:
            x_fwd = 0.0 if float8_input_cast_on_edge(ctx) else m_local * k_local
            cf, cb = _float8_cast_s(op, st, ctx, x=m_local * k_local, w=n_local * k_local, g=m_local * n_local,
                                    x_fwd=x_fwd)
            fwd, dw = fwd + cf, dw + cb
        return fwd, dw + dx
    split = max(_deg(ins, ctx, (BATCH, SEQ, FEAT)), 1)
    if op.kind is OpKind.ATTENTION:
        flops = op.fwd_flops * mb / split
        io = sum(tensor_bytes(t, prec, samples=mb) for t in (*op.input_meta[:3], op.output_meta)) / split
        kernel = op.variant or "flash"
        fwd = fused_attention_time_s(flops, io, gpu, kernel=kernel, seq=ctx.seq)
        return fwd, fused_attention_time_s(flops * FLASH_BACKWARD_FLOPS_FACTOR, 2 * io, gpu, kernel=kernel,
                                           seq=ctx.seq)
    if op.kind is OpKind.MATMUL and op.fwd_flops:
        out = op.output_meta.shape
        batch = max(1, math.prod(out[:-2]) * mb // split)
        m, n = (out[-2], out[-1]) if len(out) >= 2 else (1, out[-1])
        k = max(1, op.fwd_flops // max(1, 2 * math.prod(out)))
        fwd = gemm_time_s(m, n, k, gpu, batch=batch, bytes_per_elem=prec.act_bytes)
        return fwd, 2 * fwd
    fused = ctx.fused(op)
    if fused and op.kind is OpKind.ELEMENTWISE and score_shaped(op.output_meta, ctx.seq):
        # the scale and mask of materialized attention scores run inside the softmax kernel that reads them
        # (Megatron-LM's FusedScaleMaskSoftmax, Narayanan et al. 2021 sec. 5.8; Inductor fuses pointwise
        # producers into a reduction's prologue): no pass of their own over the (B, heads, s, s) tensor
        return 0.0, 0.0
    nbytes = sum(tensor_bytes(t, prec, samples=mb) for t in (*op.input_meta, op.output_meta)) / split
    kernels = 1
    if op.kind is OpKind.EMBEDDING:
        nbytes = 2 * tensor_bytes(op.output_meta, prec, samples=mb) / split
    elif not fused and op.kernel_io_numel:
        # eager PyTorch: every ATen kernel of the op reads its inputs and writes its output (RMSNorm in
        # Hugging Face's Llama is pow, mean, add, rsqrt, mul, mul)
        wide = op.kernel_io_wide_numel
        nbytes = ((op.kernel_io_numel - wide) * prec.act_bytes + wide * 4) * mb / split
        kernels = max(1, op.kernels)
    fwd = memory_bound_time_s(nbytes, gpu, kernels=kernels)
    if gpu.transcendental_gelem_per_s:  # tanh-GELU, SiLU, exp...: compute-bound on CPU ranks
        n = sum(1 for a in op.aten if a in TRANSCENDENTAL)
        fwd += n * op.output_meta.numel * mb / split / (gpu.transcendental_gelem_per_s * 1e9)
    return fwd, 2 * fwd if op.kind is not OpKind.EMBEDDING else fwd


def float8_input_cast_on_edge(ctx: PlanContext) -> bool:
    """Under tensor parallelism with tensorwise scaling a float8 Linear's input is cast where it arrives, before
    it is gathered, once for every Linear reading it (torchao's `Float8ColwiseParallel` / `Float8RowwiseParallel`
    cast the local shard in their input hook, `PrepareFloat8ModuleInput` once for q, k and v, as torchtitan
    applies them; torchao/float8/float8_tensor_parallel.py): priced on the edge (`edge_cost`'s
    `input_cast_bytes_per_elem`), not in the op."""
    return ctx.float8 == "tensorwise" and bool(ctx.mesh.tp_axes)


def _float8_cast_s(op: Op, st: OpStrategy, ctx: PlanContext, *, x: float, w: float, g: float,
                   x_fwd: float | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of a float8 Linear's casts (cost_models/float8.py) of its local input `x`,
    weight `w` and output gradient `g` elements; a weight FSDP2 gathers in float8 is cast on its shard before
    each gather instead (`_float8_gather_cast_s`; backward uses the gathered float8 weight, whose transposed
    copy, two bytes per element, is left out). `x_fwd`: the input elements cast in forward where not `x` (0 where the edge casts it:
    `float8_input_cast_on_edge`)."""
    recipe, compiled = ctx.float8, ctx.compiled(op)
    x_fwd = x if x_fwd is None else x_fwd
    w_fwd, w_bwd = w, w
    if float8_all_gather(recipe):  # FSDP2 casts the weight's shard before each gather (`_float8_gather_cast_s`)
        w_fwd, w_bwd = 0.0, 0.0
    fwd = x_fwd * cast_bytes_per_elem(recipe, "fwd", "x", compiled=compiled) + \
        w_fwd * cast_bytes_per_elem(recipe, "fwd", "w", compiled=compiled)
    bwd = g * cast_bytes_per_elem(recipe, "bwd", "g", compiled=compiled) + \
        x * cast_bytes_per_elem(recipe, "bwd", "x", compiled=compiled) + \
        w_bwd * cast_bytes_per_elem(recipe, "bwd", "w", compiled=compiled)
    gpu = ctx.gpu
    return (memory_bound_time_s(fwd, gpu, kernels=cast_kernels(recipe, "fwd", compiled=compiled)),
            memory_bound_time_s(bwd, gpu, kernels=cast_kernels(recipe, "bwd", compiled=compiled)))


def _float8_gather_cast_s(op: Op, st: OpStrategy, ctx: PlanContext) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of casting a float8 Linear's weight shard before FSDP2 gathers
    it (tensorwise: `float8.gather_cast_bytes_per_elem`) and, once per step, of the inf-norm pass over the shard
    that computes its scale (float8.py; the step's one all-reduce of those scales, a scalar per weight, is left
    out: tens of microseconds). The 1/dp shard is cast once per gather: ZeRO-3 gathers in every forward and
    again in backward; ZeRO 0-2 and a pipeline stage once per step (the runtime's `set_microbatch` and
    `_gather_once_per_step` keep the gathered weight until the last backward; the runtime wraps every parameter
    in FSDP2, so a dp of 1 gathers too)."""
    if not (ctx.float8 and float8_all_gather(ctx.float8) and float8_linear(op) and st.params):
        return 0.0, 0.0
    tp = _deg(st.params[0].storage, ctx, (OUT, IN))
    weight = sum(_rank_numel(p, ctx) for p in op.params if p.owner and len(p.shape) >= 2) / max(1, tp)
    shard, m = weight / _param_dp(op, ctx)[0], ctx.num_microbatches
    fwd, bwd = (1.0, 1.0) if st.zero >= 3 and not ctx.grads_reduced_per_step else (1.0 / m, 0.0)
    source = ctx.precision.master_bytes or ctx.precision.param_bytes  # the sharded parameter's dtype
    cast = memory_bound_time_s(shard * gather_cast_bytes_per_elem(source), ctx.gpu, kernels=GATHER_CAST_KERNELS)
    scale = memory_bound_time_s(shard * source, ctx.gpu) / m
    return fwd * cast + scale, bwd * cast


def _float8_amax_comm(op: Op, st: OpStrategy, ctx: PlanContext) -> tuple[float, float, list]:
    """A float8 Linear under tensor parallelism reduces the amax of each cast operand that is sharded across
    the tensor-parallel ranks (torchao's casts of DTensors take a global amax: an all-reduce of one fp32 scalar
    per tensor, tensorwise, or of one per row, rowwise): its sharded weight forward and again backward, and one
    activation each way (a column-parallel Linear's output gradient, a row-parallel one's input)."""
    if not ctx.float8 or not float8_linear(op) or not st.params or not ctx.mesh.tp_axes:
        return 0.0, 0.0, []
    axes = tuple(a for a in ctx.mesh.tp_axes if st.params[0].compute.get(a) in (OUT, IN)
                 or st.params[0].storage.get(a) in (OUT, IN))
    if not axes:
        return 0.0, 0.0, []
    rows = op.gemm[0] * ctx.micro_batch if ctx.float8 == "rowwise" else 1
    nb = 4 * rows
    t = ctx.redistribute_s("all_reduce", nb, axes)
    return 2 * t, 2 * t, [("all_reduce", nb)] * 4


# -- parameters ---------------------------------------------------------------------------------------------
def _param_costs(op: Op, st: OpStrategy, ctx: PlanContext, unit_numel: float | None = None):
    """(states, tp fwd/bwd s, dp fwd/bwd/iter s, transient bytes, comm records) of the op's parameters.
    `unit_numel`: parameters of the FSDP unit the op belongs to (its block); None: the op is its own unit."""
    prec, mesh = ctx.precision, ctx.mesh
    dp, outer = _param_dp(op, ctx)
    p_b = g_b = o_b = 0.0
    tp_f = tp_b = dp_f = dp_b = dp_i = dp_s = dp_g = transient = 0.0
    comm: list[tuple[str, float]] = []
    iter_comm: list[tuple[str, float]] = []
    ins = st.inputs[0] if st.inputs else st.output
    tokens_sharded = set(_axes(ins, _TOKEN))
    for pp in st.params:
        meta = next(p for p in op.params if p.name == pp.name)
        if not meta.owner:  # a tied parameter is held, synchronized and gathered by its owner op
            continue
        numel = _rank_numel(meta, ctx)  # this rank's experts only
        local = numel / _deg(pp.storage, ctx, (OUT, IN))
        at_compute = numel / _deg(pp.compute, ctx, (OUT, IN))
        # in a pipeline the stage holds whole parameters and gradients from its first backward to the step's
        # reduction (PlanContext.grads_reduced_per_step): ZeRO-2 and -3 hold what ZeRO-1 does
        held = min(st.zero, 1) if ctx.grads_reduced_per_step else st.zero
        p, g, o = model_state_bytes(local, prec, zero=held, dp=dp)
        # FSDP2's float8 all-gather gathers a float8 Linear's weight in one byte per element (float8.py)
        f8_gather = bool(ctx.float8) and float8_all_gather(ctx.float8) and float8_linear(op) and len(meta.shape) >= 2
        if f8_gather and held < 3:  # and keeps it so between uses: the working copy is float8 (float8.py)
            p = local * FLOAT8_BYTES
        p_b, g_b, o_b = p_b + p, g_b + g, o_b + o
        gather_axes = tuple(a for a in mesh.tp_axes if pp.storage.get(a) != pp.compute.get(a))
        if gather_axes:  # 2D/3D weights: gathered per use, gradient reduce-scattered
            nb = at_compute * prec.param_bytes
            t = ctx.redistribute_s("all_gather", nb, gather_axes)
            tp_f += t
            tp_b += ctx.redistribute_s("reduce_scatter", at_compute * prec.grad_bytes, gather_axes)
            tp_b += t if st.save_sharded_input else 0.0
            transient = max(transient, nb)
            comm += [("all_gather", nb * (2 if st.save_sharded_input else 1)),
                     ("reduce_scatter", at_compute * prec.grad_bytes)]
        partial_axes = tuple(a for a in mesh.tp_axes if a in tokens_sharded and pp.storage.get(a) == REPLICATE)
        if partial_axes:  # replicated weight, sharded tokens: all-reduce its gradient over those axes, one
            # collective per mesh axis (DTensor reduces a Partial placement dim by dim; measured on 3D's norms
            # and embedding, tests/distributed/test_runtime_families.py llama-3d)
            gb = local * prec.grad_bytes
            tp_b += sum(ctx.redistribute_s("all_reduce", gb, (a,)) for a in partial_axes)
            comm += [("all_reduce", gb)] * len(partial_axes)
        unit = max(1.0, (unit_numel or op.param_numel) / max(1, op.param_numel))
        f, b, i, g, sync, tr, c, ic = _dp_param_comm(local, st, ctx, unit, outer=outer,
                                                     param_bytes=FLOAT8_BYTES if f8_gather else None)
        dp_f, dp_b, dp_i, dp_g, dp_s = dp_f + f, dp_b + b, dp_i + i, dp_g + g, dp_s + sync
        if held < st.zero and st.zero >= 3:  # in a pipeline FSDP2 gathers into the whole parameters the stage
            tr = 0.0  # holds already (`held`): its all-gather output is the unsharded parameters' storage
        transient = max(transient, tr)
        comm += c
        iter_comm += ic
    return (p_b, g_b, o_b), (tp_f, tp_b), (dp_f, dp_b, dp_i, dp_s, dp_g), transient, comm, iter_comm


def _dp_param_comm(local: float, st: OpStrategy, ctx: PlanContext, unit: float = 1.0, *, outer: bool = False,
                   param_bytes: float | None = None):
    """Data-parallel traffic of `local` parameters at ZeRO level `st.zero` (split into `st.split` slices),
    as their share of a unit `unit` times their size (a split op's slices are units of their own):
    seconds (forward, backward, per iteration after the last backward, per iteration in the first forward,
    waited for), transient bytes, collectives per micro-batch and per iteration. Where the runtime issues them
    (runtime/data_parallel.py `set_microbatch`): ZeRO-0 all-reduces and ZeRO-1 reduce-scatters the accumulated
    gradients after the last micro-batch's backward; ZeRO-1 and -2 gather the parameters in the first forward
    and keep them until the last backward; ZeRO-2 and -3 reduce-scatter in every backward, except in a
    pipeline stage, which reduces once per step (`PlanContext.grads_reduced_per_step`). `outer`: expert
    weights under expert parallelism, data parallel over the dp / ep ranks that hold the same experts.
    `param_bytes`: bytes per gathered element where not the precision's (float8 all-gather: 1)."""
    prec, dp = ctx.precision, ctx.mesh.degree("dp") // (ctx.ep if outer else 1)
    if dp == 1:
        return 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, [], []
    pb, gb = local * (param_bytes or prec.param_bytes), local * prec.reduce_bytes  # gradients reduced in fp32 (memory.Precision)
    s = st.split
    share = 1.0 / unit if s == 1 else 1.0

    def on_dp(kind: str, nbytes: float) -> float:
        return ctx.ep_collective_s(kind, nbytes, outer=True) if outer else ctx.collective_s(kind, nbytes, ("dp",))

    def coll(kind: str, nbytes: float) -> float:
        if s == 1:
            return share * on_dp(kind, nbytes * unit)
        return s * on_dp(kind, nbytes / s)

    if st.zero == 0:
        return 0.0, 0.0, coll("all_reduce", gb), 0.0, 0.0, 0.0, [], [("all_reduce", gb)]
    if st.zero == 1:  # distributed optimizer: reduce-scatter accumulated gradients, gather updated params
        return 0.0, 0.0, coll("reduce_scatter", gb), coll("all_gather", pb), 0.0, 0.0, [], \
            [("reduce_scatter", gb), ("all_gather", pb)]
    if st.zero == 2 and ctx.grads_reduced_per_step:  # a pipeline stage: as ZeRO-1 (grads_reduced_per_step)
        return 0.0, 0.0, coll("reduce_scatter", gb), coll("all_gather", pb), 0.0, 0.0, [], \
            [("reduce_scatter", gb), ("all_gather", pb)]
    if st.zero == 2:  # FSDP SHARD_GRAD_OP: reduce-scatter each micro-batch, gather once per iteration
        return 0.0, coll("reduce_scatter", gb), 0.0, coll("all_gather", pb), 0.0, 0.0, \
            [("reduce_scatter", gb)], [("all_gather", pb)]
    if ctx.grads_reduced_per_step and gathers_overlap(ctx.zero_impl):
        # a pipeline stage: gathered in the first forward and kept to the step's end (runtime/pipeline.py
        # `_gather_once_per_step`, torchtitan's `reshard_after_forward = not pp_enabled`), the accumulated
        # gradients reduce-scattered once: as ZeRO-2
        return 0.0, 0.0, coll("reduce_scatter", gb), coll("all_gather", pb), 0.0, 0.0, [], \
            [("reduce_scatter", gb), ("all_gather", pb)]
    rs, comm = coll("reduce_scatter", gb), [("all_gather", 2 * pb), ("reduce_scatter", gb)]
    if not gathers_overlap(ctx.zero_impl):  # gathered per op, forward and backward, and waited for
        gather = zero3_gather_s(ctx.zero_impl, pb, on_dp("all_gather", pb), numel=local)
        return 0.0, rs, 0.0, 0.0, 2 * gather, pb / s, comm, []
    ag = coll("all_gather", pb)
    return ag, ag + rs, 0.0, 0.0, 0.0, pb / s, comm, []


def _grad_accumulation_s(op: Op, st: OpStrategy, ctx: PlanContext) -> float:
    """Seconds per micro-batch (the step's average) of adding a micro-batch's parameter gradients into the ones
    already there, in place (read both, write one).

    autoshard's runtime (FSDP2 at every ZeRO level, runtime/data_parallel.py) and torchtitan: autograd assigns the
    first gradient of a step and adds the later ones (AccumulateGrad). ZeRO-0 and -1 keep the full gradient until
    the last micro-batch's reduction (`set_requires_gradient_sync(False)` before it), so m - 1 adds of it per step;
    ZeRO-2 and -3 reduce-scatter every micro-batch and drop the full gradient (FSDP2's post_backward sets
    `unsharded_param.grad = None`, torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py), so only the 1/dp
    shard is added to, m - 1 times. Full gradients are summed in the reduce dtype (FSDP2's
    `unsharded_accumulated_grad` when it differs from the parameters' compute dtype, _fsdp_param.py), shards in
    the sharded parameter's (fp32).

    Megatron-LM's engine (`fused_pointwise`) adds every micro-batch's gradient into its persistent fp32 main_grad
    buffer (`main_grad.add_` in the gradient hook, megatron/core/distributed), except a Linear's weight: with
    gradient accumulation fusion, on by default (`--no-gradient-accumulation-fusion` turns it off), its
    weight-gradient GEMM accumulates into main_grad itself (`fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32`
    in LinearWithGradAccumulationAndAsyncCommunication, megatron/core/tensor_parallel/layers.py)."""
    fused_wgrad = ctx.fused_pointwise and op.kind == OpKind.LINEAR
    added = [p for p in op.params if p.owner and not (fused_wgrad and len(p.shape) >= 2)]
    if not added:
        return 0.0
    prec = ctx.precision
    tp = _deg(st.params[0].storage, ctx, (OUT, IN)) if st.params else 1
    local = sum(_rank_numel(p, ctx) for p in added) / max(1, tp)
    adds, owned = 1.0, len(added)
    per_element = prec.grad_bytes + 2 * prec.main_grad_bytes  # Megatron: a 16-bit gradient into main_grad
    if not ctx.fused_pointwise:
        adds = (ctx.num_microbatches - 1) / ctx.num_microbatches
        per_element = prec.grad_bytes + 2 * prec.reduce_bytes  # into FSDP2's sum, kept in the reduce dtype
        if st.zero >= 2 and not ctx.grads_reduced_per_step:
            local /= max(1, _param_dp(op, ctx)[0])
            per_element = 3 * prec.main_grad_bytes  # the reduced shard, cast, into the shard's fp32 gradient
    return adds * memory_bound_time_s(per_element * local, ctx.gpu, kernels=owned)


def _owned_local_numel(op: Op, st: OpStrategy, ctx: PlanContext) -> float:
    """Elements of the parameters `op` owns on one rank before data-parallel sharding (tensor-parallel shard)."""
    tp = _deg(st.params[0].storage, ctx, (OUT, IN)) if st.params else 1
    return sum(_rank_numel(p, ctx) for p in op.params if p.owner) / max(1, tp)


def _fsdp_copy_s(op: Op, st: OpStrategy, ctx: PlanContext) -> tuple[float, float]:
    """Memory-bound copies around FSDP2's collectives, per micro-batch (forward, backward): every all-gather
    is copied out of its flat output into the parameters (`split_with_sizes_copy`), every reduce-scatter's
    input copied in from the unsharded gradients (`chunk_cat`): torch/distributed/fsdp/_fully_shard/
    _fsdp_collectives.py. ZeRO-3 gathers in forward and again in backward; ZeRO-2 and -3 reduce-scatter in
    every backward."""
    if _param_dp(op, ctx)[0] == 1 or st.zero < 2:
        return 0.0, 0.0
    local = _owned_local_numel(op, st, ctx)
    gathered = 2 * local * ctx.precision.param_bytes  # read the flat output, write the parameters
    reduced = local * (ctx.precision.grad_bytes + ctx.precision.reduce_bytes)  # cast to the reduce dtype
    per_microbatch = st.zero == 3 and not ctx.grads_reduced_per_step  # a pipeline stage gathers once per step
    fwd = memory_bound_time_s(gathered, ctx.gpu) if per_microbatch else 0.0
    return fwd, fwd + memory_bound_time_s(reduced, ctx.gpu)


# -- activations ---------------------------------------------------------------------------------------------
def _saved_bytes(op: Op, st: OpStrategy, ctx: PlanContext, region_inputs: tuple = ()) -> tuple[float, float]:
    """(bytes kept for backward, bytes that selective recompute drops) per micro-batch.

    A fused op keeps what its one kernel needs: its inputs (`Op.saved_fused`). In a compiled block a chain of
    elementwise ops is one fused region, and an input made inside the region (`region_inputs`) is not kept
    but recomputed from the region's own inputs in backward: AOTAutograd's default partitioner for Inductor,
    `min_cut_rematerialization_partition` (torch/_functorch/partitioners.py), recomputes pointwise ops
    rather than save their outputs. SwiGLU keeps gate and up but not silu(gate). Megatron-LM's fused kernels
    (`fused_pointwise`) do the same: its SwiGLU kernel saves its input only and recomputes the activation in
    backward (megatron/core/fusions/fused_bias_swiglu.py `SwiGLUFunction`). Checked on a Hugging Face
    Llama layer (bf16, saved-tensor hooks; CPU Inductor and aot_eager_decomp_partition partition alike): 29.28
    bytes kept per token and hidden unit measured, 29.19 priced (tests/test_capture_memory.py; eager
    PyTorch keeps 43); a GPT-2 layer (its GELU one op) 32.16 measured, 32.06 priced."""
    ins = st.inputs[0] if st.inputs else st.output
    div = max(1, _deg(ins, ctx, (BATCH, SEQ, FEAT)))
    if st.save_sharded_input:
        div *= math.prod(ctx.mesh.degree(a) for a in ctx.mesh.tp_axes if ins.get(a) == REPLICATE)
    kept = dropped = 0.0
    fused = ctx.fused(op)
    tensors = list(op.saved_fused if fused and op.saved_fused is not None else op.saved)
    if fused and op.layer is not None:
        for meta in region_inputs:
            if meta in tensors:
                tensors.remove(meta)
    for t in tensors:
        b = tensor_bytes(t, ctx.precision, samples=ctx.micro_batch) / (div if t.batch_dims else 1)
        if score_shaped(t, ctx.seq):
            dropped += b
        else:
            kept += b
    if op.kind is OpKind.NORM and op.saved_fused is None and not fused and st.inputs \
            and _axes(st.inputs[0], (FEAT,)):
        # over a sharded hidden dim the runtime's statistics-parallel norm (runtime/norms.py) runs as pointwise
        # ops and keeps the normalized output besides its (centered or upcast) input, where one kernel keeps the
        # input only
        kept += tensor_bytes(op.output_meta, ctx.precision, samples=ctx.micro_batch) / div
    return kept, dropped


def _norm_stats_comm(op: Op, st: OpStrategy, ctx: PlanContext) -> tuple[float, float, list]:
    """A norm over a hidden dim sharded on some axes all-reduces its per-token statistics there: LayerNorm
    two (mean, variance), RMSNorm one (mean square), fp32, once forward and once backward (the runtime's
    statistics-parallel norms, autoshard/runtime/norms.py)."""
    if op.kind is not OpKind.NORM or not st.inputs:
        return 0.0, 0.0, []
    feat_axes = _axes(st.inputs[0], (FEAT,))
    if not feat_axes:
        return 0.0, 0.0, []
    stats = 2 if any(a in ("layer_norm", "native_layer_norm") for a in op.aten) else 1
    tokens = op.output_meta.numel // max(1, op.output_meta.shape[-1]) * ctx.micro_batch
    tokens /= max(1, _deg(st.inputs[0], ctx, _TOKEN))
    nb = tokens * 4  # one fp32 value per token
    t = stats * ctx.redistribute_s("all_reduce", nb, feat_axes)
    return t, t, [("all_reduce", nb)] * (2 * stats)


def repeats_forward(op: Op, recompute: str, selective_keep: bool | None, seq: int | None, *,
                    not_recomputed: bool = False) -> bool:
    """Whether recompute mode `recompute` runs `op`'s forward kernels again in backward (`op_cost` gives it a
    recompute time): full recompute every block op up to where the checkpoint stops (`not_recomputed`);
    selective recompute, with a fused attention kernel, the block ops whose outputs it does not keep, else the
    ops that save score-shaped tensors."""
    if recompute == "full":
        return op.layer is not None and not not_recomputed
    if recompute != "selective":
        return False
    if op.layer is not None and selective_keep is not None:
        return not selective_keep
    return any(score_shaped(t, seq) for t in op.saved)


def op_cost(op: Op, st: OpStrategy, ctx: PlanContext, *, block_input: TensorMeta | None = None,
            unit_numel: float | None = None, selective_keep: bool | None = None, expert: ExpertRole | None = None,
            not_recomputed: bool = False, region_inputs: tuple = (), memo: dict | None = None) -> OpCost:
    """Cost of `op` under `st`. `block_input`: for the first op of a repeated block under full recompute,
    the block input it keeps (everything else in the block is recomputed). `unit_numel`: the parameters of
    the sharded-DP unit (block) the op belongs to (`evaluate.dp_units`). `selective_keep`: in a graph with a
    fused attention kernel, whether selective recompute keeps this block op's output (`evaluate.selective_keeps`);
    None: selective recompute drops score-shaped tensors (materialized attention). `expert`: the op's place in a
    MoE layer (`contract.expert_roles`), where expert parallelism moves and unbalances its rows.
    `not_recomputed`: full recompute stops before the op (`evaluate.recompute_stops_before`). `region_inputs`:
    its inputs made by elementwise ops of its block (`evaluate.pointwise_region_inputs`), which a compiled
    block and Megatron's fused kernels recompute instead of saving.
    `memo`: a dict shared by calls on one graph and cluster (the search's), which keeps what a context cannot
    change: everything but recompute's part across recompute modes, kernel times across data-parallel and
    pipeline degrees (they depend only on whether there is one), parameter traffic across micro-batches."""
    if memo is None:
        base = _recompute_free(op, st, ctx, unit_numel, None, expert, region_inputs)
    else:
        key = ("base", op.name, st, ctx.mesh, ctx.micro_batch, unit_numel, ctx.precision, ctx.fused_pointwise,
               ctx.seq, ctx.zero_impl, ctx.cp, ctx.cp_attention, ctx.ep, ctx.ep_imbalance, ctx.compile, ctx.float8)
        base = memo.get(key)
        if base is None:
            base = memo[key] = _recompute_free(op, st, ctx, unit_numel, memo, expert, region_inputs)
    fwd, bwd, tp_f, tp_b, (dp_f, dp_b, dp_i, dp_s, dp_g), states, transient, comm, iter_comm, kept, dropped = base
    bwd += _grad_accumulation_s(op, st, ctx)  # depends on the micro-batch count, which the memo's key leaves out
    cast_f, cast_b = _float8_gather_cast_s(op, st, ctx)  # so do the float8 weight casts, once per gather
    fwd, bwd = fwd + cast_f, bwd + cast_b
    recompute, peak = 0.0, 0.0
    lay = st.inputs[0] if st.inputs else st.output
    first_keeps = 0.0 if block_input is None else tensor_bytes(block_input, ctx.precision, samples=ctx.micro_batch) / max(
        1, _deg(lay, ctx, (BATCH, SEQ, FEAT)))
    if ctx.recompute == "full" and op.layer is not None:
        # an op the checkpoint stops before still gathers its 2D / 3D weight first (the module's pre-forward)
        recompute, peak, kept = (tp_f if not_recomputed else fwd + tp_f), kept + dropped, first_keeps
        dp_s *= 1.5  # an implementation that waits for its gathers fetches again for the recompute forward
    elif ctx.recompute == "selective" and op.layer is not None and selective_keep is not None:
        peak = kept + dropped
        if selective_keep:  # the output is kept; what the op's backward needs is recomputed from it
            kept = tensor_bytes(op.output_meta, ctx.precision, samples=ctx.micro_batch) / max(
                1, _deg(st.output, ctx, (BATCH, SEQ, FEAT))) + first_keeps
        else:
            recompute, kept = fwd + tp_f, first_keeps
    elif ctx.recompute == "selective" and dropped > 0:
        recompute, peak = fwd, dropped
    else:
        kept += dropped
    if recompute:  # a recomputed op issues its forward's collectives again: 2D / 3D weight gathers, norm
        # statistics, a context-parallel attention's K/V, a MoE layer's dispatch and combine
        comm = (*comm, *_tp_forward_comm(op, st, ctx), *_cp_forward_comm(op, st, ctx),
                *_ep_forward_comm(op, ctx, expert))
    host_f, host_b = _host_s(op, ctx, recomputed=bool(recompute))
    return OpCost(host_fwd_s=host_f, host_bwd_s=host_b,fwd_s=fwd, bwd_s=bwd, tp_fwd_s=tp_f, tp_bwd_s=tp_b, dp_fwd_s=dp_f, dp_bwd_s=dp_b,
                  dp_iter_s=dp_i, recompute_s=recompute, param_bytes=states[0], grad_bytes=states[1],
                  optim_bytes=states[2], saved_bytes=kept, transient_bytes=transient,
                  comm=comm, recompute_peak_bytes=peak, iter_comm=iter_comm, dp_sync_s=dp_s, dp_iter_fwd_s=dp_g)


def _recompute_free(op: Op, st: OpStrategy, ctx: PlanContext, unit_numel: float | None, memo: dict | None,
                    expert: ExpertRole | None = None, region_inputs: tuple = ()):
    """The parts of `op_cost` that no recompute mode changes: (fwd, bwd, tp fwd, tp bwd, dp fwd, dp bwd,
    dp per iteration seconds, (param, grad, optim) bytes, transient bytes, comm, iteration comm, bytes kept
    for backward, bytes selective recompute drops)."""
    fwd, bwd = kernel_times_s(op, st, ctx, memo)
    if memo is None:
        params = _param_costs(op, st, ctx, unit_numel)
    else:
        key = ("params", op.name, st, ctx.mesh, unit_numel, ctx.precision, ctx.zero_impl, ctx.ep, ctx.float8)
        params = memo.get(key)
        if params is None:
            params = memo[key] = _param_costs(op, st, ctx, unit_numel)
    states, (tp_f, tp_b), dp, transient, comm, iter_comm = params
    copy_f, copy_b = _fsdp_copy_s(op, st, ctx)
    nf, nb, ncomm = _norm_stats_comm(op, st, ctx)
    af, ab, acomm = _float8_amax_comm(op, st, ctx)
    nf, nb, ncomm = nf + af, nb + ab, ncomm + acomm
    kept, dropped = _saved_bytes(op, st, ctx, region_inputs)
    if op.kind is OpKind.ATTENTION and ctx.cp > 1:
        fwd, bwd, cf, cb, ccomm, ckept = _context_parallel_attention(op, st, ctx, fwd, bwd)
        tp_f, tp_b, comm, kept = tp_f + cf, tp_b + cb, comm + ccomm, kept + ckept
    if expert is not None and ctx.ep > 1:  # the busiest rank's rows (cost_models/expert_parallel.py)
        imb = _imbalance(ctx, expert)
        fwd, bwd, kept, dropped = fwd * imb, bwd * imb, kept * imb, dropped * imb
        ef, eb, ecomm = _expert_all_to_alls(op, ctx, expert)
        tp_f, tp_b, comm = tp_f + ef, tp_b + eb, comm + ecomm
    return (fwd + copy_f, bwd + copy_b, tp_f + nf, tp_b + nb, dp, states, transient,
            tuple(comm + ncomm), tuple(iter_comm), kept, dropped)


def _host_s(op: Op, ctx: PlanContext, *, recomputed: bool) -> tuple[float, float]:
    """(forward, backward) host seconds of the op on a GPU (cost_models/host.py): its ATen dispatches, on
    DTensors where the plan runs ops on them, and FSDP2's hooks if it holds parameters (FSDP2 wraps every such
    module on GPUs, on a one-rank dp group too, to cast its parameters: runtime/precision.py); a recomputed
    op's forward again in backward. (0, 0) where the host is the device (CPU ranks)."""
    gpu = ctx.gpu
    if not separate_host(gpu):
        return 0.0, 0.0
    ours = ctx.autoshards_engine  # DTensor and FSDP2 are the runtime's, not another engine's
    f8 = bool(ctx.float8) and float8_linear(op)
    fsdp = ctx.torch_fsdp_and_optimizer  # FSDP's hooks: the runtime's, torchtitan's, llm-foundry's
    hooks = hooks_host_s(gpu) / 2 if fsdp and any(p.owner for p in op.params) else 0.0
    if ctx.compiled(op):  # generated kernels launched by the block's compiled graphs (graph calls: evaluate.py)
        kernels = (1 if op.kernels else 0) + \
            (cast_kernels(ctx.float8, "fwd", compiled=True) if f8 else 0)
        back = BACKWARD_DISPATCHES * kernels + (cast_kernels(ctx.float8, "bwd", compiled=True) if f8 else 0)
        fwd = compiled_host_s(kernels)
        bwd = compiled_host_s(back) + hooks + (fwd + hooks if recomputed else 0.0)
        return fwd + hooks, bwd
    extra_f = cast_kernels(ctx.float8, "fwd", compiled=False) if f8 else 0
    extra_b = cast_kernels(ctx.float8, "bwd", compiled=False) if f8 else 0
    on_dt = ctx.on_dtensors and ours
    fwd = forward_host_s(op.dispatches + extra_f, gpu, on_dtensors=on_dt)
    bwd = BACKWARD_DISPATCHES * forward_host_s(op.dispatches, gpu, on_dtensors=on_dt) + \
        forward_host_s(extra_b, gpu, on_dtensors=on_dt) + hooks + (fwd + hooks if recomputed else 0.0)
    return fwd + hooks, bwd


def _imbalance(ctx: PlanContext, expert: ExpertRole) -> float:
    """The busiest ep rank's routed rows over the mean: the context's, else the cost model's for the layer."""
    return ctx.ep_imbalance if ctx.ep_imbalance is not None else ep_load_imbalance(ctx.ep, expert.experts)


def _tp_forward_comm(op: Op, st: OpStrategy, ctx: PlanContext) -> list[tuple[str, float]]:
    """The tensor-parallel collectives the op's own forward issues (its edges' are the edges'): each 2D / 3D
    weight's gather to its compute placement, a norm's statistics over a sharded hidden dim."""
    out = []
    for pp in st.params:
        meta = next(p for p in op.params if p.name == pp.name)
        if meta.owner and any(pp.storage.get(a) != pp.compute.get(a) for a in ctx.mesh.tp_axes):
            out.append(("all_gather", meta.numel / _deg(pp.compute, ctx, (OUT, IN)) * ctx.precision.param_bytes))
    norm = _norm_stats_comm(op, st, ctx)[2]
    return out + norm[:len(norm) // 2]


def _routed_rows_bytes(op: Op, ctx: PlanContext, hidden: int) -> float:
    """Bytes of one rank's routed (token, expert) rows of `hidden`, one micro-batch (the mean rank's)."""
    rows = (op.gemm[0] if op.gemm else op.input_meta[0].shape[0]) * ctx.micro_batch
    return dispatch_bytes(rows, hidden, ctx.precision.act_bytes)


def _ep_forward_comm(op: Op, ctx: PlanContext, expert: ExpertRole | None) -> list[tuple[str, float]]:
    """The all-to-alls a MoE layer's forward issues at this op under expert parallelism (again when its block
    is recomputed): the counts exchange and dispatch before the first expert matmul, the combine after the last."""
    if expert is None or ctx.ep == 1:
        return []
    out = []
    if expert.dispatch:
        out += [("all_to_all", counts_bytes(expert.experts)),
                ("all_to_all", _routed_rows_bytes(op, ctx, expert.dispatch))]
    if expert.combine:
        out.append(("all_to_all", _routed_rows_bytes(op, ctx, expert.combine)))
    return out


def _expert_all_to_alls(op: Op, ctx: PlanContext, expert: ExpertRole) -> tuple[float, float, list]:
    """(forward s, backward s, collectives) of the ep group's all-to-alls at this op: the forward's
    (`_ep_forward_comm`) and their gradients' in backward, the rows' timed at the busiest rank's share."""
    f = b = 0.0
    comm: list[tuple[str, float]] = []
    if expert.dispatch:
        counts = counts_bytes(expert.experts)
        f += ctx.ep_collective_s("all_to_all", counts)
        comm.append(("all_to_all", counts))
    for hidden in (expert.dispatch, expert.combine):
        if hidden:
            nb = _routed_rows_bytes(op, ctx, hidden)
            t = ctx.ep_collective_s("all_to_all", nb * _imbalance(ctx, expert))
            f, b = f + t, b + t
            comm += [("all_to_all", nb), ("all_to_all", nb)]  # forward, and its gradient in backward
    return f, b, comm


def _cp_local_kv_bytes(op: Op, st: OpStrategy, ctx: PlanContext) -> float:
    """Bytes of the keys and values of one rank's tokens and heads, one micro-batch (before any K/V repeat)."""
    return ctx.cp_kv_fraction * sum(tensor_bytes(t, ctx.precision, samples=ctx.micro_batch)
                                    / max(1, _deg(lay, ctx, (BATCH, SEQ, FEAT)))
                                    for t, lay in zip(op.input_meta[1:3], st.inputs[1:3], strict=False))


def _cp_forward_comm(op: Op, st: OpStrategy, ctx: PlanContext) -> list[tuple[str, float]]:
    """The collectives a context-parallel attention's forward issues (again when its block is recomputed)."""
    if op.kind is not OpKind.ATTENTION or ctx.cp == 1:
        return []
    kv = _cp_local_kv_bytes(op, st, ctx)
    if ctx.cp_attention == "ring":
        return [("p2p", (ctx.cp - 1) * kv)]
    return [("all_gather", gathered_kv_bytes(kv, ctx.cp))]


def _context_parallel_attention(op: Op, st: OpStrategy, ctx: PlanContext, fwd: float, bwd: float):
    """A fused attention kernel under context parallelism (cost_models/context_parallel.py): (kernel forward,
    kernel backward, exposed traffic forward, backward, collectives, extra bytes kept for backward). The
    rank-local graph's kernel covers its queries against its own keys; against every key it does cp times
    that work (head-tail chunks keep a causal mask's share equal on every rank)."""
    cp = ctx.cp
    fwd, bwd = fwd * cp, bwd * cp
    kv = _cp_local_kv_bytes(op, st, ctx)
    forward = _cp_forward_comm(op, st, ctx)
    if ctx.cp_attention == "ring":  # backward passes K/V and their gradients: twice the bytes
        slow = ctx.gpu.overlap_slowdown
        f = ring_exposed_s(ctx.cp_p2p_s(kv), fwd / cp, cp, slowdown=slow)
        b = ring_exposed_s(ctx.cp_p2p_s(2 * kv), bwd / cp, cp, slowdown=slow)
        return fwd, bwd, f, b, [*forward, ("p2p", (cp - 1) * 2 * kv)], 0.0
    full = gathered_kv_bytes(kv, cp)
    return (fwd, bwd, ctx.cp_collective_s("all_gather", full), ctx.cp_collective_s("reduce_scatter", full),
            [*forward, ("reduce_scatter", full)], full - kv)


# -- edges -------------------------------------------------------------------------------------------------
def edge_cost(meta: TensorMeta, src: Layout, dst: Layout, grad_partial: frozenset[str],
              ctx: PlanContext, *, regather: bool = False, share: float = 1.0,
              grad_share: float | None = None, gather_bytes_per_elem: float | None = None,
              input_cast_bytes_per_elem: float = 0.0) -> EdgeCost:
    """Redistribute a tensor from its producer's layout `src` to its consumer's `dst`, and its gradient back.
    `regather`: the consumer keeps only the shard for backward (sequence parallel, 2D) and gathers it again
    there, so every forward all-gather happens once more in backward.
    `share`: this edge's part of a redistribution its producer's consumers share (1 / their number): the
    runtime redistributes a producer's output once for all consumers that want one layout, and sums their
    partial gradients before one reduction (q, k and v reading one norm output). A regathering consumer
    gathers inside its own recomputation and pays in full. Consumers wanting different layouts each pay
    their own redistribution in the runtime, which `share` then under-prices by at most the fan-out.
    `grad_share` (default `share`): the same for the gradient's reduction, 1 / the consumers that may hand
    back a partial sum (a consumer kept replicated on the tensor-parallel axes hands back a whole gradient,
    and the others' partial sums are still reduced in full: `TemplateEdge.grad_fanout`).

    When several axes change, each collective moves the tensor as sharded at that moment: DTensor's greedy
    redistribution (`_redistribute.py`) walks the axes innermost first when the tensor is sharded anywhere,
    outermost first otherwise, so a partial output is reduced while still sharded on the other axes and the
    last gather moves the whole tensor (`_redistribution_steps`).
    `gather_bytes_per_elem`: what the forward all-gathers move per element where not the activation dtype's: a
    float8 Linear under tensorwise scaling gathers its sequence-parallel input already cast to float8 (1 byte;
    torchao/float8/float8_tensor_parallel.py `Float8ColwiseParallel`, `PrepareFloat8ModuleInput`, which
    torchtitan's float8 tensor parallelism applies); its gradient comes back in 16 bits.
    `input_cast_bytes_per_elem`: that cast's bytes per element (`float8.cast_bytes_per_elem`), run on the
    producer's local tensor (the sequence shard) before the gather, this edge's `share` of it
    (`float8_input_cast_on_edge`): compute, in `fwd_compute_s`, not a collective's time."""
    if not meta.batch_dims:  # a tensor without a batch dim is never batch-sharded
        src, dst = _drop_batch(src), _drop_batch(dst)
    full = tensor_bytes(meta, ctx.precision, samples=ctx.micro_batch)
    axes = ctx.mesh.tp_axes  # dp is S(batch) on both ends: nothing moves
    if any(dst.get(a) == PARTIAL and src.get(a) != PARTIAL for a in axes):
        return EdgeCost(math.inf, math.inf)  # partial sums cannot be made from anything else
    batch_on_dp = bool(meta.batch_dims) and ctx.mesh.degree("dp") > 1
    # the gradient leaves the consumer partial where its input was replicated but its work split through the
    # weight, and must end where the producer's output lay (a partial output's gradient is replicated)
    grad_from = {a: PARTIAL if a in grad_partial and dst.get(a) == REPLICATE else dst.get(a) for a in axes}
    grad_to = {a: REPLICATE if src.get(a) == PARTIAL else src.get(a) for a in axes}
    fwd = bwd = 0.0
    comm: list[tuple[str, float]] = []
    forward: list[tuple[str, float]] = []
    for kind, axis, nbytes in _redistribution_steps({a: src.get(a) for a in axes},
                                                     {a: dst.get(a) for a in axes}, full, batch_on_dp, ctx):
        if gather_bytes_per_elem is not None and kind == "all_gather":
            nbytes *= gather_bytes_per_elem / ctx.precision.act_bytes
        t = ctx.redistribute_s(kind, nbytes, (axis,))
        fwd += t
        comm.append((kind, nbytes))
        forward.append((kind, nbytes))
        if regather and kind == "all_gather":
            bwd += t
            comm.append((kind, nbytes))
    cast = 0.0
    if input_cast_bytes_per_elem:
        src_shards = math.prod(ctx.mesh.degree(a) for a in axes if src.get(a).startswith("S("))
        local = full / ctx.precision.act_bytes / src_shards
        cast = memory_bound_time_s(local * input_cast_bytes_per_elem, ctx.gpu, kernels=0)
    if share != 1.0 and not regather:
        fwd, bwd, cast = fwd * share, bwd * share, cast * share
        comm, forward = [(k, b * share) for k, b in comm], [(k, b * share) for k, b in forward]
    grad_share = 1.0 if regather else share if grad_share is None else grad_share
    for kind, axis, nbytes in _redistribution_steps(grad_from, grad_to, full, batch_on_dp, ctx):
        bwd += grad_share * ctx.redistribute_s(kind, nbytes, (axis,))
        comm.append((kind, grad_share * nbytes))
    return EdgeCost(fwd, bwd, tuple(comm), tuple(forward), fwd_compute_s=cast)


def _redistribution_steps(start: dict[str, str], end: dict[str, str], full: float, batch_on_dp: bool,
                          ctx: PlanContext) -> list[tuple[str, str, float]]:
    """(collective, axis, bytes) of moving a tensor of `full` bytes per replica from placements `start` to
    `end` on the tensor-parallel axes, one axis at a time in DTensor's greedy order (see `edge_cost`); bytes
    as nccl-tests count them: the gathered output, the reduce-scatter input, what one rank sends all-to-all."""
    state = dict(start)
    sharded = batch_on_dp or any(p.startswith("S(") for p in state.values())
    order = list(reversed(state)) if sharded else list(state)
    steps = []
    for axis in order:
        kind = _collective(state[axis], end[axis])
        if kind:
            others = math.prod(ctx.mesh.degree(a) for a, p in state.items() if a != axis and p.startswith("S("))
            nbytes = full / others / (ctx.mesh.degree(axis) if kind == "all_to_all" else 1)
            steps.append((kind, axis, nbytes))
        state[axis] = end[axis]
    return steps


def _collective(s: str, d: str) -> str | None:
    """The collective that takes one axis from placement s to d (None: nothing, or a local slice)."""
    if s in (d, REPLICATE):
        return None
    if s == PARTIAL:
        return "all_reduce" if d == REPLICATE else "reduce_scatter"
    return "all_gather" if d == REPLICATE else "all_to_all"


def _drop_batch(lay: Layout) -> Layout:
    out = lay
    for a, p in lay.items:
        if p == BATCH:
            out = out.with_(a, REPLICATE)
    return out
