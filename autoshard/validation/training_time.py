"""Shortest time to train on a token budget under the critical-batch-size limit (Lamy-Poirier 2021).

    python scripts/shortest_training_time.py [--model gpt-1t] [--gpu A100-80GB] [--tokens 1e12]
                                             [--batch 3072] [--json]

The batch cannot grow past the critical batch size, so more GPUs only help while each step gets faster.
With depth-first gradient accumulation and contiguous pipeline stages a step pays a pipeline bubble of
(p - 1)/m micro-batches, and ZeRO-3 re-gathers every parameter for every micro-batch; more GPUs mean fewer
micro-batches per replica, so both costs grow until adding GPUs stops paying. Layered (breadth-first)
accumulation gathers each parameter once per step and overlaps gradient reduction with the whole backward;
modular (round-robin) placement cuts the bubble to (p - 1)/(v·m). Both runs below use Megatron-style
layouts (tensor parallel 8 inside a node, pipeline across nodes, data parallel outermost) priced by autoshard's
cost model; they differ only in the schedules allowed:
    baseline: 1F1B with contiguous stages;
    improved: 1F1B, interleaved (modular) and looped breadth-first (layered + modular).
Writes benchmarks/shortest_training_time.md and .json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: references/, benchmarks/, tests/data/
BASELINE = ("1f1b",)
IMPROVED = ("1f1b", "interleaved-1f1b", "looped-bfs")


@dataclass
class Best:
    gpus: int
    config: str
    step_s: float
    days: float
    mfu: float
    memory_gib: float


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pipes(graph, pp: int, schedules, layers: int):
    from autoshard.cost_models.bounds import block_costs
    from autoshard.planner.stages import balanced_stage_layers
    from autoshard.plans.plan import PipelineSpec

    if pp == 1:
        yield PipelineSpec()
        if "looped-bfs" in schedules:
            yield PipelineSpec(schedule="looped-bfs", layered=True)
        return
    pre, block, post = block_costs(graph)
    for schedule in schedules:
        vs = [1] if schedule == "1f1b" else [v for v in (2, 4, 8, 16, 32) if layers % (pp * v) == 0]
        if schedule == "looped-bfs" and layers % pp == 0:
            vs = sorted(set(vs) | {layers // pp})  # modular: one layer per chunk
        for v in vs:
            if layers < pp * v:
                continue
            yield PipelineSpec(degree=pp, schedule=schedule, virtual_stages=v, layered=schedule == "looped-bfs",
                               stage_layers=balanced_stage_layers(layers, pp, v, pre, block, post))


def best_step(graph, cluster, batch: int, schedules, *, tp: int = 8) -> Best | None:
    """Fastest Megatron-style configuration of `graph` at global batch `batch` on `cluster`."""
    from autoshard.cost_models.bounds import memory_lower_bound_bytes, time_lower_bound_s
    from autoshard.cost_models.context import PlanContext, default_precision
    from autoshard.cost_models.evaluate import evaluate, inflight_microbatches, pipeline_fill
    from autoshard.errors import ConfigurationError
    from autoshard.planner.manual import megatron_assignment
    from autoshard.plans.layouts import MeshSpec

    n, layers, prec = cluster.num_gpus, graph.num_layers, default_precision(cluster)
    cap = cluster.device_memory_bytes
    found: list = []
    for pp in _divisors(layers):
        if n % (tp * pp) or batch % (n // (tp * pp)):
            continue
        dp = n // (tp * pp)
        for b in (1, 2, 4):
            if (batch // dp) % b:
                continue
            m = batch // (dp * b)
            for pipe in _pipes(graph, pp, schedules, layers):
                for rc, zero in (("full", 0), ("full", 1), ("full", 3), ("selective", 1)):
                    if zero == 3 and dp == 1:
                        continue
                    mem = memory_lower_bound_bytes(graph, prec, tp_degree=tp, pp=pp, dp=dp, max_zero=zero,
                                                   micro_batch=b, inflight=inflight_microbatches(0, pipe, m),
                                                   recompute=rc)
                    if mem > cap:
                        continue
                    lb = time_lower_bound_s(graph, cluster.gpu, prec, tp_degree=tp, pp=pp, micro_batch=b,
                                            num_microbatches=m, fill=pipeline_fill(pipe, m), recompute=rc)
                    found.append((lb, pp, dp, b, m, pipe, rc, zero))
    best = None
    for lb, pp, dp, b, m, pipe, rc, zero in sorted(found, key=lambda x: x[0]):
        if best is not None and lb >= best.step_s:
            break
        mesh = MeshSpec.of(**{a: d for a, d in (("pp", pp), ("dp", dp), ("tp", tp)) if d > 1})
        try:
            assign = megatron_assignment(graph, mesh, b, sequence_parallel=True, zero=zero)
        except ConfigurationError:
            continue
        ctx = PlanContext(mesh=mesh, cluster=cluster, micro_batch=b, num_microbatches=m, precision=prec,
                          recompute=rc, seq=graph.seq_len)
        pred = evaluate(graph, assign, ctx, pipe, global_batch=batch, check_tied=False).prediction
        if pred.memory.total_bytes > cap or (best is not None and pred.iteration_time_s >= best.step_s):
            continue
        sched = "" if pp == 1 and not pipe.layered else f", {pipe.schedule} x{pipe.virtual_stages}"
        best = Best(gpus=n, config=f"tp={tp} pp={pp} dp={dp}{sched}, micro-batch {b}, recompute {rc}, zero {zero}",
                    step_s=pred.iteration_time_s, days=math.nan, mfu=pred.mfu,
                    memory_gib=pred.memory.total_bytes / 2**30)
    return best


def shortest_time(model: str, gpu: str, network: str | None, tokens: float, batch: int, schedules,
                  node_counts) -> tuple[Best | None, list[Best]]:
    from autoshard.capture import capture_model
    from autoshard.hardware_profiles import ClusterSpec
    from autoshard.models import load_model

    graph = capture_model(load_model(model, attn="flash"))
    steps = tokens / (batch * graph.seq_len)
    sweep = []
    for nodes in node_counts:
        cluster = ClusterSpec.parse(f"{nodes}x8x{gpu}" + (f"@{network}" if network else ""))
        best = best_step(graph, cluster, batch, schedules)
        if best is not None:
            best.days = best.step_s * steps / 86400
            sweep.append(best)
    return (min(sweep, key=lambda b: b.days) if sweep else None), sweep


def analyse(model: str = "gpt-1t", gpu: str = "A100-80GB", network: str | None = None, tokens: float = 1e12,
            batch: int = 3072, node_counts=(64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)) -> dict:
    out = {"model": model, "gpu": gpu, "network": network, "tokens": tokens, "batch": batch}
    for name, schedules in (("baseline", BASELINE), ("layered_modular", IMPROVED)):
        best, sweep = shortest_time(model, gpu, network, tokens, batch, schedules, node_counts)
        out[name] = {"best": vars(best) if best else None, "sweep": [vars(b) for b in sweep]}
    b, i = out["baseline"]["best"], out["layered_modular"]["best"]
    out["ratio"] = b["days"] / i["days"] if b and i else None
    return out


def _report(res: dict) -> str:
    lines = [f"# Shortest training time: {res['model']} on {res['gpu']}" + (f" ({res['network']})" if res["network"]
                                                                             else ""), "",
             f"Generated by `python scripts/shortest_training_time.py --model {res['model']} --gpu {res['gpu']}`. "
             f"Token budget {res['tokens']:.3g}, global batch fixed at the critical batch size of {res['batch']} "
             "sequences. For each cluster size, the fastest Megatron-style configuration (TP 8 in a node, PP across "
             "nodes, DP outermost; recompute, micro-batch and ZeRO level searched) with the schedules allowed.", "",
             "| GPUs | baseline (1F1B) days | config | layered + modular days | config |", "|---:|---:|---|---:|---|"]
    base = {r["gpus"]: r for r in res["baseline"]["sweep"]}
    imp = {r["gpus"]: r for r in res["layered_modular"]["sweep"]}
    for g in sorted(set(base) | set(imp)):
        b, i = base.get(g), imp.get(g)
        lines.append(f"| {g} | {b['days']:.1f} | {b['config']} | {i['days']:.1f} | {i['config']} |" if b and i else
                     f"| {g} | {'-' if not b else round(b['days'], 1)} | | {'-' if not i else round(i['days'], 1)} | |")
    b, i = res["baseline"]["best"], res["layered_modular"]["best"]
    gains = {g: base[g]["days"] / imp[g]["days"] for g in set(base) & set(imp)}
    top = max(gains, key=gains.get) if gains else None
    lines += ["", f"Shortest: baseline {b['days']:.1f} days on {b['gpus']} GPUs; layered + modular {i['days']:.1f} days "
              f"on {i['gpus']} GPUs: **{res['ratio']:.2f}x** shorter (Lamy-Poirier 2021 claims about 2x)."
              + (f" At one cluster size the largest gain is {gains[top]:.2f}x ({top} GPUs)." if top else ""), "",
              "Where the gain comes from, and where it stops: at the critical batch, adding GPUs shrinks the "
              "micro-batches per replica m, so 1F1B's fill of p - 1 micro-batch slots weighs more; layered "
              "accumulation gathers ZeRO-sharded parameters once per step, and modular placement cuts the fill to "
              "(p - 1)/v while a round has at least p micro-batches. Below that a micro-batch comes back to a rank "
              "only after p chunk-times and the fill is p - m + (m - 1)/v (torch's ScheduleInterleaved1F1B, "
              "simulated: tests/test_cost_mechanisms.py), which tends to 1F1B's p - 1 as m falls: one micro-batch's "
              "latency through the model bounds every schedule. Both schedules end there at the largest clusters; "
              "the paper's (p - 1)/(v·m), and its about 2x, hold only while m >= p."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-1t")
    ap.add_argument("--gpu", default="A100-80GB")
    ap.add_argument("--network", default=None, help="inter-node network profile (default: the GPU's usual)")
    ap.add_argument("--tokens", type=float, default=1e12)
    ap.add_argument("--batch", type=int, default=3072, help="critical batch size in sequences")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = analyse(a.model, a.gpu, a.network, a.tokens, a.batch)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    if not a.no_write:
        stem = "shortest_training_time" + ("" if a.network is None else f"_{a.network}")
        (ROOT / "benchmarks").mkdir(exist_ok=True)
        (ROOT / "benchmarks" / f"{stem}.md").write_text(_report(res))
        (ROOT / "benchmarks" / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1) if a.json else _report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
