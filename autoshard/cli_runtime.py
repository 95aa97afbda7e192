"""The CLI commands that run on ranks under torchrun (`measure`, `profile`): rank 0 prints, the rest stay quiet.

Kept apart from cli.py so that `autoshard --help` and the planning commands never import torch.distributed.
"""

from __future__ import annotations

import os
import sys

from autoshard.errors import RuntimeSetupError

__all__ = ["measure_command", "require_torchrun"]


def require_torchrun(command: str) -> None:
    """One clear error when a rank command is started without torchrun's environment."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeSetupError(f"`autoshard {command}` runs on the ranks of a job: launch it as "
                                f"`torchrun --nproc-per-node N -m autoshard {command} ...` (N = ranks of "
                                "the plan's mesh)")


def _progress_printer(rank0: bool, enabled: bool, label: str):
    if not (rank0 and enabled and sys.stderr.isatty()):
        return None

    def show(done: int, total: int) -> None:
        bar = "#" * int(30 * done / total)
        end = "\n" if done == total else ""
        print(f"\r{label} [{bar:30s}] {done}/{total}", end=end, file=sys.stderr, flush=True)

    return show


def measure_command(args, emit) -> int:
    require_torchrun("measure")
    import torch.distributed as dist

    from autoshard.planner.plan import Plan
    from autoshard.runtime.measure import measure_plan

    plan = Plan.load(args.plan)
    rank0 = os.environ.get("RANK") == "0"
    result = measure_plan(plan, cluster=args.cluster, steps=args.steps, warmup=args.warmup,
                          progress=_progress_printer(rank0, not args.json, "measuring"))
    if rank0:
        emit(args, result.to_json(), "\n".join(measure_text(result)))
    dist.destroy_process_group()
    return 0


def measure_text(result) -> list[str]:
    step = result.step
    lines = [f"{result.model} on {result.cluster}, mesh {result.mesh}, {result.world_size} ranks",
             f"measured step     {step.median_s * 1e3:.1f} ms median of {len(step.steps_s)} "
             f"(min {min(step.steps_s) * 1e3:.1f}, max {max(step.steps_s) * 1e3:.1f}, IQR {step.iqr_s * 1e3:.1f})",
             f"  train_step      {result.train_step.median_s * 1e3:.1f} ms (forward, loss, backward)",
             f"  optimizer       {result.optimizer.median_s * 1e3:.1f} ms (AdamW step, zero_grad)"]
    if result.predicted_s is not None:
        lines.append(f"predicted step   {result.predicted_s * 1e3:.1f} ms ({result.error_pct:+.1f}%: "
                     f"{'too fast' if result.error_pct < 0 else 'too slow'})")
        lines.append("  breakdown       " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in
                                                      (result.predicted_breakdown_s or {}).items() if v > 0))
    return lines
