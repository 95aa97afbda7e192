"""Compiled blocks, float8 and async TP against measured runs: the predicted speedups beside the measured ones.

Measurements (none of them fitted: the pricing takes its constants from kernel sources, cost_models/float8.py,
cost_models/host.py; speedups are ratios of one source's own runs, so its hardware's absolute speed cancels):
- one H200, the torchtitan-style loop of ../shared/references/gpu_h200.md (a 16-layer, 2,048-wide Llama at
  4,096 tokens, 8 micro-batches of 1, FSDP2 on one GPU, bf16): 0.91 s eager, 0.76 s with every block compiled;
- torchtitan commit 7a04053 (pytorch/torchtitan, Jan 2025, its message): Llama 3 8B on 8 H100s, FSDP, 8,192
  tokens, local batch 1, selective (op) activation checkpointing, compiled: bf16 5,760 tokens/s per GPU, float8
  rowwise 6,424, float8 tensorwise with the float8 all-gather 7,186;
- torchtitan docs/performance.md Table 1 (Dec 2024, H100 96 GB at 500 W): Llama 3.1 8B on 8 GPUs, FSDP, local
  batch 2, selective activation checkpointing: 5,762 eager, 6,667 compiled, 8,532 compiled in float8;
- torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, vanilla TP, compiled: Llama 3 70B on 256 H100s
  (FSDP 32, TP 8, full AC, local batch 16): bf16 597.3, float8 tensorwise 809.8 tokens/s per GPU; Llama 3 8B on
  64 H100s (FSDP 8, TP 8, per-op SAC, local batch 12): 4,378 and 5,078.1. Its rowwise rows (599.6, 3,708.5) ran
  into a torchao slowdown of rowwise scaling under TP (pytorch/torchtitan issue #1207) and are left out;
- the same file's async TP columns (Inductor's micro-pipelined TP, `--tp-comm-overlap all` under `--compile`):
  70B bf16 652.4, float8 tensorwise 942.4; 8B bf16 4,809.4, float8 tensorwise 5,570.1 tokens/s per GPU.
"""

from __future__ import annotations

__all__ = ["CHECKS", "run_checks", "markdown"]

LLAMA_1B = "llama:layers=16,hidden=2048,heads=32,kv_heads=8,ffn=8192,vocab=128256,seq=4096,rope_theta=500000"
_TT_8B = dict(dp=8, zero=3, micro_batch=1, global_batch=8, seq=8192, recompute="selective")
_TT_TABLE1 = dict(dp=8, zero=3, micro_batch=2, global_batch=16, seq=8192, recompute="selective")
# torchtitan under TP computes the loss on the vocabulary shards (loss_parallel, on unless disabled)
_TP_70B = dict(tp=8, dp=32, zero=3, micro_batch=16, global_batch=512, seq=8192, recompute="full",
               sequence_parallel=True, compile=True, loss_parallel=True)
_TP_8B = dict(tp=8, dp=8, zero=3, micro_batch=12, global_batch=96, seq=8192, recompute="selective",
              sequence_parallel=True, compile=True, loss_parallel=True)
# (name, model, cluster, estimate options of the baseline, of the variant, measured baseline / variant time)
CHECKS = (
    ("H200 hand loop: eager -> compiled blocks", LLAMA_1B, "1x1xH200-141GB",
     dict(dp=1, micro_batch=1, global_batch=8), dict(compile=True), 0.91 / 0.76),
    ("torchtitan 8B, 8 H100 (7a04053): bf16 -> float8 rowwise (compiled)", "llama3-8b", "1x8xH100-80GB",
     dict(_TT_8B, compile=True), dict(float8="rowwise"), 6424 / 5760),
    ("torchtitan 8B, 8 H100 (7a04053): bf16 -> float8 tensorwise (compiled)", "llama3-8b", "1x8xH100-80GB",
     dict(_TT_8B, compile=True), dict(float8="tensorwise"), 7186 / 5760),
    ("torchtitan 8B, 8 H100 (Table 1): eager -> compiled blocks", "llama3-8b", "1x8xH100-80GB",
     _TT_TABLE1, dict(compile=True), 6667 / 5762),
    ("torchtitan 8B, 8 H100 (Table 1): compiled -> float8 tensorwise", "llama3-8b", "1x8xH100-80GB",
     dict(_TT_TABLE1, compile=True), dict(float8="tensorwise"), 8532 / 6667),
    ("torchtitan 70B, 256 H100, FSDP 32 x TP 8: bf16 -> float8 tensorwise", "llama3-70b", "32x8xH100-80GB",
     _TP_70B, dict(float8="tensorwise"), 809.8 / 597.3),
    ("torchtitan 8B, 64 H100, FSDP 8 x TP 8: bf16 -> float8 tensorwise", "llama3-8b", "8x8xH100-80GB",
     _TP_8B, dict(float8="tensorwise"), 5078.1 / 4378),
    ("torchtitan 70B, 256 H100, FSDP 32 x TP 8: vanilla -> async TP (bf16)", "llama3-70b", "32x8xH100-80GB",
     _TP_70B, dict(tp_comm_overlap="all"), 652.4 / 597.3),
    ("torchtitan 70B, 256 H100, FSDP 32 x TP 8: vanilla -> async TP (float8 tensorwise)", "llama3-70b",
     "32x8xH100-80GB", dict(_TP_70B, float8="tensorwise"), dict(tp_comm_overlap="all"), 942.4 / 809.8),
    ("torchtitan 8B, 64 H100, FSDP 8 x TP 8: vanilla -> async TP (bf16)", "llama3-8b", "8x8xH100-80GB",
     _TP_8B, dict(tp_comm_overlap="all"), 4809.4 / 4378),
    ("torchtitan 8B, 64 H100, FSDP 8 x TP 8: vanilla -> async TP (float8 tensorwise)", "llama3-8b",
     "8x8xH100-80GB", dict(_TP_8B, float8="tensorwise"), dict(tp_comm_overlap="all"), 5570.1 / 5078.1),
)


def run_checks() -> list[dict]:
    from autoshard.api import estimate_config

    rows = []
    for name, model, cluster, base, variant, measured in CHECKS:
        # every run fits where it ran (estimate_config refuses one that does not); the speedup is what is checked
        before, _ = estimate_config(model, cluster, **base)
        after, _ = estimate_config(model, cluster, **{**base, **variant})
        predicted = before.prediction.iteration_time_s / after.prediction.iteration_time_s
        rows.append({"check": name, "predicted_speedup": predicted, "measured_speedup": measured,
                     "error_pct": 100 * (predicted / measured - 1),
                     "predicted_s": [before.prediction.iteration_time_s, after.prediction.iteration_time_s]})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["# Compiled blocks, float8 and async TP: predicted against measured speedups", "",
             "Written by `python scripts/validate_lowering.py` (autoshard/validation/lowering.py names the sources).",
             "", "| run | predicted speedup | measured | error |", "|---|---:|---:|---:|"]
    lines += [f"| {r['check']} | {r['predicted_speedup']:.3f}x | {r['measured_speedup']:.3f}x | "
              f"{r['error_pct']:+.1f}% |" for r in rows]
    mean = sum(r["error_pct"] for r in rows) / len(rows)
    lines += ["", f"Mean signed error {mean:+.1f}% over {len(rows)} speedups; the sources are named in "
              "autoshard/validation/lowering.py."]
    return "\n".join(lines) + "\n"
