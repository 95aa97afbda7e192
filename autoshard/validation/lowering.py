"""Compiled blocks and float8 against measured runs: the predicted speedups beside the measured ones.

Measurements (none of them fitted: the pricing takes its constants from kernel sources, cost_models/float8.py,
cost_models/host.py):
- one H200, the torchtitan-style loop of ../shared/references/gpu_h200.md (a 16-layer, 2,048-wide Llama at
  4,096 tokens, 8 micro-batches of 1, FSDP2 on one GPU, bf16): 0.91 s eager, 0.76 s with every block compiled;
- torchtitan commit 7a04053 (pytorch/torchtitan, Jan 2025, its message): Llama 3 8B on 8 H100s, FSDP, 8,192
  tokens, local batch 1, selective (op) activation checkpointing, compiled: bf16 5,760 tokens/s per GPU, float8
  rowwise 6,424, float8 tensorwise with the float8 all-gather 7,186.
"""

from __future__ import annotations

__all__ = ["CHECKS", "run_checks", "markdown"]

LLAMA_1B = "llama:layers=16,hidden=2048,heads=32,kv_heads=8,ffn=8192,vocab=128256,seq=4096,rope_theta=500000"
_TT_8B = dict(dp=8, zero=3, micro_batch=1, global_batch=8, seq=8192, recompute="selective")
# (name, model, cluster, estimate options of the baseline, of the variant, measured baseline / variant time)
CHECKS = (
    ("H200 hand loop: eager -> compiled blocks", LLAMA_1B, "1x1xH200-141GB",
     dict(dp=1, micro_batch=1, global_batch=8), dict(compile=True), 0.91 / 0.76),
    ("torchtitan 8B, 8 H100: bf16 -> float8 rowwise (compiled)", "llama3-8b", "1x8xH100-80GB",
     dict(_TT_8B, compile=True), dict(float8="rowwise"), 6424 / 5760),
    ("torchtitan 8B, 8 H100: bf16 -> float8 tensorwise (compiled)", "llama3-8b", "1x8xH100-80GB",
     dict(_TT_8B, compile=True), dict(float8="tensorwise"), 7186 / 5760),
)


def run_checks() -> list[dict]:
    from autoshard.api import estimate_config

    rows = []
    for name, model, cluster, base, variant, measured in CHECKS:
        before, _ = estimate_config(model, cluster, **base)
        after, _ = estimate_config(model, cluster, **{**base, **variant})
        predicted = before.prediction.iteration_time_s / after.prediction.iteration_time_s
        rows.append({"check": name, "predicted_speedup": predicted, "measured_speedup": measured,
                     "error_pct": 100 * (predicted / measured - 1),
                     "predicted_s": [before.prediction.iteration_time_s, after.prediction.iteration_time_s]})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["# Compiled blocks and float8: predicted against measured speedups", "",
             "Written by `python scripts/validate_lowering.py` (autoshard/validation/lowering.py names the sources).",
             "", "| run | predicted speedup | measured | error |", "|---|---:|---:|---:|"]
    lines += [f"| {r['check']} | {r['predicted_speedup']:.3f}x | {r['measured_speedup']:.3f}x | "
              f"{r['error_pct']:+.1f}% |" for r in rows]
    return "\n".join(lines) + "\n"
