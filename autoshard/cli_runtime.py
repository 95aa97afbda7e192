"""The CLI commands that run on ranks under torchrun (`measure`, `profile`): rank 0 prints, the rest stay quiet.

Kept apart from cli.py so that `autoshard --help` and the planning commands never import torch.distributed.
"""

from __future__ import annotations

import os
from pathlib import Path

from autoshard.errors import ConfigurationError, RuntimeSetupError, require_positive

__all__ = ["measure_command", "profile_command", "require_torchrun"]


def require_torchrun(command: str) -> None:
    """One clear error when a rank command is started without torchrun's environment."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        ranks = "the plan's ranks: its mesh size" if command == "measure" else "the GPUs (or CPU ranks) to profile"
        raise RuntimeSetupError(f"`autoshard {command}` runs on the ranks of a job: launch it as "
                                f"`torchrun --nproc-per-node N -m autoshard {command} ...` (N = {ranks})")


def measure_command(args, emit) -> int:
    require_torchrun("measure")
    from autoshard.measure.step import measure_plan
    from autoshard.plans.plan import Plan
    from autoshard.runtime.mesh import shutdown_distributed

    plan = Plan.load(args.plan)
    rank0 = os.environ.get("RANK") == "0"
    result = measure_plan(plan, cluster=args.cluster, steps=args.steps, warmup=args.warmup,
                          progress=args.progress.steps("measuring steps") if rank0 else None,
                          trace=getattr(args, "trace", None))
    args.progress.close()
    if rank0:
        emit(args, result.to_json(), "\n".join(measure_text(result)))
    shutdown_distributed()
    return 0


def measure_text(result) -> list[str]:
    step = result.step
    lines = [f"{result.model} on {result.cluster}, mesh {result.mesh}, {result.world_size} ranks",
             f"measured step     {step.median_s * 1e3:.1f} ms median of {len(step.steps_s)} "
             f"(min {min(step.steps_s) * 1e3:.1f}, max {max(step.steps_s) * 1e3:.1f}, IQR {step.iqr_s * 1e3:.1f})",
             f"  train_step      {result.train_step.median_s * 1e3:.1f} ms (forward, loss, backward)",
             f"  optimizer       {result.optimizer.median_s * 1e3:.1f} ms (AdamW step, zero_grad)"]
    if result.routing_imbalance is not None:
        lines.append(f"  routing         the busiest expert-parallel rank received {result.routing_imbalance:.2f}x "
                     "the mean rows (MoE layers' mean; `estimate --ep-imbalance` takes it)")
    if result.peak_reserved_bytes is not None:
        gib = 2**30
        lines.append(f"memory           peak reserved {result.peak_reserved_bytes / gib:.2f} GiB, peak allocated "
                     f"{result.peak_allocated_bytes / gib:.2f} GiB (the largest rank)"
                     + (f"; predicted {result.predicted_memory_bytes / gib:.2f} GiB"
                        if result.predicted_memory_bytes else ""))
    if result.predicted_s is not None:
        lines.append(f"predicted step   {result.predicted_s * 1e3:.1f} ms ({result.error_pct:+.1f}%: "
                     f"{'too fast' if result.error_pct < 0 else 'too slow'})")
        lines.append("  breakdown       " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in
                                                      (result.predicted_breakdown_s or {}).items() if v > 0))
    return lines


def _writable_target(path: str) -> Path:
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigurationError(f"-o {path}: directory {parent} does not exist; create it or pick another path")
    if not os.access(parent, os.W_OK):
        raise ConfigurationError(f"-o {path}: directory {parent} is not writable")
    return target


def profile_command(args, emit) -> int:
    target = _writable_target(args.output)  # before any measurement
    require_positive("rounds", args.rounds)
    require_torchrun("profile")
    import torch
    import yaml

    from autoshard.measure.profile import merge_rounds, profile_cluster
    from autoshard.runtime.mesh import global_rank, init_distributed, shutdown_distributed

    init_distributed(device_type="cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    rank0 = global_rank() == 0
    progress = args.progress if rank0 and args.progress.enabled else None
    rounds = []
    for i in range(args.rounds):
        if progress is not None and args.rounds > 1:
            progress(f"round {i + 1} of {args.rounds}")
        rounds.append(profile_cluster(quick=args.quick, progress=progress))
    args.progress.close()
    data = merge_rounds(rounds) if rank0 else None
    if rank0:
        header = ("# Measured by `autoshard profile`: a cluster file for --cluster (this cluster) or\n"
                  "# --cluster NODESxGPUS@<this file> (the same GPUs and links, another size). Re-run it after\n"
                  "# hardware, driver or library changes; every number's source is in its sources section.\n")
        _atomic_write(target, header + yaml.safe_dump(data, sort_keys=False, width=200, default_flow_style=None))
        g = data["gpu"]
        emit(args, {"profile_file": str(target), "gpu": {k: g[k] for k in ("name", "peak_tflops", "hbm_gbps",
                                                                               "kernel_launch_us", "overlap_slowdown",
                                                                               "dtensor_us_per_op")},
                    "intra_busbw_gbps": data["intra"]["busbw_gbps"]},
             f"profile written to {target}: {g['name']}, best GEMM {max(r[3] for r in g['gemm_tflops']):.3g} "
             f"TFLOP/s, {g['hbm_gbps']:.3g} GB/s, {g['kernel_launch_us']:.3g} us per kernel, all-reduce "
             f"{data['intra']['busbw_gbps']['all_reduce']:.3g} GB/s busbw; use --cluster {target}")
    shutdown_distributed()
    return 0


def _atomic_write(path: Path, text: str) -> None:
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
