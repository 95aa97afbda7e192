"""What must hold whatever the constants are: `estimate` over a grid of layouts, checked for physical invariants.

    python scripts/check_invariants.py

Published runs check the cost model where someone measured; this checks it everywhere else, against facts that
need no measurement. Over 5 models (GPT 1.3B / 13B / 175B, Llama 3 8B / 70B, flash attention), A100 and H100,
8 / 64 / 512 GPUs, tp 1/2/8 x pp 1/4/8 x the rest dp, ZeRO 0-3, recompute none / selective / full, micro-batch
1 / 2 (8 micro-batches per replica), it counts the configurations where

- recomputing more makes the step faster;
- a higher ZeRO stage needs more memory;
- more GPUs at the same work per GPU (dp x 8) make the step faster, the optimizer step and ZeRO-2/3's
  gradient-shard adds left out (ZeRO-1-3 shard the step over dp, ZeRO-2/3 the fp32 gradient shard each later
  micro-batch is added to, so those do shrink; everything else may not);
- H100 is slower than A100 on the same layout;

and, over 3 models on A100 with 1F1B / interleaved pipelines, where more micro-batches raise the time per
sample, or a faster network (8 HDR ports per node against 4) is slower. Only layouts that fit in 80 GB count.
Writes benchmarks/cost_invariants.md and .json. A script, not a test: it prices about 6,000 configurations
(a few minutes); `tests/test_fuzz_planner.py` checks the recompute invariant on random layouts in CI.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from autoshard.capture import capture_ref
from autoshard.cost_models.compute import memory_bound_time_s
from autoshard.cost_models.memory import BF16_MIXED
from autoshard.hardware_profiles import ClusterSpec
from autoshard.planner.estimate import HandConfig, estimate

OUT = Path(__file__).resolve().parent.parent / "benchmarks"
MODELS = {
    "gpt-1.3b": "gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=51200",
    "gpt-13b": "gpt:layers=40,hidden=5120,heads=40,seq=2048,vocab=51200",
    "gpt-175b": "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200",
    "llama-8b": "llama:layers=32,hidden=4096,heads=32,seq=8192,vocab=128256,ffn=14336,kv_heads=8",
    "llama-70b": "llama:layers=80,hidden=8192,heads=64,seq=4096,vocab=128256,ffn=28672,kv_heads=8",
}
KEY = ("model", "gpu", "gpus", "tp", "pp", "dp", "zero", "recompute", "micro_batch")


def _layouts(graphs):
    for name, graph in graphs.items():
        for gpu in ("A100-80GB", "H100-80GB"):
            for nodes in (1, 8, 64):
                cluster = ClusterSpec.parse(f"{nodes}x8x{gpu}")
                for tp in (1, 2, 8):
                    for pp in (1, 4, 8):
                        if tp * pp > nodes * 8:
                            continue
                        dp = nodes * 8 // (tp * pp)
                        for zero in (0, 1, 2, 3):
                            for rc in ("none", "selective", "full"):
                                for mb in (1, 2):
                                    yield (name, gpu, nodes * 8, tp, pp, dp, zero, rc, mb), graph, cluster


def grid(graphs) -> dict[tuple, dict]:
    out = {}
    for key, graph, cluster in _layouts(graphs):
        _, _, _, tp, pp, dp, zero, rc, mb = key
        cfg = HandConfig(tp=tp, pp=pp, dp=dp, micro_batch=mb, global_batch=dp * mb * 8, recompute=rc,
                         sequence_parallel=tp > 1, zero=zero)
        p = estimate(graph, cluster, cfg)[1].prediction
        out[key] = {"time_s": p.iteration_time_s, "gib": p.memory.total_bytes / 2**30, "mfu": p.mfu,
                    "dp_sharded_s": p.time.optimizer_s + _shard_adds_s(graph, cluster, key)}
    return out


def _shard_adds_s(graph, cluster, key) -> float:
    """ZeRO-2/3's adds into the gradient shard (cost_models/opcost.py `_grad_accumulation_s`), for all parameters:
    7 of the 8 micro-batches add 3 fp32 accesses per element of the rank's 1/(tp pp dp) share (kernel launches
    left out, so this is at most what the step spends on them)."""
    _, _, _, tp, pp, dp, zero, _, _ = key
    if zero < 2:
        return 0.0
    local = graph.num_params / (tp * pp * dp)
    return 7 * memory_bound_time_s(3 * BF16_MIXED.main_grad_bytes * local, cluster.gpu, kernels=0)


def grid_checks(rows: dict[tuple, dict]) -> dict[str, list]:
    fits = {k: v for k, v in rows.items() if v["gib"] <= 80}
    found = {"recomputing more is faster": [], "a higher ZeRO stage needs more memory": [],
             "more GPUs at the same work per GPU are faster": [], "H100 is slower than A100": []}

    def other(key, **change):
        d = dict(zip(KEY, key, strict=True))
        d.update(change)
        return tuple(d[k] for k in KEY)

    for key, v in fits.items():
        d = dict(zip(KEY, key, strict=True))
        for a, b in (("none", "selective"), ("selective", "full")):
            o = fits.get(other(key, recompute=b)) if d["recompute"] == a else None
            if o and o["time_s"] < v["time_s"] * (1 - 1e-9):
                found["recomputing more is faster"].append((d, o["time_s"] / v["time_s"]))
        o = rows.get(other(key, zero=d["zero"] + 1)) if d["zero"] < 3 else None
        if o and o["gib"] > v["gib"] * 1.01:
            found["a higher ZeRO stage needs more memory"].append((d, o["gib"] / v["gib"]))
        o = fits.get(other(key, gpus=d["gpus"] * 8, dp=d["dp"] * 8))
        if o and o["time_s"] - o["dp_sharded_s"] < (v["time_s"] - v["dp_sharded_s"]) * (1 - 1e-9):
            ratio = (o["time_s"] - o["dp_sharded_s"]) / (v["time_s"] - v["dp_sharded_s"])
            found["more GPUs at the same work per GPU are faster"].append((d, ratio))
        o = fits.get(other(key, gpu="H100-80GB")) if d["gpu"] == "A100-80GB" else None
        if o and o["time_s"] > v["time_s"]:
            found["H100 is slower than A100"].append((d, o["time_s"] / v["time_s"]))
    return found


# A micro-batch after the first adds its gradients into the ones kept (autograd assigns the first): one kernel per
# parameter, which can cost more than the optimizer step that more micro-batches amortize (ZeRO-3 over 64 ranks at
# TP 8: +0.01% per sample from 4 to 16 micro-batches). Real, and small: rises beyond 0.1% are counted.
MICRO_BATCH_SLACK = 1e-3


def pipeline_checks(graphs) -> tuple[int, dict[str, list]]:
    found = {"more micro-batches raise the time per sample": [], "a faster network is slower": []}
    checked = 0
    for name in ("gpt-1.3b", "gpt-13b", "llama-8b"):
        for nodes in (8, 64):
            for tp, pp in ((1, 4), (2, 4), (8, 4), (8, 1)):
                dp = nodes * 8 // (tp * pp)
                for zero in (0, 1, 2, 3):
                    for vp in ((1, 2) if pp > 1 else (1,)):
                        t = {}
                        for net in ("ib-hdr-4x200", "ib-hdr-8x200"):
                            cluster = ClusterSpec.parse(f"{nodes}x8xA100-80GB@{net}")
                            for per in (4, 8, 16):
                                cfg = HandConfig(tp=tp, pp=pp, dp=dp, micro_batch=1, global_batch=dp * per,
                                                 recompute="full", sequence_parallel=tp > 1, zero=zero,
                                                 virtual_stages=vp)
                                t[net, per] = estimate(graphs[name], cluster, cfg)[1].prediction.iteration_time_s / per
                        checked += 1
                        key = dict(model=name, gpus=nodes * 8, tp=tp, pp=pp, dp=dp, zero=zero, virtual_stages=vp)
                        for net in ("ib-hdr-4x200", "ib-hdr-8x200"):
                            a, b, c = (t[net, p] for p in (4, 8, 16))
                            if b > a * (1 + MICRO_BATCH_SLACK) or c > b * (1 + MICRO_BATCH_SLACK):
                                found["more micro-batches raise the time per sample"].append((key, c / a))
                        for p in (4, 8, 16):
                            ratio = t["ib-hdr-8x200", p] / t["ib-hdr-4x200", p]
                            if ratio > 1 + 1e-9:
                                found["a faster network is slower"].append((key, ratio))
    return checked, found


def main() -> None:
    t0 = time.time()
    graphs = {n: capture_ref(spec, attn="flash") for n, spec in MODELS.items()}
    rows = grid(graphs)
    found = grid_checks(rows)
    n_pipe, more = pipeline_checks(graphs)
    found.update(more)
    fits = sum(1 for v in rows.values() if v["gib"] <= 80)
    lines = ["# Cost-model invariants", "",
             f"Generated by `python scripts/check_invariants.py` ({time.time() - t0:.0f} s). {len(rows):,} layouts "
             f"priced ({fits:,} fit in 80 GB), plus {n_pipe} pipelined layouts on two networks x three batch "
             "sizes. Each row counts the layouts where a fact that needs no measurement fails (see the script's "
             "docstring); the examples are the largest violations.", "",
             "| invariant broken | layouts | largest ratio | example |", "|---|---:|---:|---|"]
    for what, hits in found.items():
        hits.sort(key=lambda h: -abs(1 - h[1]))
        example = ", ".join(f"{k}={v}" for k, v in hits[0][0].items()) if hits else ""
        lines.append(f"| {what} | {len(hits)} | {hits[0][1]:.3f} | {example} |" if hits else f"| {what} | 0 | | |")
    OUT.joinpath("cost_invariants.md").write_text("\n".join(lines) + "\n")
    OUT.joinpath("cost_invariants.json").write_text(json.dumps(
        {what: [{"layout": k, "ratio": r} for k, r in hits]
         for what, hits in found.items()}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
