"""Train a small GPT on synthetic data with an autoshard plan, on CPU ranks or GPUs.

    torchrun --nproc-per-node 4 scripts/train_gpt.py --cluster 1x4xcpu

The data is learnable on purpose: every sequence counts up from a random start token (t, t+1, t+2, ... mod
vocab), so the loss falls fast from log(vocab). Until the planner is hooked into `autoparallel`, the plan is
made by hand here: Megatron 1D tensor parallelism over 2 ranks, data parallel over the rest (DP x 1D), or pure
data parallelism with --strategy dp. Rank 0 prints the plan and one line per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))  # hand-made plans

from dist_plans import make_plan  # noqa: E402

from autoshard.capture import capture  # noqa: E402
from autoshard.models import load_model  # noqa: E402
from autoshard.planner.layouts import MeshSpec  # noqa: E402
from autoshard.planner.plan import Plan  # noqa: E402
from autoshard.runtime import autoparallel  # noqa: E402
from autoshard.runtime.entry import resolve_cluster  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", default="1x4xcpu", help="cluster spec, e.g. 1x4xcpu or 1x8xA100-80GB")
    p.add_argument("--model", default="gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128", help="model spec")
    p.add_argument("--strategy", choices=("dp-1d", "dp"), default="dp-1d", help="hand-made plan to apply")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args()


def hand_plan(graph, num_ranks: int, strategy: str, global_batch: int) -> Plan:
    if strategy == "dp" or num_ranks == 1:
        return make_plan(graph, MeshSpec.of(dp=num_ranks), "replicate", global_batch=global_batch)
    tp = 2 if num_ranks % 2 == 0 else 1
    return make_plan(graph, MeshSpec.of(dp=num_ranks // tp, tp=tp), "megatron", global_batch=global_batch)


def print_plan(plan: Plan) -> None:
    print(f"plan for {plan.model} on mesh {plan.mesh}, global batch {plan.global_batch}")
    print(f"{'op':44s} {'kind':11s} {'strategy':9s} {'inputs -> output':40s} params (storage)")
    for op in plan.ops:
        st = op.strategy
        flow = f"{' | '.join(sorted(set(map(str, st.inputs)))) or '-'} -> {st.output}"
        params = " ".join(f"{p.name.rsplit('.', 1)[-1]}:{p.storage}" for p in st.params)
        zero = f" zero={st.zero}" if st.params else ""
        print(f"{op.op[-44:]:44s} {op.kind:11s} {st.name:9s} {flow:40s} {params}{zero}")


def synthetic_batch(step: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """(batch, seq + 1) token ids counting up from a random start: inputs are [:, :-1], targets [:, 1:]."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    return (start + torch.arange(seq + 1)) % vocab


def main() -> None:
    args = parse_args()
    num_ranks, _ = resolve_cluster(args.cluster)
    torch.manual_seed(0)
    loaded = load_model(args.model, device=None)
    model, spec = loaded.module, loaded.spec
    for module in model.modules():  # dropout off: CPU ranks cannot run attention dropout on DTensors
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    example = (torch.zeros(1, spec.seq, dtype=torch.long),)
    graph = capture(model, example, name=loaded.name)
    plan = hand_plan(graph, num_ranks, args.strategy, args.global_batch)
    pmodel = autoparallel(model, args.cluster, example_inputs=example, global_batch=args.global_batch, plan=plan,
                          graph=graph, timeout_s=120)
    rank0 = dist.get_rank() == 0
    if rank0:
        print_plan(plan)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=args.lr)
    first = last = None
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens = synthetic_batch(step, args.global_batch, spec.seq, spec.vocab)
        ids, targets = pmodel.shard_inputs((tokens[:, :-1], tokens[:, 1:]))
        logits = pmodel(ids).logits  # (local batch, seq, vocab): this rank's slice, full vocabulary
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)  # the mean over ranks is the global batch's loss (tp ranks hold equal copies)
        value = value.item() / dist.get_world_size()
        first = value if first is None else first
        last = value
        if rank0:
            rate = step / (time.perf_counter() - t0)
            print(f"step {step:3d}/{args.steps}  loss {value:.4f}  {rate:.2f} steps/s", flush=True)
    if rank0:
        print(f"loss {first:.4f} -> {last:.4f} in {args.steps} steps")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
