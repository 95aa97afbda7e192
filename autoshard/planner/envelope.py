"""What real runs reach: a prediction beyond the best published run on its GPU is flagged, not hidden.

REFERENCES.md §8: no published dense-transformer run on A100 or H100 reaches much beyond 60% MFU, so a plan
predicted above the best measured run on its GPU family is a claim that needs evidence (`autoshard measure` on
the cluster), and `plan` / `estimate` say so beside the figure (text and `--json` "warnings"). Each ceiling
names its run; GPUs without a published run (custom profiles, CPU ranks) get no warning.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Ceiling", "PUBLISHED_MFU", "LONG_SEQUENCE", "gpu_family", "envelope_warnings", "sequence_warnings"]


@dataclass(frozen=True)
class Ceiling:
    mfu: float  # model FLOPs utilization of the best published run
    source: str


PUBLISHED_MFU = {
    "A100": Ceiling(0.611, "torchtitan FSDP2, Llama 2 13B on 64 A100s without activation checkpointing "
                           "(docs/performance.md; REFERENCES.md §8)"),
    "H100": Ceiling(0.47, "Megatron-Core GPT on H100, up to 47% MFU (Megatron-LM README; REFERENCES.md §8)"),
    "V100": Ceiling(0.575, "Megatron-LM 2019, 1.2B on one V100: 71.9 TFLOP/s of 125 counting recompute "
                           "(Megatron-LM images/tables.tex)"),
}


def gpu_family(gpu_name: str) -> str | None:
    """"A100-80GB" -> "A100"; H200 shares H100's die and rated peak, so H100's runs bound it."""
    for family, names in (("A100", ("A100",)), ("H100", ("H100", "H200")), ("V100", ("V100",))):
        if gpu_name.startswith(names):
            return family
    return None


def envelope_warnings(mfu: float, gpu_name: str) -> list[str]:
    """One line per way a prediction exceeds what published runs on `gpu_name` reached (empty: within)."""
    family = gpu_family(gpu_name)
    ceiling = PUBLISHED_MFU.get(family) if family else None
    if ceiling is None or mfu <= ceiling.mfu:
        return []
    return [f"predicted MFU {mfu:.1%} is above the best published run on {family} ({ceiling.mfu:.1%}: "
            f"{ceiling.source}); treat it as optimistic until measured (autoshard measure)"]


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
