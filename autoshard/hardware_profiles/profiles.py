"""GPU and interconnect profiles: frozen records loaded from one YAML file each, every number with a source.

Units are in the field names: TFLOP/s (1e12), GB/s (1e9 bytes/s), GiB (2^30 bytes), microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

__all__ = ["GPUProfile", "LinkProfile", "COLLECTIVES", "load_gpu", "load_link", "gpu_names", "link_names",
           "PROFILE_DIR", "CAUSAL_MAX_EFFICIENCY"]

PROFILE_DIR = Path(__file__).parent
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")
# A causal attention kernel computes half the score matrix the cost model counts its FLOPs on: at most twice
# the fraction of peak the hardware reaches
CAUSAL_MAX_EFFICIENCY = 2.0


@dataclass(frozen=True, kw_only=True)
class GPUProfile:
    name: str  # "A100-80GB"
    peak_tflops: float  # dense bf16/fp16 tensor-core peak
    fp32_tflops: float  # fp32 peak without tensor cores (fp32 training, optimizer math)
    hbm_gbps: float  # HBM bandwidth
    memory_gib: float  # usable device memory
    num_sms: int  # streaming multiprocessors (wave quantization of GEMM tiles)
    max_gemm_efficiency: float  # fraction of peak the largest bf16 GEMMs reach (measured)
    hbm_efficiency: float  # fraction of HBM bandwidth a streaming kernel reaches (measured)
    kernel_launch_us: float  # fixed device time per kernel (on CPU ranks: per op, the host being the device)
    gpus_per_node: int  # the usual node (DGX A100: 8)
    intra_node: str  # default intra-node link profile name
    inter_node: str  # default network profile name
    sources: dict[str, str] = field(default_factory=dict)
    # Built-in inter-node networks this GPU's hosts can drive; empty means any. The rule used by the built-in
    # profiles: one NIC port needs its line rate from one x16 PCIe slot (gen3 ~12, gen4 ~24, gen5 ~48 GB/s,
    # NCCL src/graph/topo.cc), so 200 Gb/s HDR needs gen4 hosts (A100), 400 Gb/s NDR gen5 hosts (H100/H200).
    allowed_networks: tuple[str, ...] = ()
    # Fused attention kernels, fraction of dense peak over forward + backward, counted on the FLOPs of the full
    # score matrix (capture/flops.py) whatever the mask: a causal kernel skips the masked half, so its figure
    # may reach 2 (CAUSAL_MAX_EFFICIENCY). `flash_attention_efficiency` is None where FlashAttention-2 does
    # not run (before Ampere); SDPA then uses the memory-efficient kernel.
    flash_attention_efficiency: float | None = None
    memory_efficient_attention_efficiency: float = 0.3
    # The flash (causal) kernel's efficiency measured at several sequence lengths, ((seq, fraction), ...): a
    # kernel's efficiency grows with the length it works on, and where attention dominates the step (long
    # sequences) one figure misses it (benchmarks/published_validation.md, "Error by sequence length").
    # Interpolated in log2(seq), clamped at the ends (cost_models/compute.py). Empty: the one figure above.
    flash_attention_by_seq: tuple = ()
    # What the ranks compute on: "cuda" (NCCL) or "cpu" (gloo ranks, fp32): the runtime's device and backend.
    device: str = "cuda"
    # Compute runs this many times slower while a collective overlaps it (NCCL takes SMs and HBM bandwidth;
    # on CPU ranks gloo's threads take the cores). 1.0: overlap is free.
    overlap_slowdown: float = 1.0
    # Measured GEMM throughput by shape, ((m, n, k, TFLOP/s), ...) on a grid: efficiency is interpolated in
    # it (cost_models/compute.py). Empty: max_gemm_efficiency x tile and wave quantization.
    gemm_tflops: tuple = ()
    # Host time of one eager ATen op as autograd runs it on a GPU's host (Python, dispatcher, autograd, the
    # launch): the host issues a phase's kernels one by one and the GPU waits for it where they take less than
    # that (small models, small micro-batches). 0: not modeled (CPU profiles: the host is the device, and
    # `kernel_launch_us` prices each op there). cost_models/host.py.
    host_us_per_op: float = 0.0
    # Extra host time of one op on DTensors (sharding propagation), for plans with tensor-parallel axes: the
    # runtime's ops run on DTensors there (runtime/parallel_module.py). Device time on CPU ranks, host time the
    # GPU may wait for on GPUs (cost_models/host.py).
    dtensor_us_per_op: float = 0.0
    # Host time FSDP2 adds per module it manages, per micro-batch (forward and backward hooks), and of an
    # AdamW step per parameter tensor: they count where the host is the device (CPU ranks) and where a GPU
    # waits for its host (small models).
    fsdp_us_per_module: float = 0.0
    optimizer_us_per_tensor: float = 0.0
    # Elements per second (billions) of a transcendental pointwise kernel (tanh-GELU, SiLU, exp): on CPU ranks
    # these run well below memory bandwidth. 0: such kernels are memory-bound like any other (GPUs).
    transcendental_gelem_per_s: float = 0.0
    # Tensor-core work (GEMMs, fused attention) sustains this fraction of the burst rates above once the GPU sits
    # at its power limit: a kernel benchmark runs at boost clock, training holds the GPU at its power cap and a
    # lower SM clock (measured as the best sustained GEMM over the best burst, e.g. ml-engineering's MSMF / MAMF).
    # 1.0: no such measurement (the burst rate is taken as sustained), and for profiles measured under load.
    sustained_tensor_fraction: float = 1.0
    # A float8 GEMM's speed over the 16-bit GEMM of the same shape on the fp8 tensor cores (Hopper and newer);
    # 0: no fp8 tensor cores, float8 training refused (cost_models/float8.py)
    fp8_gemm_speedup: float = 0.0
    # Measured float8 GEMM speedup over the 16-bit GEMM of the same shape, by size: [GFLOP of one GEMM, speedup]
    # (torch._scaled_mm with tensorwise scales and bf16 out against torch.mm). A float8 GEMM's fixed costs
    # (prologue, scaling epilogue, the bf16 output tile) do not halve with its operand bytes, so its speedup grows
    # with its size (H200: 1.07x at 8.6 GFLOP, 1.24x at 34, 1.85x above 1 TFLOP; benchmarks/float8_shapes.md).
    # cost_models/compute.py takes this curve, capped at `fp8_gemm_speedup`. (): `fp8_gemm_speedup` at every size.
    fp8_gemm_speedup_by_gflop: tuple = ()

    @property
    def sustained_tflops(self) -> float:
        """The dense tensor-core peak at the clock the GPU sustains in training (TFLOP/s)."""
        return self.peak_tflops * self.sustained_tensor_fraction

    @property
    def best_gemm_efficiency(self) -> float:
        """The largest fraction of peak any GEMM reaches on this GPU: the large-GEMM figure, or the best shape of a
        measured grid where that is higher (what lower bounds on compute time divide by)."""
        measured = max((row[3] for row in self.gemm_tflops), default=0.0) / self.peak_tflops
        return max(self.max_gemm_efficiency, measured)

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_networks", tuple(self.allowed_networks))  # YAML gives a list
        object.__setattr__(self, "gemm_tflops", tuple(tuple(float(v) for v in row) for row in self.gemm_tflops))
        if any(len(row) != 4 or min(row) <= 0 for row in self.gemm_tflops):
            raise ValueError(f"GPU profile {self.name}: gemm_tflops rows are [m, n, k, TFLOP/s], all positive")
        object.__setattr__(self, "flash_attention_by_seq",
                           tuple(sorted((int(r[0]), float(r[1])) for r in self.flash_attention_by_seq)))
        if any(s <= 0 or not 0 < e <= CAUSAL_MAX_EFFICIENCY for s, e in self.flash_attention_by_seq):
            raise ValueError(f"GPU profile {self.name}: flash_attention_by_seq rows are [seq > 0, fraction in "
                             f"(0, {CAUSAL_MAX_EFFICIENCY:g}]] (of the full score matrix's FLOPs)")
        object.__setattr__(self, "fp8_gemm_speedup_by_gflop",
                           tuple(sorted((float(r[0]), float(r[1])) for r in self.fp8_gemm_speedup_by_gflop)))
        if any(g <= 0 or x <= 0 for g, x in self.fp8_gemm_speedup_by_gflop):
            raise ValueError(f"GPU profile {self.name}: fp8_gemm_speedup_by_gflop rows are [GFLOP > 0, speedup > 0]")
        if self.fp8_gemm_speedup_by_gflop and not self.fp8_gemm_speedup:
            raise ValueError(f"GPU profile {self.name}: fp8_gemm_speedup_by_gflop is a measured float8 speedup, but "
                             "fp8_gemm_speedup is 0 (no fp8 tensor cores): set both or neither")
        if self.overlap_slowdown < 1:
            raise ValueError(f"GPU profile {self.name}: overlap_slowdown must be >= 1, got {self.overlap_slowdown}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"GPU profile {self.name}: device must be 'cuda' or 'cpu', got {self.device!r}")
        for name in ("peak_tflops", "fp32_tflops", "hbm_gbps", "memory_gib", "kernel_launch_us"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPU profile {self.name}: {name} must be positive")
        for name in ("host_us_per_op", "dtensor_us_per_op", "fsdp_us_per_module", "optimizer_us_per_tensor"):
            if getattr(self, name) < 0:
                raise ValueError(f"GPU profile {self.name}: {name} must not be negative")
        if self.fp8_gemm_speedup and self.fp8_gemm_speedup < 1:
            raise ValueError(f"GPU profile {self.name}: fp8_gemm_speedup is 0 (no fp8 tensor cores) or >= 1, got "
                             f"{self.fp8_gemm_speedup}")
        for name in ("max_gemm_efficiency", "hbm_efficiency", "memory_efficient_attention_efficiency",
                     "sustained_tensor_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"GPU profile {self.name}: {name} must be in (0, 1]")


@dataclass(frozen=True, kw_only=True)
class LinkProfile:
    """An interconnect. `scope` "intra": bus bandwidth seen by one GPU inside a node (NVLink, NVSwitch, PCIe).
    `scope` "inter": bus bandwidth of one node's network ports together (all NICs of the node), shared by the
    GPUs of the node that communicate across nodes at the same time.

    `busbw_gbps[c]` is the nccl-tests bus bandwidth of collective c at large messages (busbw = algbw *
    2(n-1)/n for all-reduce, (n-1)/n for all-gather / reduce-scatter / all-to-all, 1 for broadcast / p2p).
    `latency_us` is the cost of one ring step (hop) for a small message.

    `busbw_curve[c]` (optional): measured busbw by message size, as nccl-tests prints it, on groups of some
    size: in YAML `{all_reduce: [{ranks: 8, points: [[bytes, GB/s], ...]}, ...]}` (one entry per measured
    group size). `cost_models/comm.py` turns it into a per-step overhead by chunk size. A collective without a
    curve of its own uses the all-reduce curve's per-step overhead (same ring, same chunks), if there is one.
    """

    name: str
    scope: str  # "intra" | "inter"
    busbw_gbps: dict[str, float]
    latency_us: float  # per algorithm step (one hop of a ring)
    sources: dict[str, str] = field(default_factory=dict)
    busbw_curve: dict = field(default_factory=dict)
    # Extra cost of a collective that sits between compute kernels (a tensor-parallel all-reduce): ranks
    # reach it at different times and the first wait for the last. Measured on CPU ranks, where the OS
    # schedules ranks that share cores; 0 where the collective runs on its own engine behind queued kernels.
    sync_us: float = 0.0
    # Extra of a collective a tensor-parallel plan issues through DTensor's `redistribute` (the runtime's
    # path) over the raw call the curves time, by collective and group size: in YAML
    # `{all_gather: [[ranks, us], ...], ...}`. Measured on CPU ranks (`autoshard profile`); absent (0) in the
    # datasheet profiles, whose published runs issue collectives directly (Megatron-LM) and whose host runs
    # ahead of the GPU.
    redistribute_us: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scope not in ("intra", "inter"):
            raise ValueError(f"link {self.name}: scope must be 'intra' or 'inter', got {self.scope!r}")
        missing = [c for c in COLLECTIVES if c not in self.busbw_gbps]
        if missing:
            raise ValueError(f"link {self.name}: busbw_gbps lacks {', '.join(missing)}")
        if any(v <= 0 for v in self.busbw_gbps.values()) or self.latency_us < 0:
            raise ValueError(f"link {self.name}: bandwidths must be positive and latency non-negative")
        object.__setattr__(self, "busbw_curve", _curves(self.name, self.busbw_curve))
        object.__setattr__(self, "redistribute_us", _by_ranks(self.name, self.redistribute_us))

    def redistribute_extra_us(self, collective: str, ranks: int) -> float:
        """`redistribute_us` of `collective` at the measured group size closest to `ranks` (the larger on a tie),
        0 where it was not measured."""
        entries = self.redistribute_us.get(collective)
        if not entries:
            return 0.0
        return min(entries, key=lambda e: (abs(e[0] - ranks), -e[0]))[1]

    def curve(self, collective: str, ranks: int | None = None):
        """(collective measured, its group size, ((bytes, busbw GB/s), ...)) closest to `ranks` ranks for
        `collective`, falling back to the all-reduce curve; None without one."""
        for measured in (collective, "all_reduce"):
            entries = self.busbw_curve.get(measured)
            if entries:
                n0, points = min(entries, key=lambda e: (abs(e[0] - (ranks or e[0])), -e[0]))
                return measured, n0, points
        return None


def _curves(link: str, raw: dict) -> dict:
    """YAML curves -> {collective: ((ranks, ((bytes, gbps), ...)), ...)}, validated, points sorted by size."""
    out = {}
    for coll, entries in (raw or {}).items():
        if coll not in COLLECTIVES:
            raise ValueError(f"link {link}: busbw_curve has unknown collective {coll!r}")
        parsed = []
        for e in entries:
            if isinstance(e, dict):
                ranks, points = int(e["ranks"]), e["points"]
            else:  # already parsed (a profile rebuilt from its JSON record)
                ranks, points = int(e[0]), e[1]
            pts = tuple(sorted((float(b), float(g)) for b, g in points))
            if ranks < 2 or len(pts) < 2 or any(b <= 0 or g <= 0 for b, g in pts):
                raise ValueError(f"link {link}: busbw_curve[{coll}] needs ranks >= 2 and >= 2 positive points")
            parsed.append((ranks, pts))
        out[coll] = tuple(parsed)
    return out


def _by_ranks(link: str, raw: dict) -> dict:
    """YAML `{collective: [[ranks, us], ...]}` -> `{collective: ((ranks, us), ...)}`, validated."""
    out = {}
    for coll, entries in (raw or {}).items():
        if coll not in COLLECTIVES:
            raise ValueError(f"link {link}: redistribute_us has unknown collective {coll!r}")
        try:
            pairs = tuple(sorted((int(r), float(us)) for r, us in entries))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"link {link}: redistribute_us[{coll}] must be [[ranks, microseconds], ...]") from exc
        if not pairs or any(r < 2 or us < 0 for r, us in pairs):
            raise ValueError(f"link {link}: redistribute_us[{coll}] needs ranks >= 2 and microseconds >= 0")
        out[coll] = pairs
    return out


def _read(kind: str, name: str) -> dict:
    path = PROFILE_DIR / kind / f"{name}.yaml"
    if not path.exists():
        raise KeyError(name)
    return yaml.safe_load(path.read_text())


def gpu_names() -> list[str]:
    return sorted(p.stem for p in (PROFILE_DIR / "gpus").glob("*.yaml"))


def link_names(scope: str | None = None) -> list[str]:
    names = sorted(p.stem for p in (PROFILE_DIR / "networks").glob("*.yaml"))
    if scope is None:
        return names
    return [n for n in names if load_link(n).scope == scope]


def load_gpu(name: str) -> GPUProfile:
    return GPUProfile(**_read("gpus", name))


def load_link(name: str) -> LinkProfile:
    return LinkProfile(**_read("networks", name))
