"""What real runs reach: a prediction beyond the best published run on its GPU at its scale is flagged, not hidden.

REFERENCES.md §8: no published dense-transformer run on A100 or H100 reaches much beyond 60% MFU, and the
figure falls with scale (MegaScale's 55.2% on 12,288 A100s; Llama 3 405B's 43% on 8,192 H100s). A plan
predicted above the best MFU any published run reached on its GPU family with at least as many GPUs is a claim
that needs evidence (`autoshard measure` on the cluster), and `plan` / `estimate` say so beside the figure
(text and `--json` "warnings"). Each ceiling names its run; GPUs without a published run (custom profiles, CPU
ranks) get no warning.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Ceiling", "PUBLISHED_MFU", "LONG_SEQUENCE", "LARGEST_SHARDED_RUN", "gpu_family", "ceiling",
           "envelope_warnings", "sequence_warnings", "sharding_warnings", "RESERVED_OVER_ALLOCATED",
           "memory_warnings"]


@dataclass(frozen=True)
class Ceiling:
    mfu: float  # model FLOPs utilization of the published run
    source: str
    gpus: int  # how many GPUs it ran on


# Per family, the frontier of MFU against GPU count: each run is the best published one on at least its number
# of GPUs (a run on more GPUs with a higher MFU would replace the runs before it). Sorted by GPU count.
PUBLISHED_MFU: dict[str, tuple[Ceiling, ...]] = {
    "A100": (
        Ceiling(0.642, "llm-foundry MPT-7B, FSDP on 8 A100s at 2,048 tokens (scripts/train/benchmarking/README.md; "
                       "published_runs.csv mpt_7b_a100_80gb_8_2048)", 8),
        Ceiling(0.611, "torchtitan FSDP2, Llama 2 13B on 64 A100s without activation checkpointing "
                       "(docs/performance.md; REFERENCES.md §8)", 64),
        Ceiling(0.552, "MegaScale, GPT-3 175B on 12,288 A100s (Jiang et al., NSDI 2024; REFERENCES.md §8)", 12288),
    ),
    "H100": (
        Ceiling(0.47, "Megatron-Core GPT on H100, up to 47% MFU (Megatron-LM README; REFERENCES.md §8)", 96),
        Ceiling(0.435, "Llama 3 405B on 8,192 H100s, 430 TFLOP/s per GPU (Llama 3 paper Table 4; "
                       "references/more_published_runs.csv llama3_405b_8k)", 8192),
        Ceiling(0.404, "Llama 3 405B on 16,384 H100s, 400 TFLOP/s per GPU (Llama 3 paper Table 4)", 16384),
    ),
    "V100": (
        Ceiling(0.575, "Megatron-LM 2019, 1.2B on one V100: 71.9 TFLOP/s of 125 counting recompute "
                       "(Megatron-LM images/tables.tex)", 1),
    ),
}


def gpu_family(gpu_name: str) -> str | None:
    """"A100-80GB" -> "A100"; H200 shares H100's die and rated peak, so H100's runs bound it."""
    for family, names in (("A100", ("A100",)), ("H100", ("H100", "H200")), ("V100", ("V100",))):
        if gpu_name.startswith(names):
            return family
    return None


def ceiling(family: str, num_gpus: int | None = None) -> Ceiling | None:
    """The best published run of `family` on at least `num_gpus` GPUs (beyond the largest, the largest; no
    count: the best at any scale)."""
    runs = PUBLISHED_MFU.get(family, ())
    if not runs:
        return None
    return next((c for c in runs if num_gpus is None or c.gpus >= num_gpus), runs[-1])


def envelope_warnings(mfu: float, gpu_name: str, num_gpus: int | None = None) -> list[str]:
    """One line per way a prediction exceeds what published runs on `gpu_name` reached at its scale (empty:
    within)."""
    family = gpu_family(gpu_name)
    best = ceiling(family, num_gpus) if family else None
    if best is None or mfu <= best.mfu:
        return []
    scale = f" on {num_gpus:,} GPUs or more" if num_gpus and num_gpus > 1 else ""
    return [f"predicted MFU {mfu:.1%} is above the best published run on {family}{scale} ({best.mfu:.1%}: "
            f"{best.source}); treat it as optimistic until measured (autoshard measure)"]


# From this many tokens per sequence a fused attention kernel is most of a decoder's step, and the one published
# sweep over sequence length (llm-foundry's MPT runs on 8 A100s / 8 H100s, 512-65,536 tokens; rows mptseq_* of
# references/more_published_runs.csv) is predicted too slow there: the error climbs with the length
# (benchmarks/published_validation.md, "Error by sequence length").
LONG_SEQUENCE = 16384


def sequence_warnings(seq: int | None, gpu_name: str, attention: str | None, *,
                      measured_curve: bool = False) -> list[str]:
    """One line when a fused-attention prediction is at a sequence length where published runs were missed
    (not when the profile prices attention from a curve measured over sequence lengths)."""
    if not seq or seq < LONG_SEQUENCE or attention not in ("flash", "masked") or gpu_family(gpu_name) is None \
            or measured_curve:
        return []
    return [f"at {seq:,} tokens per sequence attention dominates the step, and published runs from "
            f"{LONG_SEQUENCE:,} tokens up were predicted too slow (benchmarks/published_validation.md, 'Error by "
            "sequence length'); treat this prediction as pessimistic until measured (autoshard measure)"]


# The largest fully sharded (ZeRO-3 / FSDP) run the model is checked against: MPT 70B with FSDP on 512 H100s
# (published_runs.csv mpt_70b_h100_80gb_512_2048, predicted within 3%). Beyond it the only published ZeRO-3 runs
# are DeepSpeed's at 384-2,240 A100s (Narayanan et al. 2021 Table 2, references/more_published_runs.csv
# ptdp21_t2_zero3_*), which ran 1.6-4x slower than this model prices them (37-75% too fast at 384-2,240 GPUs,
# worse as the group grows): another engine, but nothing at that scale shows FSDP2 reaching the price either.
LARGEST_SHARDED_RUN = 512


def sharding_warnings(plan, gpu_name: str) -> list[str]:
    """One line when the plan shards parameters (ZeRO-3) over a data-parallel group larger than any fully
    sharded run the model was checked against (GPU profiles only: `autoshard measure` checks CPU ranks)."""
    dp = plan.mesh.degree("dp")
    if dp <= LARGEST_SHARDED_RUN or gpu_family(gpu_name) is None \
            or not any(op.strategy.zero == 3 for op in plan.ops):
        return []
    return [f"parameters are sharded (ZeRO-3) over {dp:,} data-parallel ranks; the largest fully sharded run "
            f"checked is FSDP on {LARGEST_SHARDED_RUN} GPUs (MPT 70B, within 3%), and DeepSpeed's ZeRO-3 at "
            "768-2,240 GPUs (2021) ran 2-4x slower than FSDP2 is priced here (its own implementation: estimate "
            "--zero-impl deepspeed-2021; benchmarks/published_validation.md); treat the prediction as optimistic "
            "until measured (autoshard measure)"]


# The CUDA allocator's peak reserved over its peak allocated, measured on one H200 with expandable segments
# (benchmarks/gpu_validation.md, 11 plans of `autoshard measure`, 2026-11-29): 1.16 to 1.25. The memory model
# predicts the allocated peak (there within +0.3% to +3.8% in 9 of 11); an out-of-memory error sees reserved.
RESERVED_OVER_ALLOCATED = (1.16, 1.25)


def memory_warnings(total_bytes: float, cluster) -> list[str]:
    """One line when the predicted memory (the allocated peak) times the smallest reserve over allocated that a
    GPU showed exceeds the GPU's usable memory: the plan fits as priced but may not as the allocator runs it
    (GPU profiles only; CPU ranks have no caching allocator)."""
    low, high = RESERVED_OVER_ALLOCATED
    usable = cluster.device_memory_bytes
    if cluster.gpu.device != "cuda" or total_bytes * low <= usable:
        return []
    return [f"predicted memory {total_bytes / 2**30:.1f} GiB is {total_bytes / usable:.0%} of the usable "
            f"{cluster.device_memory_text}; on an H200 the allocator reserved {low:.2f}-{high:.2f}x the allocated "
            "peak this model predicts (benchmarks/gpu_validation.md), so this plan may run out of memory: measure "
            "it (autoshard measure), or leave more room (--recompute, a higher --zero, more GPUs)"]
