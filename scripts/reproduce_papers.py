"""The four source papers' headline claims, from autoshard's own cost model and planner.

    python scripts/reproduce_papers.py [--json]

For each claim: the configuration (model dims, GPUs per node, GPU and network profile, batch), both sides'
predicted figures, the ratio, and how the ratio moves across the details the paper leaves open. Nothing here
is tuned to these numbers; the cost model is validated on other measurements (benchmarks/published_validation.md).
Writes benchmarks/papers.md and benchmarks/papers.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # autoshard from this checkout

PAPERS = {
    "optimus_2d_vs_1d": 1.48, "3d_vs_1d": 2.32, "3d_vs_2d": 1.57, "osdp_vs_fsdp_gpt2": 1.22,
    "osdp_vs_fsdp_opt30b": 2.78, "lga_mpp_shortest_time": 2.0,
}


def _graph(spec: str, *, loss_inside: bool = True):
    """The operator graph of a spec model. With `loss_inside` the cross-entropy is part of the model, as in
    Megatron-LM, Optimus and Colossal-AI, which compute the loss on the tensor-parallel shards: the logits never
    leave their shards whole. Without it the model returns full-vocabulary logits, autoshard's runtime contract,
    and every plan pays for gathering them (a sweep entry shows what that does)."""
    from autoshard.capture import capture, capture_model
    from autoshard.capture.expand import expand_blocks
    from autoshard.models import load_model
    from autoshard.models.build import build_module
    from autoshard.models.spec import parse_spec

    if not loss_inside:
        return capture_model(load_model(spec))
    import torch
    import torch.nn.functional as F
    from torch import nn

    class WithLoss(nn.Module):
        def __init__(self, lm: nn.Module) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            logits = self.lm(ids).logits  # (B, T, V)
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    parsed = parse_spec(spec)
    ids = torch.zeros(2, parsed.seq, dtype=torch.long, device="meta")
    small = capture(WithLoss(build_module(parsed, layers=2)), (ids, ids), name=f"{spec} + loss")
    return expand_blocks(small, parsed.layers)


def _mesh(family: str, n: int):
    from autoshard.plans.layouts import MeshSpec

    if family == "1d":
        return MeshSpec.of(tp=n), 1
    q = round(n ** (1 / (2 if family == "2d" else 3)))
    if family == "2d" and q * q == n:
        return MeshSpec.of(tp_r=q, tp_c=q), q
    if family == "3d" and q ** 3 == n:
        return MeshSpec.of(tp_x=q, tp_y=q, tp_z=q), q * q
    raise ValueError(f"{n} GPUs do not form a {family} grid")


def _assignment(graph, family: str, mesh, b: int):
    """Megatron 1D over every GPU, or every Linear 2D / 3D with the rest chosen by the ILP."""
    from autoshard.cost_models.template import template_for
    from autoshard.planner.ilp import build_problem, extract_assignment, solve
    from autoshard.planner.manual import megatron_assignment
    from autoshard.plans.plan import PipelineSpec
    from autoshard.plans.strategies import strategies_for

    if family == "1d":
        return lambda ctx: megatron_assignment(graph, mesh, b)
    names = ("2d",) if family == "2d" else ("3d-yz", "3d-zy")
    tg, _ = template_for(graph, PipelineSpec())
    strategies = {}
    for op in tg.ops:
        cands = [s for s in strategies_for(op, mesh, b, zero_options=(0,)) if s.split == 1]
        if op.kind.value == "linear":
            cands = [s for s in cands if s.name in names] or cands
        strategies[op.name] = cands

    def solve_for(ctx):
        prob = build_problem(graph, ctx, PipelineSpec(), strategies, cap_bytes=math.inf)
        sol = solve(prob, time_limit_s=10)
        return extract_assignment(prob, sol) if sol.status != "infeasible" else None
    return solve_for


def tensor_family(graph, cluster, family: str, *, batch: int, recompute: str = "full"):
    """Best micro-batch for `family` over all GPUs of `cluster` at global batch `batch`:
    (Prediction or None, micro-batch)."""
    from autoshard.cost_models.context import PlanContext, default_precision
    from autoshard.cost_models.evaluate import evaluate
    from autoshard.plans.plan import PipelineSpec

    mesh, shard = _mesh(family, cluster.num_gpus)
    best = (None, 0)
    for b in (x for x in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if batch % x == 0 and x % shard == 0):
        ctx = PlanContext(mesh=mesh, cluster=cluster, micro_batch=b, num_microbatches=batch // b,
                          precision=default_precision(cluster), recompute=recompute, seq=graph.seq_len)
        assign = _assignment(graph, family, mesh, b)(ctx)
        if assign is None:
            continue
        pred = evaluate(graph, assign, ctx, PipelineSpec(), global_batch=batch).prediction
        if pred.memory.total_bytes <= cluster.device_memory_bytes and (
                best[0] is None or pred.iteration_time_s < best[0].iteration_time_s):
            best = (pred, b)
    return best


def max_batch(graph, cluster, family: str, recompute: str = "full") -> int:
    """Largest batch processed at once (one micro-batch) that fits in memory."""
    from autoshard.cost_models.context import PlanContext, default_precision
    from autoshard.cost_models.evaluate import evaluate
    from autoshard.plans.plan import PipelineSpec

    mesh, shard = _mesh(family, cluster.num_gpus)
    fits = 0
    b = shard
    while b <= 65536:
        ctx = PlanContext(mesh=mesh, cluster=cluster, micro_batch=b, num_microbatches=1,
                          precision=default_precision(cluster), recompute=recompute, seq=graph.seq_len)
        assign = _assignment(graph, family, mesh, b)(ctx)
        if assign is None:
            break
        pred = evaluate(graph, assign, ctx, PipelineSpec(), global_batch=b).prediction
        if pred.memory.total_bytes > cluster.device_memory_bytes:
            break
        fits, b = b, b * 2
    return fits


def _ratio(a, b) -> float | None:
    return round(a.tokens_per_s / b.tokens_per_s, 2) if a and b else None


def _tensor_claims(out: dict) -> None:
    from autoshard.hardware_profiles import ClusterSpec

    # Optimus (Xu et al. 2021): 64 GPUs of TACC Frontera's RTX nodes (4 Quadro RTX 5000 per node, InfiniBand);
    # its benchmark script: hidden 2048, 32 heads, batch 96, activation checkpointing. Not stated: layers and
    # sequence length -> 24 layers, 512 tokens (BERT-Large depth and length); the sweep shows the others.
    rtx = ClusterSpec.parse("16x4xRTX5000-16GB")
    spec = "gpt:layers=24,hidden=2048,heads=32,seq={seq},vocab=50304,attn=eager"
    sweep = {}
    for seq in (256, 512, 1024):
        g = _graph(spec.format(seq=seq))
        p1, _ = tensor_family(g, rtx, "1d", batch=96)
        p2, _ = tensor_family(g, rtx, "2d", batch=96)
        sweep[f"seq={seq}"] = _ratio(p2, p1)
        if seq == 512:
            mb1, mb2 = max_batch(g, rtx, "1d"), max_batch(g, rtx, "2d")
            out["optimus_2d_vs_1d"] = {
                "paper": PAPERS["optimus_2d_vs_1d"], "ratio": sweep["seq=512"],
                "config": {"model": "24 layers, hidden 2048, 32 heads, seq 512 (assumed), vocab 50304, loss on the "
                                    "shards", "cluster": str(rtx), "gpus_per_node": 4, "batch": 96,
                           "recompute": "full", "1d": "Megatron tp=64", "2d": "SUMMA 8 x 8"},
                "predicted": {"1d_tokens_per_s": p1.tokens_per_s if p1 else None,
                              "2d_tokens_per_s": p2.tokens_per_s if p2 else None},
                "max_batch": {"1d": mb1, "2d": mb2, "ratio": (mb2 / mb1) if mb1 else None, "paper": 8.0}}
    whole = _graph(spec.format(seq=512), loss_inside=False)
    sweep["logits returned whole"] = _ratio(tensor_family(whole, rtx, "2d", batch=96)[0],
                                            tensor_family(whole, rtx, "1d", batch=96)[0])
    out["optimus_2d_vs_1d"]["sweep"] = sweep
    # 3D (Bian et al. 2021): 64 V100s, 4 per node (TACC Longhorn), NVLink inside, InfiniBand EDR across. Not
    # stated here: model size -> a 24-layer transformer, hidden 4096, seq 512, batch 512; the sweep varies the
    # hidden size, the GPUs per node (8: DGX-1, 16: DGX-2) and returns the logits whole instead.
    spec = "gpt:layers=24,hidden={h},heads=64,seq=512,vocab=50304,attn=eager"
    families = ("1d", "2d", "3d")
    rows = {f"hidden={h}": _graph(spec.format(h=h)) for h in (2048, 4096, 8192)}
    v100 = ClusterSpec.parse("16x4xV100-32GB")
    preds = {k: {f: tensor_family(g, v100, f, batch=512)[0] for f in families} for k, g in rows.items()}
    for per_node in (8, 16):
        cluster = ClusterSpec.parse(f"{64 // per_node}x{per_node}xV100-32GB")
        preds[f"{per_node} GPUs per node"] = {f: tensor_family(rows["hidden=4096"], cluster, f, batch=512)[0]
                                              for f in families}
    whole = _graph(spec.format(h=4096), loss_inside=False)
    preds["logits returned whole"] = {f: tensor_family(whole, v100, f, batch=512)[0] for f in families}
    for name, a, b in (("3d_vs_1d", "3d", "1d"), ("3d_vs_2d", "3d", "2d")):
        sweep = {k: _ratio(p[a], p[b]) for k, p in preds.items()}
        out[name] = {"paper": PAPERS[name], "ratio": sweep["hidden=4096"], "sweep": sweep,
                     "config": {"model": "24 layers, hidden 4096 (assumed), 64 heads, seq 512, batch 512, loss on "
                                         "the shards", "cluster": str(v100), "gpus_per_node": 4,
                                "recompute": "full", "1d": "Megatron tp=64", "2d": "SUMMA 8 x 8", "3d": "4 x 4 x 4"},
                     "predicted": {f"{k}_tokens_per_s": (v.tokens_per_s if v else None)
                                   for k, v in preds["hidden=4096"].items()}}


def _osdp_claims(out: dict) -> None:
    from autoshard.api import plan_with_baselines

    cases = (("osdp_vs_fsdp_gpt2", "gpt:layers=48,hidden=1536,heads=16,seq=1024", 8, (8, 16, 32, 64), 32),
             ("osdp_vs_fsdp_opt30b", "gpt:layers=8,hidden=7168,heads=56,seq=2048,vocab=50272,ffn=28672", 16,
              (8, 16, 32), 8))
    for name, spec, cap, batches, chosen in cases:
        sweep, detail = {}, None
        for gb in batches:
            p, _, baselines, _, cluster = plan_with_baselines(spec, "1x8xA100-40GB-PCIe", global_batch=gb,
                                                              memory_cap=cap, space="dp,zero")
            z = baselines["zero3"].prediction
            sweep[f"global_batch={gb}"] = round(p.prediction.tokens_per_s / z.tokens_per_s, 2) if z else None
            if gb == chosen:
                detail = {"plan_tokens_per_s": p.prediction.tokens_per_s,
                          "fsdp_tokens_per_s": z.tokens_per_s if z else None,
                          "plan": f"{p.mesh}, micro-batch {p.micro_batch}, recompute {p.recompute}",
                          "fsdp": baselines["zero3"].config}
        out[name] = {"paper": PAPERS[name], "ratio": sweep[f"global_batch={chosen}"], "sweep": sweep,
                     "predicted": detail,
                     "config": {"model": spec, "cluster": "1x8xA100-40GB-PCIe (one 8-GPU PCIe node)",
                                "memory_cap_gib": cap, "global_batch": chosen, "space": "dp,zero (OSDP's)"}}


def _lga_claim(out: dict) -> None:
    from autoshard.validation import training_time as stt

    res = stt.analyse("gpt-1t", "A100-80GB", None, 1e12, 3072)  # the sweep of benchmarks/shortest_training_time
    b, i = res["baseline"]["best"], res["layered_modular"]["best"]
    out["lga_mpp_shortest_time"] = {
        "paper": PAPERS["lga_mpp_shortest_time"], "ratio": round(res["ratio"], 2),
        "config": {"model": "gpt-1t (128 layers, hidden 25600, seq 2048)", "cluster": "Nx8xA100-80GB, N swept",
                   "tokens": 1e12, "critical_batch_sequences": 3072},
        "predicted": {"baseline_days": b["days"], "baseline": f"{b['gpus']} GPUs, {b['config']}",
                      "layered_modular_days": i["days"], "layered_modular": f"{i['gpus']} GPUs, {i['config']}"},
        "sweep": {f"{r['gpus']} GPUs": round(r["days"], 1) for r in res["layered_modular"]["sweep"]},
        "sweep_unit": "days"}


NOTES = {
    "optimus_2d_vs_1d": "1D all-reduces activations over all 64 GPUs, i.e. across 16 nodes on one HDR100 port "
                        "each; 2D's traffic falls as 1/sqrt(p). The ratio depends on how network-bound 1D is. Both "
                        "sides compute the loss on their shards, as Megatron-LM and Optimus do; returning the "
                        "logits whole (autoshard's runtime contract) costs both sides a 64-way gather of "
                        "batch x seq x vocab values (sweep: 'logits returned whole').",
    "3d_vs_1d": "Same mechanism: 3D's traffic per GPU falls as p^(-2/3).",
    "3d_vs_2d": "Not reproduced (parity, not 1.57x), and why: per layer 3D moves 24% fewer bytes per GPU than 2D "
                "(2.0 vs 2.6 x N*h elements, REFERENCES.md §5) but where they go decides. Ranks are laid out "
                "row-major, tensor axes innermost: 2D's activation gathers run on tp_c (stride 1, 8 GPUs) and only "
                "its small weight gathers on tp_r; 3D's activations move on tp_z (stride 1) and tp_y (stride 4), "
                "its weights on tp_x (stride 16). With 4 GPUs per node (the paper's TACC nodes) tp_y has one GPU "
                "per node, so 3D's activation traffic on tp_y crosses InfiniBand, as 2D's on tp_c partly does "
                "(it spans two nodes): parity (0.99). With 8 per node tp_c fits in a node but tp_y still spans two: 0.84. "
                "With 16 per node both of 3D's activation axes are inside a node and 2D's tp_c is too, and 3D's "
                "smaller volume shows: 1.15 (sweep). The paper's 1.57x needs 3D's activation axes on faster links "
                "than 2D's, which a row-major layout of 4-GPU nodes does not give.",
    "osdp_vs_fsdp_gpt2": "OSDP's gain is FSDP's exposed gathers: it grows when compute per micro-batch is small "
                         "(small global batch) and vanishes when prefetch hides them (large batch).",
    "osdp_vs_fsdp_opt30b": "Same mechanism with 8 wide layers; replicating some operators within 16 GB removes "
                           "their gathers.",
    "lga_mpp_shortest_time": "At the critical batch, 1F1B's bubble grows as replicas get fewer micro-batches; "
                             "modular placement divides it by v and layered accumulation gathers parameters once "
                             "per step, which pays most where a replica has about as many micro-batches as stages "
                             "(the sweep above). With fewer, a micro-batch returns to a rank only after p "
                             "chunk-times and interleaving no longer divides the fill by v: both schedules end bound "
                             "by one micro-batch's latency through the model, so their shortest times nearly meet. "
                             "The paper's (p - 1)/(v·m) assumes m >= p.",
}


# A ratio of two predictions carries both predictions' error: the measured validation's ~10% per prediction
# (benchmarks/measured_validation.md, published_validation.md) gives about +-15% on a ratio.
RATIO_TOLERANCE = 0.15


def verdict(c: dict) -> tuple[str, tuple[float, float] | None]:
    """("reproduced" | "direction only" | "NOT reproduced", allowed range). A claim is reproduced when the paper's
    ratio lies in the range the setup allows: the ratios predicted over the sweep of details the paper leaves
    open (and the central choice), widened by RATIO_TOLERANCE. Both above 1 but outside it: the direction only."""
    if c["ratio"] is None:
        return "NOT reproduced", None
    values = [c["ratio"]]
    if "sweep_unit" not in c:
        values += [v for v in c.get("sweep", {}).values() if v is not None]
    lo, hi = min(values) * (1 - RATIO_TOLERANCE), max(values) * (1 + RATIO_TOLERANCE)
    if lo <= c["paper"] <= hi:
        return "reproduced", (lo, hi)
    if (c["ratio"] > 1) == (c["paper"] > 1):
        return "direction only", (lo, hi)
    return "NOT reproduced", (lo, hi)


def _markdown(res: dict) -> str:
    lines = ["# The source papers' claims, reproduced with autoshard's cost model", "",
             "Generated by `python scripts/reproduce_papers.py`. Both sides of each claim are priced by the same "
             "cost model (validated on published runs, never tuned to these papers). Details the papers leave open "
             "are chosen as stated and swept. A claim is *reproduced* when the paper's ratio lies in the range its "
             "setup allows: the ratios predicted over that sweep, widened by "
             f"{RATIO_TOLERANCE:.0%} (the validated error of two predictions); *direction only* when both favour "
             "the same side but the paper's figure is outside that range.", "",
             "| claim | paper | autoshard | allowed range | verdict | sweep |", "|---|---:|---:|---|---|---|"]
    for name, c in res["claims"].items():
        word, rng = verdict(c)
        sweep = ", ".join(f"{k}: {v}" for k, v in c.get("sweep", {}).items())
        rng_text = f"{rng[0]:.2f}-{rng[1]:.2f}x" if rng else ""
        lines.append(f"| {name} | {c['paper']}x | {c['ratio']}x | {rng_text} | {word} | {sweep} |")
    opt = res["claims"]["optimus_2d_vs_1d"]["max_batch"]
    lines += ["", f"Optimus maximum batch (one micro-batch, activation checkpointing): 1D {opt['1d']}, 2D {opt['2d']}"
              f" -> {opt['ratio']}x (paper: 8x).", ""]
    for name, c in res["claims"].items():
        lines += [f"## {name}", "", f"- configuration: {json.dumps(c['config'])}",
                  f"- predicted: {json.dumps(c.get('predicted'))}", f"- why: {c['note']}", ""]
    return "\n".join(lines)


def _claims_of(groups: tuple[str, ...]) -> dict:
    out: dict = {}
    for group in groups:
        {"tensor": _tensor_claims, "osdp": _osdp_claims, "lga": _lga_claim}[group](out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    claims: dict = {}
    # two independent halves of about the same length, one per core (the tensor claims capture 8 graphs)
    with concurrent.futures.ProcessPoolExecutor(max_workers=2) as pool:
        for part in pool.map(_claims_of, (("tensor",), ("osdp", "lga"))):
            claims |= part
    for name in claims:
        claims[name]["note"] = NOTES[name]
    res = {"claims": {k: claims[k] for k in PAPERS}, "seconds": round(time.perf_counter() - t0, 1)}
    if not a.no_write:
        (ROOT / "benchmarks").mkdir(exist_ok=True)
        (ROOT / "benchmarks" / "papers.md").write_text(_markdown(res))
        (ROOT / "benchmarks" / "papers.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(json.dumps(res, indent=1, default=str) if a.json else _markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
