"""Train a small GPT on synthetic data with the plan autoshard picks, on CPU ranks or GPUs.

    torchrun --nproc-per-node 4 scripts/train_gpt.py --cluster 1x4xcpu
    torchrun --nproc-per-node 4 scripts/train_gpt.py --cluster 1x4xcpu --space dp,zero,tp1d,pp   # may pipeline
    torchrun --nproc-per-node 4 scripts/train_gpt.py --cluster 1x4xcpu --plan plan.json           # a saved plan

`autoparallel` plans on rank 0 (capture + cost model + ILP) and broadcasts the plan; rank 0 prints it, then a
progress line per step. The data is learnable on purpose: every sequence counts up from a random start token
(t, t+1, t+2, ... mod vocab), so the loss falls fast from log(vocab).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoshard import autoparallel
from autoshard.errors import AutoshardError
from autoshard.models import load_model
from autoshard.planner.for_runtime import plan_summary


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", default="1x4xcpu", help="cluster spec, e.g. 1x4xcpu or 1x8xA100-80GB")
    p.add_argument("--model", default="gpt:layers=2,hidden=256,heads=4,seq=64,vocab=512", help="model spec")
    p.add_argument("--space", default=None, help="families to plan over (default: all but pp), e.g. dp,zero,tp1d")
    p.add_argument("--plan", default=None, help="apply this plan file instead of planning")
    p.add_argument("--memory-cap", type=float, default=None, help="GiB per device the plan must fit")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args()


def synthetic_batch(step: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """(batch, seq + 1) token ids counting up from a random start: inputs are [:, :-1], targets [:, 1:]."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    return (start + torch.arange(seq + 1)) % vocab


def lm_loss(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output  # (local batch, seq, vocab)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def progress(step: int, steps: int, loss: float, rate: float) -> str:
    done = int(30 * step / steps)
    return f"[{'#' * done}{'.' * (30 - done)}] step {step:3d}/{steps}  loss {loss:.4f}  {rate:.2f} steps/s"


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    loaded = load_model(args.model, device=None)
    model, spec = loaded.module, loaded.spec
    for module in model.modules():  # dropout off: CPU ranks cannot run attention dropout on DTensors
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    example = (torch.randint(0, spec.vocab, (2, spec.seq)),)  # random tokens: the runtime checks outputs on them
    pmodel = autoparallel(model, args.cluster, example_inputs=example, global_batch=args.global_batch,
                          plan=args.plan, space=args.space, memory_cap=args.memory_cap, loss_fn=lm_loss,
                          timeout_s=300)
    rank0 = dist.get_rank() == 0
    if rank0:
        print(plan_summary(pmodel.plan), flush=True)
        print(f"model code runs on {pmodel.execution}", flush=True)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=args.lr)
    first = last = None
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens = synthetic_batch(step, args.global_batch, spec.seq, spec.vocab)
        ids, targets = pmodel.shard_inputs((tokens[:, :-1], tokens[:, 1:]))
        loss = pmodel.train_step((ids,), targets).item()  # the global batch's mean loss, on every rank
        optimizer.step()
        optimizer.zero_grad()
        first = loss if first is None else first
        last = loss
        if rank0:
            print(progress(step, args.steps, loss, step / (time.perf_counter() - t0)), flush=True)
    if rank0:
        print(f"loss {first:.4f} -> {last:.4f} in {args.steps} steps")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        main()
    except AutoshardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
