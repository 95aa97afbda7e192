"""`autoshard profile`: measure what the cost model needs on the ranks of this job, and write a cluster file.

Collectives run on all groups of a size at once (the world cut into groups of 2, 4, ...), as a training step
runs them; point-to-point between rank pairs. Kernels run on every rank at once on GPUs; on CPU ranks, on
one rank per core (`num_sms` records the cores): ranks that outnumber the cores share them, which the cost
model applies per phase (all ranks busy in data parallelism, some idle in a pipeline's bubble). Host costs
that need every rank (DTensor dispatch, FSDP hooks, the optimizer on DTensor parameters) are measured with
all ranks and scaled back to one core's worth. Each figure is the mean over repetitions (the expected
time: a step adds its operations' times) and then the median over ranks.

    gemm        TFLOP/s of (m x k) @ (k x n) over a grid of shapes, in the training dtype (bf16 on GPUs,
                fp32 on CPU ranks): the cost model interpolates in it (`GPUProfile.gemm_tflops`)
    float8      on GPUs with fp8 tensor cores (compute capability 8.9+: H100, H200), the speedup of float8 GEMMs
                (torch._scaled_mm, tensorwise scales) over bf16 ones of the same shapes, by size
                (`fp8_gemm_speedup_by_gflop`); without them the profile has no float8 and plans none
    memory      GB/s of a streaming kernel (read + write); the cost of one tiny op as training issues it (on
                GPUs the host's time per op, `host_us_per_op`; on CPU ranks the op's time, `kernel_launch_us`),
                and on GPUs the device's time per tiny kernel queued back to back (`kernel_launch_us`)
    attention   scaled_dot_product_attention forward + backward, causal (also by sequence length) and masked:
                fraction of peak
    host        per ATen op as autograd runs it; the extra of an op on DTensors (tensor-parallel plans and
                pipeline stages of several ranks run their ops on them), over a transformer block's forward +
                backward; per module an FSDP unit manages, per forward + backward; per parameter tensor of an
                AdamW step on FSDP's DTensor parameters
    overlap     how much of an all-reduce started beside GEMMs is exposed (on GPUs: the GEMMs' slowdown; on
                CPU ranks, gloo's threads wait for the cores the GEMMs hold)
    collectives bus bandwidth of all-reduce, all-gather, reduce-scatter, all-to-all, broadcast by message size
                per group size inside a node and, on several nodes, one rank per node; p2p send/recv; what
                DTensor's redistribute adds to a tensor-parallel all-gather, all-reduce, reduce-scatter

The result is a cluster YAML (`hardware_profiles/cluster_file.py` format) whose GPU and links are these
measurements, each with its source line; `--cluster FILE` takes it, and `NODESxGPUS@FILE` reuses it for
another number of nodes.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch
import torch.distributed as dist

from autoshard.hardware_profiles.profiles import CAUSAL_MAX_EFFICIENCY

__all__ = ["profile_cluster", "median_profile", "merge_rounds", "GRIDS", "FP8_GEMM_SHAPES", "fp8_gemm_speedups",
           "fp8_fields"]

GRIDS = {  # GEMM dims per (device, quick)
    ("cpu", True): (64, 256, 1024), ("cpu", False): (64, 256, 1024, 2048),
    ("cuda", True): (256, 1024, 4096), ("cuda", False): (256, 1024, 4096, 8192, 16384),
}
_SIZES = {True: [4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20], False: [4 << 10 << 2 * i for i in range(10)]}
MIN_REPS = 8  # a mean of fewer calls of a bimodal collective moves by half its slow mode
_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


class _Ctx:
    def __init__(self, device: torch.device, quick: bool, progress: Callable[[str], None] | None) -> None:
        self.device, self.quick, self.progress = device, quick, progress
        self.dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.budget_s = 0.05 if quick else 0.25  # time spent per measured point and rank
        cores = os.cpu_count() or 1
        # CPU ranks beyond the cores share them: kernels are measured on one rank per core, others idle
        self.cores = cores if device.type == "cpu" else self.per_node
        self.share = min(1.0, self.cores / self.per_node)
        self.active = device.type != "cpu" or self.rank % self.per_node < self.cores

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, fn: Callable[[], object], *, reps: int | None = None) -> float:
        """Mean seconds of `fn` on every rank at once, the median over ranks.

        The mean, not the median: a step's time is the sum of its operations' times, and the sum of means is
        the mean of the sum (a median is not additive). On this project's 2-core VM a 64 KB gloo all-reduce on
        2 ranks takes either ~0.3 ms or a scheduler tick (~4 ms), about half the time each; the median of a
        dozen calls flipped between 0.4 and 3.6 ms from one minute to the next, the mean of 40 stayed within
        1.1-2.8 ms (2026-11-26)."""
        fn()  # warm-up (allocations, kernel selection, communicator set-up)
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        once = torch.tensor([max(time.perf_counter() - t0, 1e-7)], dtype=torch.float64, device=self.device)
        dist.all_reduce(once, op=dist.ReduceOp.MAX)  # every rank runs the same number of repetitions
        reps = reps or max(MIN_REPS, min(50, int(self.budget_s / once.item())))
        samples = []
        dist.barrier()
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            self.sync()
            samples.append(time.perf_counter() - t0)
        return self.across_ranks(statistics.fmean(samples))

    def alternating(self, fns: tuple[Callable[[], object], ...], *, blocks: int, per_block: int = 1) -> list[float]:
        """This rank's mean seconds per call of each of `fns`, timed in alternating blocks of `per_block` calls
        (each block after a barrier) so that all of them see the same machine state."""
        samples: list[list[float]] = [[] for _ in fns]
        for _ in range(blocks):
            for fn, out in zip(fns, samples, strict=True):
                dist.barrier()
                for _ in range(per_block):
                    t0 = time.perf_counter()
                    fn()
                    self.sync()
                    out.append(time.perf_counter() - t0)
        return [statistics.fmean(x) for x in samples]

    def busy(self, fn: Callable[[], object], *, every_rank: bool = False) -> float:
        """Seconds per call of `fn` run back to back for the same wall time on the active ranks (one per core
        on CPU; `every_rank`: all ranks, for work with collectives inside), the median over them."""
        active = self.active or every_rank
        if active:
            fn()
            self.sync()
        window = self.budget_s * 4
        dist.barrier()
        per_call = None
        if active:
            t0, calls = time.perf_counter(), 0
            while True:
                fn()
                calls += 1
                self.sync()
                if time.perf_counter() - t0 >= window:
                    break
            per_call = (time.perf_counter() - t0) / calls
        dist.barrier()
        return self.across_ranks(per_call)

    def across_ranks(self, value: float | None) -> float:
        out = [None] * self.world
        dist.all_gather_object(out, value)
        return statistics.median(v for v in out if v is not None)

    def say(self, msg: str) -> None:
        if self.progress is not None and self.rank == 0:
            self.progress(msg)


def _gemm(c: _Ctx) -> list[list[float]]:
    rows, grid = [], GRIDS[(c.device.type, c.quick)]
    for m in grid:
        for n in grid:
            for k in grid:
                a = torch.randn(m, k, device=c.device, dtype=c.dtype)
                b = torch.randn(k, n, device=c.device, dtype=c.dtype)
                t = c.busy(lambda a=a, b=b: torch.mm(a, b))
                rows.append([m, n, k, round(2 * m * n * k / t / 1e12, 6)])
        c.say(f"gemm m={m}: {len(rows)} of {len(grid) ** 3} shapes")
    return rows


# (M, K, N) of the float8 GEMMs timed against bf16: Llama block Linears at 4,096 tokens (3.2 1B and 3B widths), then
# at 8,192 (Llama 3 8B and 70B widths); --quick times every third (scripts/float8_shapes.py times them all too)
FP8_GEMM_SHAPES = ((4096, 2048, 2048), (4096, 2048, 512), (4096, 2048, 8192), (4096, 8192, 2048),
                   (4096, 3072, 3072), (4096, 3072, 8192), (8192, 4096, 4096), (8192, 4096, 14336),
                   (8192, 14336, 4096), (8192, 8192, 8192), (8192, 8192, 28672), (8192, 28672, 8192))


def fp8_gemm_speedups(c: _Ctx, shapes=None) -> list[list[float]]:
    """[GFLOP, speedup] of float8 GEMMs over bf16 ones of the same shapes (torch._scaled_mm with tensorwise scales
    and bf16 out, as torchao's tensorwise Float8Linear calls it, against torch.mm), sizes measured more than once
    averaged, by size: the curve `GPUProfile.fp8_gemm_speedup_by_gflop` holds."""
    shapes = shapes or (FP8_GEMM_SHAPES[::3] if c.quick else FP8_GEMM_SHAPES)
    one = torch.ones((), device=c.device)
    by_size: dict[float, list[float]] = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k, device=c.device, dtype=torch.bfloat16), torch.randn(n, k, device=c.device,
                                                                                      dtype=torch.bfloat16)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        t16 = c.busy(lambda a=a, b=b: torch.mm(a, b.t()))
        t8 = c.busy(lambda a8=a8, b8=b8: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                           out_dtype=torch.bfloat16))
        by_size.setdefault(float(f"{2 * m * k * n / 1e9:.3g}"), []).append(t16 / t8)
    c.say(f"float8 GEMMs: {len(shapes)} shapes")
    return [[g, round(statistics.mean(v), 3)] for g, v in sorted(by_size.items())]


def fp8_fields(curve: list[list[float]], known, src: str) -> dict:
    """The float8 fields of a measured GPU profile: the measured speedup curve, and its cap, `fp8_gemm_speedup`
    (the built-in profile's where this GPU has one, else the best measured); {} where nothing was measured (no
    fp8 tensor cores: float8 stays refused on this profile)."""
    if not curve:
        return {}
    if known is not None and known.fp8_gemm_speedup:
        cap, cap_src = known.fp8_gemm_speedup, f"the built-in profile this GPU matches ({known.name})"
    else:
        cap, cap_src = max(x for _, x in curve), f"the best of fp8_gemm_speedup_by_gflop, {src}"
    return {"fp8_gemm_speedup": cap, "fp8_gemm_speedup_by_gflop": curve,
            "sources": {"fp8_gemm_speedup": cap_src, "fp8_gemm_speedup_by_gflop": src}}


def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _memory(c: _Ctx) -> tuple[float, float]:
    """(GB/s of a large elementwise add counting read + write, seconds of one tiny op as training issues it:
    host-bound, so on a GPU the host's time per op, on CPU ranks the op's time)."""
    n = (64 << 20) // 4
    x, y = torch.randn(n, device=c.device), torch.randn(n, device=c.device)
    out = torch.empty_like(x)
    t = c.busy(lambda: torch.add(x, y, out=out))
    gbps = 3 * n * 4 / t / 1e9
    # a tiny op as training runs it: recorded by autograd in forward, its gradient kernel in backward
    leaf, other = torch.ones(16, device=c.device, requires_grad=True), torch.ones(16, device=c.device)

    def chain():
        x = leaf
        for _ in range(100):
            x = x * other
        x.sum().backward()

    per_op = c.busy(chain) / 200
    return gbps, per_op


def _kernel_device_s(c: _Ctx) -> float:
    """GPU seconds per tiny kernel run back to back: 500 of them queued while a sleep kernel holds the GPU
    (the host is done issuing before it ends), timed between CUDA events; the median of three."""
    x = torch.ones(16, device=c.device)
    n, times = 500, []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(c.device)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock cycles
        start.record()
        for _ in range(n):
            x.add_(1.0)
        end.record()
        torch.cuda.synchronize(c.device)
        times.append(start.elapsed_time(end) / 1e3 / n)
    return statistics.median(times)


def _transcendental(c: _Ctx) -> float:
    """Billions of elements per second of tanh-GELU, forward (its backward costs the same)."""
    import torch.nn.functional as F

    x = torch.randn(1 << 20, device=c.device, dtype=c.dtype)
    return (1 << 20) / c.busy(lambda: F.gelu(x, approximate="tanh")) / 1e9


# Sequence lengths the causal kernel is measured at, with batch x length fixed (tokens per call): its
# efficiency grows with the length, which matters where attention dominates a step.
ATTENTION_SEQS = {("cpu", True): (128, 512), ("cpu", False): (128, 512, 1024),
                  ("cuda", True): (1024, 4096), ("cuda", False): (1024, 4096, 16384)}


def _attention(c: _Ctx, peak_tflops: float) -> tuple[float, float, list[list[float]]]:
    """(causal, masked, causal by sequence length) fused attention forward + backward as a fraction of
    `peak_tflops`, FLOPs counted as the cost model counts them: 4·b·h·s²·d forward (capture/flops.py), 2.5x
    that backward. The curve at ATTENTION_SEQS with b·s fixed; the one causal figure is its point at the
    masked kernel's shape."""
    import torch.nn.functional as F

    cpu = c.device.type == "cpu"
    h, d, tokens = (8, 64, 1024) if cpu else (16, 128, 16384)

    def efficiency(s: int, **kwargs) -> float:
        b = max(1, tokens // s)
        q, k, v = (torch.randn(b, h, s, d, device=c.device, dtype=c.dtype, requires_grad=True) for _ in range(3))

        def step():
            y = F.scaled_dot_product_attention(q, k, v, **kwargs)  # (b, h, s, d)
            y.sum().backward()
        # a causal kernel skips half the matrix these FLOPs count: up to CAUSAL_MAX_EFFICIENCY (profiles.py)
        cap = CAUSAL_MAX_EFFICIENCY if kwargs.get("is_causal") else 1.0
        return min(cap, 4 * b * h * s * s * d * 3.5 / c.busy(step) / (peak_tflops * 1e12))

    s = 512 if cpu else 4096  # one of ATTENTION_SEQS: the causal figure is the curve's point there
    mask = torch.ones(s, s, device=c.device, dtype=torch.bool).tril()
    by_seq = [[seq, round(efficiency(seq, is_causal=True), 4)] for seq in ATTENTION_SEQS[(c.device.type, c.quick)]]
    return dict(by_seq)[s], efficiency(s, attn_mask=mask), by_seq


def _block_step(x: torch.Tensor, w: dict[str, torch.Tensor], heads: int) -> None:
    """Forward + backward of a small pre-norm transformer block written as its ATen-level ops (norm, fused qkv
    projection, views, fused attention, output projection, residuals, GeLU MLP), as a model's blocks run."""
    import torch.nn.functional as F

    b, s, h = x.shape
    y = F.layer_norm(x, (h,), w["ln"], None)
    q, k, v = F.linear(y, w["qkv"]).view(b, s, 3, heads, h // heads).permute(2, 0, 3, 1, 4).unbind(0)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
    x = x + F.linear(a, w["proj"])
    x = x + F.linear(F.gelu(F.linear(F.layer_norm(x, (h,), w["ln2"], None), w["fc"])), w["out"])
    x.sum().backward()


def _dtensor_us(c: _Ctx) -> float:
    """Extra host microseconds per op dispatched on DTensors over the same ops on plain tensors, on one core's
    worth of CPU (measured on every rank, which the mesh needs, and scaled by the core share): a transformer
    block's forward + backward (`_block_step`) with its input sharded over the batch and its weights replicated
    (a pipeline stage's or a data-parallel slice's view; no collective runs), over the ATen ops it dispatches
    below autograd (counted on the plain tensors; DTensor dispatches each of them).

    An op's cost on DTensors depends on the op: sharding propagation of a view or an attention kernel costs more
    than of an add. The earlier figure, an add on replicated 16-element DTensors, came out 17 us on 4 ranks of this
    project's VM while DTensor's dispatch (`PythonSubclass` self time under torch.profiler, 974 dispatches a
    step) took 105 us per dispatch in a pp=2 x dp=2 Llama step (2026-11-26)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.utils._python_dispatch import TorchDispatchMode

    from autoshard.runtime.dtensor_ext import register_dtensor_rules

    register_dtensor_rules()  # the CPU attention kernel's sharding rule, as the runtime registers it
    h, heads = 64, 4
    mesh = init_device_mesh(c.device.type, (c.world,))
    torch.manual_seed(0)
    shapes = {"ln": (h,), "ln2": (h,), "qkv": (3 * h, h), "proj": (h, h), "fc": (4 * h, h), "out": (h, 4 * h)}
    plain_w = {k: torch.randn(v, device=c.device, requires_grad=True) for k, v in shapes.items()}
    dt_w = {k: distribute_tensor(v.detach(), mesh, [Replicate()]).requires_grad_() for k, v in plain_w.items()}
    plain_x = torch.randn(2, 16, h, device=c.device, requires_grad=True)
    dt_x = DTensor.from_local(torch.randn(2, 16, h, device=c.device), mesh, [Shard(0)], run_check=False)
    dt_x.requires_grad_()

    class Count(TorchDispatchMode):  # ATen ops below autograd: what DTensor dispatches one by one
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    with Count() as count:
        _block_step(plain_x, plain_w, heads)
    t_d = c.busy(lambda: _block_step(dt_x, dt_w, heads), every_rank=True)
    t_p = c.busy(lambda: _block_step(plain_x, plain_w, heads), every_rank=True)
    return max(0.0, (t_d - t_p) / max(1, count.ops) * 1e6 * c.share)


def _fsdp_us(c: _Ctx) -> float:
    """Host microseconds FSDP2 adds per module of a unit per forward + backward (its hooks), with parameters
    too small for their collectives to matter: a unit of 16 Linear(8, 8) with and without fully_shard."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(8, 8, device=c.device) for _ in range(16)])

    x = torch.ones(4, 8, device=c.device)
    plain, sharded = model(), model()
    mesh = init_device_mesh(c.device.type, (c.world,))
    fully_shard(list(sharded), mesh=mesh)
    fully_shard(sharded, mesh=mesh)  # the root, which FSDP requires
    t_plain = c.timed(lambda: plain(x).sum().backward())
    t_fsdp = c.timed(lambda: sharded(x).sum().backward())
    return max(0.0, (t_fsdp - t_plain) / 16 * 1e6 * c.share)


def _optimizer_us(c: _Ctx) -> float:
    """Host microseconds of an AdamW step per parameter tensor, on FSDP2's DTensor parameters (tiny ones:
    the per-tensor cost, not the bandwidth)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(c.device.type, (c.world,))
    params = [torch.nn.Parameter(distribute_tensor(torch.ones(c.world * 4, device=c.device), mesh, [Shard(0)]))
              for _ in range(32)]
    for q in params:
        q.grad = torch.zeros_like(q)
    opt = torch.optim.AdamW(params, lr=1e-4)
    return c.busy(opt.step, every_rank=True) / len(params) * 1e6 * c.share


def _overlap(c: _Ctx) -> float:
    """The slowdown s the cost model applies to compute beside a collective (`cost_models/overlap.py`: of `comm`
    seconds run beside longer compute, comm x (1 - 1/s) are exposed), measured as that exposure: an all-reduce
    started with enough GEMMs to cover it, exposed = the time until both are done - the same GEMMs alone (every
    rank busy both times, 4 trials of each alternating, means), s = 1 / (1 - exposed / comm).

    On a GPU the collective runs beside the GEMMs and slows them (NCCL takes SMs and memory bandwidth): the
    exposure is that slowdown. On CPU ranks gloo's collective needs the cores the GEMMs hold. Measured on this
    project's 2-core VM (2026-11-26), 16 MB all-reduce beside 1024^3 GEMMs: on 4 ranks the GEMMs ran 41-46 ms
    alone, the all-reduce 30 ms, both together 68-77 ms, about their sum (the earlier figure, the GEMMs' own
    slowdown, said 1.0: the all-reduce waited for the GEMMs and finished after them); on 2 ranks 35-37 ms against
    27-34 ms of GEMMs and 12.5 ms of all-reduce."""
    n = 1024 if c.device.type == "cpu" else 8192
    a = torch.randn(n, n, device=c.device, dtype=c.dtype)
    alone = c.busy(lambda: torch.mm(a, a), every_rank=True)  # the same ranks busy as with the all-reduce
    buf = torch.randn((256 << 20) // 4 if c.device.type == "cuda" else (16 << 20) // 4, device=c.device)
    comm = c.timed(lambda: dist.all_reduce(buf), reps=3)
    reps = max(2, math.ceil(1.5 * comm / alone))  # GEMMs that outlast the all-reduce

    def gemms():
        for _ in range(reps):
            torch.mm(a, a)

    def both():
        work = dist.all_reduce(buf, async_op=True)
        gemms()
        work.wait()

    t_gemms, t_both = c.alternating((gemms, both), blocks=4)
    exposed = t_both - t_gemms
    fraction = min(0.99, max(0.0, c.across_ranks(exposed) / comm))
    return 1.0 / (1.0 - fraction)


def _collective(name: str, nbytes: int, group, g: int, device) -> Callable[[], object]:
    numel = max(g, nbytes // 4 // g * g)
    if name == "all_reduce":
        t = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(t, group=group)
    if name == "all_gather":
        out, inp = torch.empty(numel, device=device), torch.ones(numel // g, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, inp, group=group)
    if name == "reduce_scatter":
        out, inp = torch.empty(numel // g, device=device), torch.ones(numel, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp, group=group)
    if name == "all_to_all":
        out, inp = torch.empty(numel, device=device), torch.ones(numel, device=device)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    t = torch.ones(numel, device=device)
    src = dist.get_global_rank(group, 0)
    return lambda: dist.broadcast(t, src=src, group=group)


def _groups(c: _Ctx) -> list[tuple[str, int, list[list[int]]]]:
    """(link, size, partition of the world) for every group shape measured: powers of two inside a node,
    contiguous; one rank per node across nodes."""
    out = []
    g = 2
    while g <= c.per_node:
        out.append(("intra", g, [list(range(s, s + g)) for s in range(0, c.world, g)]))
        g *= 2
    nodes = c.world // c.per_node
    if nodes > 1:
        out.append(("inter", nodes, [list(range(r, c.world, c.per_node)) for r in range(c.per_node)]))
    return out


def _collectives(c: _Ctx) -> dict[str, dict[str, list]]:
    """link -> collective -> [{ranks, points: [[bytes, busbw GB/s], ...]}] (busbw of one group; for the
    network, of all of a node's groups together, its profile's convention)."""
    curves: dict[str, dict[str, list]] = {"intra": {}, "inter": {}}
    for link, g, partition in _groups(c):
        group, _ = dist.new_subgroups_by_enumeration(partition)
        scale = c.per_node if link == "inter" else 1
        for name in _COLLECTIVES:
            points = []
            for nbytes in _SIZES[c.quick]:
                t = c.timed(_collective(name, nbytes, group, g, c.device))
                points.append([nbytes, round(nbytes * _FACTOR[name](g) / t / 1e9 * scale, 6)])
            curves[link].setdefault(name, []).append({"ranks": g, "points": points})
        c.say(f"collectives on groups of {g} ({link})")
    return curves


def _sync_us(c: _Ctx) -> dict[str, float]:
    """link -> extra microseconds a small all-reduce costs when it follows compute, as tensor-parallel
    collectives do, beyond what the cost model already prices: the GEMMs at one core's speed over the ranks'
    core share (`busy`, as the GEMM table is measured) and the all-reduce as its curve does (back to back). Ranks
    reach the all-reduce at different times and wait for the last (on CPU ranks that share cores, for the one
    the scheduler runs last). GEMMs + all-reduce and the all-reduce alone run in alternating blocks (both under
    the same machine state); each the mean of its calls, the median over ranks.

    Measured on the 2-core VM this project runs on (2026-11-26), 4 ranks, blocks of 10 calls: GEMMs +
    all-reduce 17.8 ms in each of three rounds, the all-reduce alone 7.6-8.3 ms, the GEMMs' core time 3.4 ms
    (6.7 ms at a half-core share): 3.3 ms of wait. The GEMMs timed alone on all ranks at once came out
    4.1-9.5 ms from round to round (ranks that run compute without collectives drift apart and share the
    cores unevenly), which made any estimate subtracting them unstable; the wait inside an all-reduce over the
    same all-reduce issued right after it (0.8 ms) missed most of it, as the second waits for descheduled ranks
    too: with it validate_measured's 4-rank tensor-parallel plans came out 31-41% fast."""
    a = torch.randn(256, 256, device=c.device, dtype=c.dtype)
    buf = torch.ones((64 << 10) // 4, device=c.device)

    def gemm():
        for _ in range(8):
            torch.mm(a, a)

    t_gemm = c.busy(gemm) / c.share  # as the cost model prices compute: one core's speed over the core share
    blocks, per_block = (6, 10) if c.quick else (12, 20)
    out = {}
    for link, _g, partition in _groups(c):
        group, _ = dist.new_subgroups_by_enumeration(partition)

        def both(group=group):
            gemm()
            dist.all_reduce(buf, group=group)

        def alone(group=group):
            dist.all_reduce(buf, group=group)

        both(), alone()  # warm-up
        t_both, t_alone = c.alternating((both, alone), blocks=blocks, per_block=per_block)
        extra = t_both - t_gemm - t_alone
        out[link] = max(0.0, c.across_ranks(extra) * 1e6)
    return out


def _waited(t: torch.Tensor) -> torch.Tensor:
    """`t` with its collective finished (DTensor returns functional collectives' outputs unwaited; the next op
    that reads them waits)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def _redistribute_us(c: _Ctx) -> dict[str, dict[str, list[list[float]]]]:
    """link -> collective -> [[group size, extra microseconds], ...]: what a collective costs beyond the raw
    `dist` call the curves time when a tensor-parallel plan issues it, as the runtime does, through DTensor's
    `redistribute` (runtime/dtensor_ext.py): a sequence shard gathered (Shard(1) -> Replicate), a partial sum
    all-reduced (Partial -> Replicate) or reduce-scattered (Partial -> Shard(1)), 64 KB per rank as a small
    model's activations, on a (dp, tp) mesh whose tp groups are the measured groups. Redistribute and the same
    raw collective on the same bytes run in alternating blocks; each the mean of its calls, the median over
    ranks.

    DTensor's path adds host work (placement logic, functional collectives, the wait, for Shard(1) the chunks
    and the concatenation back to dim 1). On GPUs it runs ahead of the kernels; on CPU ranks that share cores
    it is time the other ranks of the group wait for. Measured on this project's 2-core VM (2026-11-26, means
    of 60 calls, three rounds): 2 ranks Shard(1) -> Replicate +0-0.85 ms and Partial -> Replicate +0.3-0.5 ms
    over the raw call; 2-rank groups in a 4-rank world +0.8-2.2 ms and +1.7-4.3 ms."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    redistributions = {  # collective -> (source, target) placement on the tensor-parallel mesh dim
        "all_gather": (Shard(1), Replicate()), "all_reduce": (Partial(), Replicate()),
        "reduce_scatter": (Partial(), Shard(1))}
    local = (2, 32, 256)  # fp32: 64 KB
    blocks, per_block = (4, 8) if c.quick else (8, 16)
    out: dict[str, dict[str, list[list[float]]]] = {}
    for link, g, _partition in _groups(c):
        if link != "intra":
            continue  # tensor parallelism stays inside a node
        mesh = init_device_mesh(c.device.type, (c.world // g, g), mesh_dim_names=("dp", "tp"))
        tp = mesh.get_group("tp")
        for name, (src, dst) in redistributions.items():
            x = DTensor.from_local(torch.ones(local, device=c.device), mesh, [Replicate(), src], run_check=False)
            target = [Replicate(), dst]
            nbytes = math.prod(local) * 4 * (g if name == "all_gather" else 1)
            raw = _collective(name, nbytes, tp, g, c.device)

            def redistribute(x=x, target=target, mesh=mesh):
                return _waited(x.redistribute(mesh, target).to_local())

            redistribute(), raw()  # warm-up
            t_dtensor, t_raw = c.alternating((redistribute, raw), blocks=blocks, per_block=per_block)
            extra = max(0.0, c.across_ranks(t_dtensor - t_raw) * 1e6)
            out.setdefault(link, {}).setdefault(name, []).append([g, round(extra, 3)])
        c.say(f"DTensor redistribute on groups of {g}")
    return out


def _p2p(c: _Ctx) -> list[list[float]]:
    """Send/recv between rank pairs (rank r with r xor 1), both directions at once: bytes, GB/s one way."""
    peer = c.rank ^ 1
    points = []
    for nbytes in _SIZES[c.quick]:
        out, inp = torch.ones(nbytes // 4, device=c.device), torch.empty(nbytes // 4, device=c.device)

        def step(out=out, inp=inp):
            ops = [dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, inp, peer)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        points.append([nbytes, round(nbytes / c.timed(step) / 1e9, 6)])
    return points


def _link(name: str, scope: str, curves: dict[str, list], p2p: list, where: str, sync_us: float,
          redistribute_us: dict | None = None) -> dict:
    largest = {coll: max(entries, key=lambda e: e["ranks"]) for coll, entries in curves.items()}
    busbw = {coll: max(p[1] for p in e["points"]) for coll, e in largest.items()}
    busbw["p2p"] = max(p[1] for p in p2p) if p2p else busbw["broadcast"]
    ar = largest["all_reduce"]
    first = ar["points"][0]
    latency_us = first[0] * _FACTOR["all_reduce"](ar["ranks"]) / (first[1] * 1e9) / (2 * (ar["ranks"] - 1)) * 1e6
    curve = dict(curves)
    if p2p:
        curve["p2p"] = [{"ranks": 2, "points": p2p}]
    src = f"measured by `autoshard profile` {where}"
    return {"name": name, "scope": scope, "busbw_gbps": busbw, "latency_us": round(latency_us, 3),
            "sync_us": round(sync_us, 3), "busbw_curve": curve, "redistribute_us": redistribute_us or {},
            "sources": {"redistribute_us": src + ": DTensor redistribute over the same raw collective, 64 KB "
                                                 "per rank, by tp group size",
                        "sync_us": src + ": GEMMs then a small all-reduce, over the GEMMs at the core share "
                                   "and the all-reduce alone",
                        "busbw_gbps": src + ": the best busbw over message sizes, largest group",
                        "latency_us": src + ": smallest all-reduce / its ring steps",
                        "busbw_curve": src + ": all groups of a size at once"}}


def _device_facts(c: _Ctx):
    """(name, memory GiB per rank, SMs or cores, the built-in profile of this GPU or CPU if there is one)."""
    from autoshard.hardware_profiles.profiles import gpu_names, load_gpu

    if c.device.type == "cpu":
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / c.per_node
        return "cpu-measured", round(mem, 2), os.cpu_count() or 1, load_gpu("cpu")
    props = torch.cuda.get_device_properties(c.device)
    name = props.name.replace("NVIDIA ", "").replace(" ", "-")
    known = next((load_gpu(g) for g in gpu_names() if g.split("-")[0] in name), None)
    return f"{name}-measured", round(props.total_memory / 2**30, 2), props.multi_processor_count, known


# Links of a one-rank job, which has nothing to measure them on: its GPU's datasheet links, else these
_UNMEASURED_LINKS = {"cpu": ("loopback", "loopback-net"), "cuda": ("pcie4", "eth-100g")}


def median_profile(rounds: list):
    """Leaf by leaf, the median of several `profile_cluster` results of the same shape (numbers: the median;
    lists of equal length: element by element, so a curve keeps its sizes; text: the first round's). A shared
    machine's slow minute moves one round's host costs by half or more; the median of three does not follow it."""
    import statistics

    first = rounds[0]
    if isinstance(first, dict):
        return {k: median_profile([r[k] for r in rounds]) for k in first}
    if isinstance(first, list):
        if any(not isinstance(r, list) or len(r) != len(first) for r in rounds):
            raise ValueError("profile rounds differ in shape; take them with the same --quick setting")
        return [median_profile(list(items)) for items in zip(*rounds, strict=True)]
    if isinstance(first, bool) or not isinstance(first, (int, float)):
        return first
    if all(isinstance(r, int) for r in rounds):  # counts and sizes stay whole (one of the rounds' own)
        return statistics.median_low(rounds)
    return statistics.median(rounds)


def merge_rounds(rounds: list[dict]) -> dict:
    """The cluster file of several `profile_cluster` rounds: each number their median (`median_profile`), each
    measured figure's source saying so (one round: that round, unchanged)."""
    if len(rounds) == 1:
        return rounds[0]
    data = median_profile(rounds)
    for part in (data[k] for k in ("gpu", "intra", "inter") if isinstance(data.get(k), dict)):
        part["sources"] = {k: f"{v} (median of {len(rounds)} rounds)" for k, v in part["sources"].items()}
    return data


def profile_cluster(*, quick: bool = False, progress: Callable[[str], None] | None = None) -> dict | None:
    """Run every measurement on this job's ranks (call on all of them); rank 0 gets the cluster file's
    content (a dict for YAML), the others None."""
    device = torch.device("cpu") if not torch.cuda.is_available() or dist.get_backend() == "gloo" \
        else torch.device("cuda", torch.cuda.current_device())
    c = _Ctx(device, quick, progress)
    t_start = time.perf_counter()
    where = (f"on {platform.node()}, {c.world} ranks ({c.world // c.per_node} x {c.per_node}), {device.type}, "
             f"torch {torch.__version__}, {datetime.now(timezone.utc):%Y-%m-%d}{', --quick' if quick else ''}")
    gemm = _gemm(c)
    fp8_curve = fp8_gemm_speedups(c) if _has_fp8_tensor_cores(device) else []
    gbps, per_op = _memory(c)
    kernel_s = per_op if c.device.type == "cpu" else _kernel_device_s(c)  # CPU ranks: the host is the device
    transcendental = _transcendental(c) if c.device.type == "cpu" else 0.0
    c.say("memory bandwidth and kernel cost")
    name, mem_gib, sms, known = _device_facts(c)
    datasheet = known.peak_tflops if known is not None and c.device.type == "cuda" else None
    sms = c.cores if c.device.type == "cpu" else sms
    best = max(r[3] for r in gemm)
    peak = datasheet or best
    causal, masked, causal_by_seq = _attention(c, peak)
    dtensor = _dtensor_us(c)
    fsdp, optim = _fsdp_us(c), _optimizer_us(c)
    c.say("attention, DTensor dispatch, FSDP and optimizer host costs")
    src = f"measured by `autoshard profile` {where}"
    if c.world > 1:
        slow = _overlap(c)
        curves = _collectives(c)
        sync = _sync_us(c)
        redistribute = _redistribute_us(c)
        p2p = _p2p(c) if c.world % 2 == 0 else []
        if c.rank != 0:
            return None
        intra = _link("measured-intra", "intra", curves["intra"], p2p, where, sync.get("intra", 0.0),
                      redistribute.get("intra", {}))
        inter = (_link("measured-inter", "inter", curves["inter"], [], where, sync["inter"]) if curves["inter"]
                 else {**intra, "name": "measured-inter", "scope": "inter",
                       "sources": {k: v + " (one host: its network is its local link)"
                                   for k, v in intra["sources"].items()}})
        link_names, links_src = (intra["name"], inter["name"]), {}
    else:  # one rank: no collective to time or to overlap; the links are its GPU's datasheet ones (by name)
        slow = 1.0
        intra, inter = link_names = ((known.intra_node, known.inter_node) if known is not None
                                     else _UNMEASURED_LINKS[device.type])
        links_src = {"overlap_slowdown": f"not measured (one rank, the built-in {intra} / {inter} links): 1.0, "
                                         "one rank runs no collective beside compute"}
    gpu = {"name": name, "device": device.type, "peak_tflops": round(peak, 6), "fp32_tflops": round(peak, 6),
           "hbm_gbps": round(gbps, 3), "memory_gib": mem_gib, "num_sms": sms,
           "max_gemm_efficiency": round(min(1.0, best / peak), 4), "hbm_efficiency": 1.0,
           "kernel_launch_us": round(kernel_s * 1e6, 3), "gpus_per_node": c.per_node,
           "host_us_per_op": 0.0 if c.device.type == "cpu" else round(per_op * 1e6, 3),
           "intra_node": link_names[0], "inter_node": link_names[1],
           "flash_attention_efficiency": round(causal, 4),
           "memory_efficient_attention_efficiency": round(masked, 4), "flash_attention_by_seq": causal_by_seq,
           "overlap_slowdown": round(slow, 4),
           "dtensor_us_per_op": round(dtensor, 3), "fsdp_us_per_module": round(fsdp, 3),
           "optimizer_us_per_tensor": round(optim, 3), "transcendental_gelem_per_s": round(transcendental, 5),
           "gemm_tflops": gemm,
           "sources": {k: src for k in ("peak_tflops", "hbm_gbps", "kernel_launch_us", "host_us_per_op", "gemm_tflops",
                                        "flash_attention_efficiency", "flash_attention_by_seq",
                                        "overlap_slowdown", "dtensor_us_per_op",
                                        "fsdp_us_per_module", "optimizer_us_per_tensor", "num_sms",
                                        "transcendental_gelem_per_s")}}
    gpu["sources"].update(links_src)
    fp8 = fp8_fields(fp8_curve, known, src)
    gpu["sources"].update(fp8.pop("sources", {}))
    gpu.update(fp8)
    if datasheet:
        gpu["sources"]["peak_tflops"] = "the datasheet peak of the profile this GPU matches"
    c.say(f"done in {time.perf_counter() - t_start:.0f} s")
    return {"nodes": c.world // c.per_node, "gpus_per_node": c.per_node, "gpu": gpu, "intra": intra,
            "inter": inter}
