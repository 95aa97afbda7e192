"""The truth loop on this machine: profile the local gloo cluster, predict plans with that profile, run them,
compare. Writes benchmarks/measured_validation.md and .json (issue 14).

    python scripts/validate_measured.py [--repeats 3] [--steps 6] [--warmup 2] [--profile-rounds 3]
                                        [--skip-profile] [--only NAMES]

1. `autoshard profile --quick` on 2 and on 4 CPU ranks (torchrun), `--profile-rounds` times each: one round
   before the first measured pass and one after each pass but the last (P1 M1 P2 M2 P3 M3), so the rounds span the minutes
   the plans are measured in; every number of the profile is the median over the rounds (one slow minute moved
   a single round's host costs by 50-70%; within one run on 2026-11-26 kernel launch, DTensor dispatch and the
   optimizer's per-tensor cost moved 50-63% between rounds) ->
   benchmarks/measured/cpu{2,4}.yaml, and the rounds' spread of the figures that matter most is reported;
2. plans of a small GPT, a small Llama and a small mixture-of-experts model on 2 and 4 ranks: data parallel,
   ZeRO-1/2/3, ZeRO per operator, 1D tensor parallel, 1D + sequence parallel, 2D, pipelines (GPipe, 1F1B,
   interleaved, looped BFS), other micro-batches, recompute full and selective, context parallel (K/V
   all-gathered; priced on the rank-local graph), expert parallel (all-to-all routing), and the planner's own
   choice, made on the first round's profile;
3. every plan run on the ranks (one torchrun per world size and pass; `--repeats` passes over all plans,
   `--steps` timed steps each, after `--warmup`): the measured step is the median over passes of the median step;
4. every plan (the planner's choices too) priced on the median profile of the ranks it runs on; per plan
   predicted, measured and error; MAPE, Kendall's tau of the orderings, and the rank of the planner's choice
   among the measured plans of its model and world size.

A benchmark, not a test: it takes tens of minutes and its figures depend on this machine's load (the spread
of the passes is reported). Ranks share the machine's cores: 4 ranks on 2 cores is part of what is measured.
"""

# Over 400 lines on purpose: the ranks run this file's worker (torchrun imports it as __main__), and the
# report's text sits beside the code that measures what it says.
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks"
PROFILES = OUT / "measured"
sys.path.insert(0, str(ROOT / "tests" / "distributed"))  # dist_plans: hand-made 2D and per-op ZeRO plans

GPT = "gpt:layers=4,hidden=256,heads=4,seq=128,vocab=512"
LLAMA = "llama:layers=4,hidden=256,heads=4,ffn=688,seq=128,vocab=512"
MOE = "mixtral:layers=4,hidden=256,heads=4,ffn=512,seq=128,vocab=512,experts=4,top_k=2"
LABELS = {GPT: "gpt", LLAMA: "llama", MOE: "moe"}
BATCH = 8
# (name, model, world, estimate-style config or a hand-made family): each is one measured plan
CONFIGS = [
    ("llama-dp4", LLAMA, 4, dict(dp=4, micro_batch=2)),
    ("llama-dp4-mb1", LLAMA, 4, dict(dp=4, micro_batch=1)),
    ("llama-zero1", LLAMA, 4, dict(dp=4, micro_batch=1, zero=1)),
    ("llama-zero2", LLAMA, 4, dict(dp=4, micro_batch=1, zero=2)),
    ("llama-zero3", LLAMA, 4, dict(dp=4, micro_batch=2, zero=3)),
    ("llama-zero-per-op", LLAMA, 4, "mixed-zero"),
    ("llama-dp4-full", LLAMA, 4, dict(dp=4, micro_batch=2, recompute="full")),
    ("llama-tp4", LLAMA, 4, dict(tp=4, dp=1, micro_batch=8)),
    ("llama-tp2-dp2", LLAMA, 4, dict(tp=2, dp=2, micro_batch=4)),
    ("llama-tp2-dp2-sp", LLAMA, 4, dict(tp=2, dp=2, micro_batch=4, sequence_parallel=True)),
    ("llama-tp2-dp2-sel", LLAMA, 4, dict(tp=2, dp=2, micro_batch=4, recompute="selective")),
    ("llama-2d", LLAMA, 4, "2d"),
    ("llama-pp2-dp2-1f1b", LLAMA, 4, dict(pp=2, dp=2, micro_batch=2)),
    ("llama-pp2-dp2-interleaved", LLAMA, 4, dict(pp=2, dp=2, micro_batch=1, virtual_stages=2)),
    ("llama-pp2-dp2-looped-bfs", LLAMA, 4, dict(pp=2, dp=2, micro_batch=1, virtual_stages=2,
                                                 schedule="looped-bfs", zero=3)),
    ("llama-pp4-gpipe", LLAMA, 4, dict(pp=4, micro_batch=2, schedule="gpipe")),
    ("llama-pp2-tp2-1f1b", LLAMA, 4, dict(pp=2, tp=2, micro_batch=2)),  # scattered sends, gathered in the stage
    ("gpt-dp2", GPT, 2, dict(dp=2, micro_batch=4)),
    ("gpt-zero3-2", GPT, 2, dict(dp=2, micro_batch=2, zero=3)),
    ("gpt-tp2", GPT, 2, dict(tp=2, dp=1, micro_batch=8)),
    ("gpt-pp2-1f1b", GPT, 2, dict(pp=2, micro_batch=2)),
    ("gpt-dp4", GPT, 4, dict(dp=4, micro_batch=2)),
    ("gpt-tp2-dp2", GPT, 4, dict(tp=2, dp=2, micro_batch=4)),
    # context parallel (issue 16): priced on the rank-local graph (seq / cp tokens), K/V all-gathered
    ("gpt-cp2", GPT, 2, dict(cp=2, dp=1, micro_batch=4)),
    ("llama-dp2-cp2", LLAMA, 4, dict(cp=2, dp=2, micro_batch=2)),
    ("llama-cp2-tp2", LLAMA, 4, dict(cp=2, tp=2, dp=1, micro_batch=4)),  # attention on the rank's heads
    # expert parallel (issue 16): a 4-expert top-2 MoE, its experts over ep of the dp ranks, all-to-all routing
    ("moe-dp2", MOE, 2, dict(dp=2, micro_batch=4)),
    ("moe-ep2", MOE, 2, dict(dp=2, ep=2, micro_batch=4)),
    ("moe-ep4", MOE, 4, dict(dp=4, ep=4, micro_batch=2)),
    ("moe-dp4-ep2-zero3", MOE, 4, dict(dp=4, ep=2, micro_batch=2, zero=3)),
    # the experts (and router) replicated on tp, the rest Megatron 1D
    ("moe-tp2-dp2", MOE, 4, dict(tp=2, dp=2, micro_batch=2)),
    ("moe-dp2-ep2-tp2", MOE, 4, dict(tp=2, dp=2, ep=2, micro_batch=2)),
]


def profile_file(world: int) -> Path:
    return PROFILES / f"cpu{world}.yaml"


# the profile figures most predictions lean on: (label, path into the profile file)
SPREAD_FIELDS = (("best GEMM TFLOP/s", ("gpu", "peak_tflops")), ("memory GB/s", ("gpu", "hbm_gbps")),
                 ("kernel launch us", ("gpu", "kernel_launch_us")), ("FSDP us per module", ("gpu", "fsdp_us_per_module")),
                 ("DTensor us per op", ("gpu", "dtensor_us_per_op")),
                 ("optimizer us per tensor", ("gpu", "optimizer_us_per_tensor")),
                 ("collective sync us", ("intra", "sync_us")), ("all-reduce GB/s", ("intra", "busbw_gbps", "all_reduce")))


def profile_spread(rounds: list[dict]) -> dict[str, dict[str, float]]:
    """Per figure of SPREAD_FIELDS: min, median and max over the rounds, and (max - min) / median in %."""
    out = {}
    for label, path in SPREAD_FIELDS:
        values = []
        for r in rounds:
            v = r
            for key in path:
                v = v[key]
            values.append(float(v))
        mid = statistics.median(values)
        out[label] = {"min": min(values), "median": mid, "max": max(values),
                      "spread_pct": (max(values) - min(values)) / mid * 100 if mid else 0.0}
    return out


def profile_round(worlds: list[int], got: dict[int, list[dict]], headers: dict[int, str], label: str) -> None:
    """One quick profile per world size, appended to `got[world]`; each world's file rewritten as the median
    of its rounds so far (header kept)."""
    import yaml

    from autoshard.measure.profile import merge_rounds

    with tempfile.TemporaryDirectory() as tmp:
        for w in worlds:
            print(f"profiling {w} ranks ({label}) ...", flush=True)
            out = Path(tmp, f"cpu{w}.yaml")
            torchrun(w, "-m", "autoshard", "profile", "--quick", "--quiet", "-o", str(out))
            text = out.read_text()
            got.setdefault(w, []).append(yaml.safe_load(text))
            headers.setdefault(w, "".join(line for line in text.splitlines(keepends=True) if line.startswith("#")))
    for w in worlds:
        n = len(got[w])
        note = (f"# Each number is the median of {n} rounds of `autoshard profile --quick` on {w} ranks, taken "
                "before and between the measured passes (scripts/validate_measured.py).\n")
        profile_file(w).write_text(headers[w] + note + yaml.safe_dump(merge_rounds(got[w]), sort_keys=False,
                                                                      width=200, default_flow_style=None))


def run(cmd: list[str], timeout_s: float) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout_s, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("W1"))[-3000:]
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")


def torchrun(world: int, *args: str, timeout_s: float = 7200) -> None:
    run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), *args], timeout_s)


# -- plans -----------------------------------------------------------------------------------------------------
@functools.cache
def _graphs() -> dict:
    from autoshard.capture import capture_model
    from autoshard.models import load_model

    return {m: capture_model(load_model(m)) for m in (GPT, LLAMA, MOE)}


@functools.cache
def _local_graph(model: str, cp: int):
    """The rank-local graph a context-parallel plan of `model` is priced on (seq / cp tokens)."""
    from autoshard.capture import capture_model
    from autoshard.models import load_model

    return capture_model(load_model(model, seq=_graphs()[model].seq_len // cp))


def _hand_made(graph, family: str):
    from dist_plans import make_plan

    from autoshard.plans.layouts import MeshSpec

    if family == "2d":
        return make_plan(graph, MeshSpec.of(tp_r=2, tp_c=2), "2d", global_batch=BATCH)
    # OSDP's per-operator choice: the blocks' Linears sharded (ZeRO-3), everything else replicated (ZeRO-0)
    zero = {op.name: 3 for op in graph.ops if op.layer is not None and op.kind.value == "linear"}
    return make_plan(graph, MeshSpec.of(dp=4), "replicate", global_batch=BATCH, zero_per_op=zero)


def build_plans(only: set[str] | None) -> list[dict]:
    """Every configuration priced on the profile of its world size, plus the planner's choice per (model,
    world); returns [{name, model, world, path, predicted_s, planner}] with the plans written to temp files."""
    from autoshard.cost_models.reprice import price_plan
    from autoshard.hardware_profiles import ClusterSpec
    from autoshard.planner.estimate import HandConfig, estimate
    from autoshard.planner.planning import make_plan
    from autoshard.planner.search import parse_space

    graphs, tmp, out = _graphs(), Path(tempfile.mkdtemp(prefix="autoshard-measured-")), []
    for name, model, world, cfg in CONFIGS:
        if only and name not in only:
            continue
        cluster = ClusterSpec.parse(str(profile_file(world)))
        if isinstance(cfg, dict) and cfg.get("cp", 1) > 1:  # as `estimate --cp` prices and names it
            plan, _ = estimate(_local_graph(model, cfg["cp"]), cluster, HandConfig(global_batch=BATCH, **cfg))
            plan = replace(plan, model=graphs[model].model_name, fingerprint=graphs[model].fingerprint())
        elif isinstance(cfg, dict):
            plan, _ = estimate(graphs[model], cluster, HandConfig(global_batch=BATCH, **cfg))
        else:
            plan, _ = price_plan(_hand_made(graphs[model], cfg), graphs[model], cluster)
        out.append(_save(plan, name, model, world, tmp, planner=False))
    for model, world in sorted({(m, w) for n, m, w, _ in CONFIGS if not only or n in only}):
        cluster = ClusterSpec.parse(str(profile_file(world)))
        plan, _ = make_plan(graphs[model], cluster, global_batch=BATCH, space=parse_space(None))
        label = f"{LABELS[model]}-planner-{world}"
        out.append(_save(plan, label, model, world, tmp, planner=True))
    return out


def _save(plan, name: str, model: str, world: int, tmp: Path, *, planner: bool) -> dict:
    path = tmp / f"{name}.json"
    plan.save(path)
    pipe = plan.pipeline
    return {"name": name, "model": model, "world": world, "path": str(path), "planner": planner,
            "predicted_s": plan.prediction.iteration_time_s, "breakdown_s": plan.prediction.time.seconds(),
            "config": f"{plan.mesh}" + (f" (ep={plan.ep})" if plan.ep > 1 else "") + f", micro-batch {plan.micro_batch} x "
                      f"{plan.num_microbatches}, recompute {plan.recompute}"
                      + (f", {pipe.schedule} x{pipe.virtual_stages}" if pipe.degree > 1 else "")}


# -- worker (on every rank, under torchrun) ----------------------------------------------------------------
def worker(plans_path: str, out_path: str, repeats: int, steps: int, warmup: int, first_pass: int) -> None:
    import torch
    import torch.distributed as dist

    from autoshard.hardware_profiles import ClusterSpec
    from autoshard.measure.step import measure_plan
    from autoshard.plans.plan import Plan
    from autoshard.runtime.mesh import init_distributed

    torch.set_num_threads(1)
    init_distributed(device_type="cpu", timeout_s=900)
    world = dist.get_world_size()
    entries = [e for e in json.loads(Path(plans_path).read_text()) if e["world"] == world]
    cluster = ClusterSpec.parse(str(profile_file(world)))
    results = {e["name"]: [] for e in entries}
    for r in range(first_pass, first_pass + repeats):
        for e in (entries if r % 2 == 0 else entries[::-1]):  # alternate the order: slow drifts fall on all
            m = measure_plan(Plan.load(e["path"]), cluster=cluster, steps=steps, warmup=warmup)
            results[e["name"]].append(m.step.median_s)
            if dist.get_rank() == 0:
                print(f"pass {r + 1} {e['name']}: {m.step.median_s * 1e3:.0f} ms", flush=True)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.destroy_process_group()


# -- statistics and report ------------------------------------------------------------------------------------
def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-b of two orderings (ties count for neither side)."""
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    n0 = concordant + discordant
    denom = ((n0 + ties_x) * (n0 + ties_y)) ** 0.5
    return (concordant - discordant) / denom if denom else 0.0


def summarize(entries: list[dict], measured: dict[str, list[float]]) -> dict:
    rows = []
    for e in entries:
        reps = measured.get(e["name"])
        if not reps:
            continue
        m = statistics.median(reps)
        rows.append({**{k: e[k] for k in ("name", "model", "world", "config", "planner", "predicted_s",
                                          "breakdown_s")},
                     "measured_s": m, "repeats_s": reps, "spread_pct": (max(reps) - min(reps)) / m * 100,
                     "error_pct": (e["predicted_s"] - m) / m * 100})
    choice = {}
    for r in rows:
        if r["planner"]:
            pool = sorted((x for x in rows if x["model"] == r["model"] and x["world"] == r["world"]),
                          key=lambda x: x["measured_s"])
            best = pool[0]
            choice[r["name"]] = {"rank": pool.index(r) + 1, "of": len(pool), "fastest": best["name"],
                                 "behind_fastest_pct": (r["measured_s"] / best["measured_s"] - 1) * 100}
    return {"rows": rows, "mape_pct": statistics.mean(abs(r["error_pct"]) for r in rows),
            "signed_pct": statistics.mean(r["error_pct"] for r in rows),
            "kendall_tau": kendall_tau([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
            "median_spread_pct": statistics.median(r["spread_pct"] for r in rows), "planner": choice}


def write_report(summary: dict, args, elapsed_s: float) -> None:
    OUT.mkdir(exist_ok=True)
    meta = {"machine": f"{platform.node()}, {os.cpu_count()} cores", "python": platform.python_version(),
            "repeats": args.repeats, "steps": args.steps, "warmup": args.warmup, "global_batch": BATCH,
            "elapsed_s": round(elapsed_s), "command": "python scripts/validate_measured.py " +
            " ".join(sys.argv[1:])}
    (OUT / "measured_validation.json").write_text(json.dumps({**meta, **summary}, indent=1) + "\n")
    lines = ["# Predictions against runs of the plans on this machine's gloo ranks",
             "", f"Written by `{meta['command']}` ({meta['machine']}, {elapsed_s / 60:.0f} min). "
             "Each plan is priced on the profile `autoshard profile --quick` measured on the same number of "
             f"ranks (benchmarks/measured/cpu2.yaml, cpu4.yaml; "
             + (f"each number the median of {args.profile_rounds} rounds, one before the first measured pass "
                "and the others between the passes; the planner chose its plans on the first round"
                if summary.get("profile_spread") else "reused") +
             f") and run in {args.repeats} passes of "
             f"{args.steps} timed steps (after {args.warmup}); measured = median over passes of the median step. "
             f"Global batch {BATCH}; models `{GPT}`, `{LLAMA}` and `{MOE}`; fp32 on CPU.",
             "", f"**MAPE {summary['mape_pct']:.1f}%** (mean signed error {summary['signed_pct']:+.1f}%), "
             f"**Kendall's tau {summary['kendall_tau']:.2f}** over {len(summary['rows'])} plans; median spread "
             f"of the passes (max - min over the median) {summary['median_spread_pct']:.0f}%.", ""]
    for name, c in summary["planner"].items():
        lines.append(f"- planner's choice `{name}`: measured rank {c['rank']} of {c['of']} plans of its model "
                     f"and ranks, {c['behind_fastest_pct']:+.1f}% behind the fastest (`{c['fastest']}`)")
    if summary.get("profile_spread"):
        lines += ["", "How much the profile moved between its rounds (min / median / max, and (max - min) / median):",
                  "", "| figure | ranks | min | median | max | spread |", "|---|---:|---:|---:|---:|---:|"]
        for w, fields in summary["profile_spread"].items():
            for label, v in fields.items():
                lines.append(f"| {label} | {w} | {v['min']:.4g} | {v['median']:.4g} | {v['max']:.4g} | "
                             f"{v['spread_pct']:.0f}% |")
    lines += ["", "| plan | ranks | configuration | predicted ms | measured ms | error | spread |",
              "|---|---:|---|---:|---:|---:|---:|"]
    for r in sorted(summary["rows"], key=lambda r: (r["world"], r["model"], r["measured_s"])):
        tag = " (planner)" if r["planner"] else ""
        lines.append(f"| {r['name']}{tag} | {r['world']} | {r['config']} | {r['predicted_s'] * 1e3:.0f} | "
                     f"{r['measured_s'] * 1e3:.0f} | {r['error_pct']:+.1f}% | {r['spread_pct']:.0f}% |")
    (OUT / "measured_validation.md").write_text("\n".join(lines) + "\n")


def reprice(entries: list[dict]) -> None:
    """Every entry's prediction (the planner's choices too) on the profile files as they are now."""
    from autoshard.cost_models.reprice import price_plan
    from autoshard.hardware_profiles import ClusterSpec
    from autoshard.plans.plan import Plan

    graphs = _graphs()
    for e in entries:
        cluster = ClusterSpec.parse(str(profile_file(e["world"])))
        plan = Plan.load(e["path"])
        cp = plan.mesh.degree("cp")
        plan, _ = price_plan(plan, _local_graph(e["model"], cp) if cp > 1 else graphs[e["model"]], cluster)
        e["predicted_s"], e["breakdown_s"] = plan.prediction.iteration_time_s, plan.prediction.time.seconds()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="measured passes over all plans")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile-rounds", type=int, default=3,
                    help="quick profiles per world size, one before the first pass and one after each pass but "
                         "the last; the profile is their median")
    ap.add_argument("--skip-profile", action="store_true", help="reuse benchmarks/measured/cpu*.yaml")
    ap.add_argument("--only", default="", help="comma-separated plan names (the planner's choices are added)")
    ap.add_argument("--worker", nargs=2, metavar=("PLANS", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--first-pass", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker, args.repeats, args.steps, args.warmup, args.first_pass)
    t0 = time.perf_counter()
    PROFILES.mkdir(parents=True, exist_ok=True)
    worlds = sorted({w for _, _, w, _ in CONFIGS})
    rounds = 0 if args.skip_profile else max(1, args.profile_rounds)
    got: dict[int, list[dict]] = {}
    headers: dict[int, str] = {}

    def taken() -> int:
        return len(got.get(worlds[0], []))

    def next_round() -> None:
        profile_round(worlds, got, headers, f"round {taken() + 1} of {rounds}")

    if rounds:
        next_round()
    entries = build_plans(set(filter(None, args.only.split(","))) or None)  # the planner chooses on round 1
    measured: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        plans = Path(tmp, "plans.json")
        plans.write_text(json.dumps(entries))
        for i in range(args.repeats):
            for w in worlds:
                if any(e["world"] == w for e in entries):
                    print(f"pass {i + 1} of {args.repeats}: measuring {sum(e['world'] == w for e in entries)} plans "
                          f"on {w} ranks ...", flush=True)
                    out = Path(tmp, f"out{w}.json")
                    torchrun(w, __file__, "--worker", str(plans), str(out), "--repeats", "1", "--first-pass", str(i),
                             "--steps", str(args.steps), "--warmup", str(args.warmup))
                    for name, times in json.loads(out.read_text()).items():
                        measured.setdefault(name, []).extend(times)
            if taken() < rounds:  # P1 M1 P2 M2 P3 M3: the rounds between the passes
                next_round()
    while taken() < rounds:  # more rounds than passes
        next_round()
    if rounds > 1:
        reprice(entries)  # every prediction on the median of all rounds, which span the measured passes
    summary = summarize(entries, measured)
    summary["profile_spread"] = {str(w): profile_spread(got[w]) for w in worlds} if rounds else {}
    write_report(summary, args, time.perf_counter() - t0)
    print(f"MAPE {summary['mape_pct']:.1f}%, Kendall tau {summary['kendall_tau']:.2f}, "
          f"{len(summary['rows'])} plans; report in benchmarks/measured_validation.md")


if __name__ == "__main__":
    main()
