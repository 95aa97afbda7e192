"""Where a measured step's time goes across ranks: a per-rank timeline of one plan's steps (under torchrun).

    torchrun --nproc-per-node 4 scripts/trace_step.py PLAN.json [--steps 3] [--warmup 2]

A diagnostic beside `autoshard measure`: that prints one step time; this prints, for each timed step and rank,
when the step started on that rank's clock (all ranks leave a barrier together first), how long it took, and
the time spent inside FSDP2's data-parallel gradient reductions (`FSDP::post_backward_reduce`, from the torch
profiler), which is mostly waiting for the last rank of the dp group to arrive. Then, per step and dp group,
the skew: how much later the group's last rank entered its first reduction than its first rank did.

What it showed on this machine (2026-11-26, the `pp=2 x dp=2` Llama plan of scripts/validate_measured.py, 4
ranks on 2 cores, a noisy day): `autoshard measure` put that plan 16-29% above its prediction over five runs,
its fastest steps 540-612 ms against 541 predicted and its medians 643-766 ms; the single pipeline (pp=4)
came out 0% to 20% slow. The two pipeline replicas ({0, 2} and {1, 3}) drift apart within a step: in one traced
run the replica ahead waited 35-175 ms per step in its first gradient reduction for the other (rank clocks of
a hand-instrumented run), in another this script saw skews of 3-35 ms. The cost model assumes the cores stay
busy through a pipeline's fill and drain (cost_models/evaluate.py `_iteration`), which holds for one pipeline and
not while replicas drift: a lead, not a fix, as the drift varies from run to run.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

REDUCE = "FSDP::post_backward_reduce"


def main() -> None:
    from autoshard import autoparallel
    from autoshard.measure.step import _build, _cluster_of, synthetic_batch, training_loss
    from autoshard.plans.plan import Plan

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = Plan.load(a.plan)
    spec = _cluster_of(plan, None)
    device = torch.device("cpu")
    loaded = _build(plan, device, 0)
    pm = autoparallel(loaded.module, spec, example_inputs=tuple(loaded.example_inputs(2, device="cpu")),
                      global_batch=plan.global_batch, plan=plan, loss_fn=training_loss)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

    def step(i: int) -> None:
        inputs, target = pm.shard_inputs(synthetic_batch(loaded, plan.global_batch, i, device))
        with record_function("trace::step"):
            pm.train_step((inputs,), target)
            opt.step()
            opt.zero_grad(set_to_none=True)

    for i in range(a.warmup):
        step(i)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(a.steps):
            step(a.warmup + i)
    steps = sorted((e for e in prof.events() if e.name == "trace::step"), key=lambda e: e.time_range.start)
    reduces = [e for e in prof.events() if e.name.startswith(REDUCE)]
    rows = []
    for s in steps:
        mine = [r for r in reduces if s.time_range.start <= r.time_range.start <= s.time_range.end]
        first = min((r.time_range.start for r in mine), default=None)
        rows.append((s.time_range.start / 1e3, s.time_range.elapsed_us() / 1e3,
                     sum(r.time_range.elapsed_us() for r in mine) / 1e3, None if first is None else first / 1e3))
    out = [None] * world
    dist.all_gather_object(out, {"rows": rows})
    if rank == 0:
        report(out, plan)
    dist.destroy_process_group()


def report(out: list[dict], plan) -> None:
    print(f"plan {plan.mesh}, {len(out)} ranks; times in ms on each rank's profiler clock (started together)")
    print(f"{'step':>4s} {'rank':>4s} {'start':>8s} {'step':>8s} {'in dp reductions':>17s}")
    for i in range(len(out[0]["rows"])):
        for r, o in enumerate(out):
            start, dur, red, _ = o["rows"][i]
            print(f"{i:4d} {r:4d} {start:8.1f} {dur:8.1f} {red:17.1f}")
    groups = dp_groups(plan, len(out))
    if not groups:
        return
    print("skew at the first gradient reduction (last rank of the dp group in, minus the first), ms:")
    for i in range(len(out[0]["rows"])):
        skews = {}  # dp group -> skew, for the groups whose every rank reduced in this step
        for g in groups:
            firsts = [out[r]["rows"][i][3] for r in g if out[r]["rows"][i][3] is not None]
            if len(firsts) == len(g):
                skews[str(g)] = max(firsts) - min(firsts)
        if skews:
            print(f"  step {i}: " + ", ".join(f"{g}: {s:.1f}" for g, s in skews.items())
                  + f" (median {statistics.median(skews.values()):.1f})")


def dp_groups(plan, world: int) -> list[list[int]]:
    """The ranks of each dp group of the plan's mesh (row-major, as the runtime lays it out)."""
    names = list(plan.mesh.names)
    if "dp" not in names or plan.mesh.degree("dp") < 2:
        return []
    mesh = torch.arange(world).reshape([plan.mesh.degree(n) for n in names])
    d = names.index("dp")
    return mesh.movedim(d, -1).reshape(-1, plan.mesh.degree("dp")).tolist()


if __name__ == "__main__":
    main()
