"""The training step written by hand as torchtitan writes it: what autoshard's runtime is checked against.

FSDP2 `fully_shard` on every transformer block and then on the root, `MixedPrecisionPolicy(bf16 parameters,
fp32 reductions)` on GPUs (fp32 on CPU ranks), optionally each block `torch.compile`d before it is sharded
(torchtitan `apply_compile`, then `apply_fsdp`), AdamW, gradient accumulation over the micro-batches, the
cross-entropy on fp32 logits as `autoshard measure` computes it (`training_loss`), synthetic token batches.
Timed as `measure` times a plan: a barrier, the step with CUDA synchronized around it, the median of the timed
steps, and on GPUs the allocator's peak allocated and reserved bytes.

    torchrun --nproc-per-node 1 -m autoshard.measure.reference_loop MODEL --global-batch 8 --micro-batch 1 \
        [--compile] [--steps 10] [--warmup 3] [--json]

It runs data parallel over the job's ranks (one rank: FSDP2 only casts the parameters, as in a one-GPU plan).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

__all__ = ["run_reference", "main"]


def _blocks(model):
    """The repeated transformer blocks (a Hugging Face decoder's `model.layers` / GPT-2's `transformer.h`)."""
    from torch import nn

    for path in ("model.layers", "transformer.h", "model.decoder.layers"):
        try:
            blocks = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(blocks, nn.ModuleList):
            return path, blocks
    raise ValueError(f"{type(model).__name__}: no block list at model.layers or transformer.h")


def _shard(model, *, compile_blocks: bool, mp) -> None:
    """torchtitan's order: compile each block, then fully_shard each block, then the root."""
    import torch
    from torch.distributed.fsdp import fully_shard

    path, blocks = _blocks(model)
    for i, block in enumerate(blocks):
        if compile_blocks:
            block = torch.compile(block)
            blocks.register_module(str(i), block)
        fully_shard(block, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mp_policy=mp, reshard_after_forward=False)


def run_reference(model_ref: str, *, global_batch: int, micro_batch: int, compile_blocks: bool = False,
                  steps: int = 10, warmup: int = 3) -> dict:
    """Time the hand-written step on this job's ranks (call on every rank); every rank returns the same dict."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from autoshard.measure.step import synthetic_batch, training_loss
    from autoshard.models import load_model

    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    if global_batch % (world * micro_batch):
        raise ValueError(f"global batch {global_batch} does not split into micro-batches of {micro_batch} on "
                         f"{world} ranks")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    loaded = load_model(model_ref, device=str(device))
    model = loaded.module
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else \
        MixedPrecisionPolicy()
    _shard(model, compile_blocks=compile_blocks, mp=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    per_rank = global_batch // world
    n = per_rank // micro_batch
    times = []
    for i in range(warmup + steps):
        x, y = synthetic_batch(loaded, global_batch, i, device)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        dist.barrier()
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for xs, ys in zip(x.chunk(n), y.chunk(n), strict=True):
            (training_loss(model(xs), ys) / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    out = {"model": model_ref, "compile": compile_blocks, "world_size": world, "global_batch": global_batch,
           "micro_batch": micro_batch, "steps_s": slowest.cpu().tolist(), "peak_allocated_bytes": None,
           "peak_reserved_bytes": None}
    out["median_s"] = statistics.median(out["steps_s"])
    if cuda:
        peaks = torch.tensor([torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)],
                             dtype=torch.float64, device=device)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        out["peak_allocated_bytes"], out["peak_reserved_bytes"] = (int(v) for v in peaks.tolist())
    return out


def main(argv: list[str] | None = None) -> int:
    import os

    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="autoshard.measure.reference_loop", description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="torch.compile each block before FSDP2")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        print("run it under torchrun: torchrun --nproc-per-node N -m autoshard.measure.reference_loop ...",
              file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")  # as torchtitan's launcher
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        out = run_reference(args.model, global_batch=args.global_batch, micro_batch=args.micro_batch,
                            compile_blocks=args.compile, steps=args.steps, warmup=args.warmup)
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        print(json.dumps(out) if args.json else
              f"{out['model']}{' compiled' if out['compile'] else ''}: step {out['median_s'] * 1e3:.1f} ms median "
              f"of {len(out['steps_s'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
