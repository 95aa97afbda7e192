"""`scripts/gpu_check.py`: the truth loop on one GPU, as one prepared command.

On a machine with one GPU (the project on PYTHONPATH, nothing installed: torch, transformers, numpy, networkx,
pyyaml and rich, no solver), in this order (what a short lease is for first) and each step in its own process:

1. `autoshard measure` of every plan in `benchmarks/gpu_plans/` (made beforehand on a CPU machine with
   `--make-plans`, and committed: the flow of a user who plans on a laptop and runs on a cluster), or of those
   `--only` names in its order: the measured step and the allocator's peaks beside the plan's predicted step and
   memory (priced on the datasheet profile);
2. the same Llama step written by hand as torchtitan writes it (`reference_loop.py`), eager and with each
   block compiled;
3. `autoshard profile --quick` on the GPU (one rank under torchrun): the cluster file of this machine, on which
   every plan's configuration is priced again (`estimate --cluster 1x1@FILE`);

and writes `gpu_validation.md` and `.json` (predicted against measured, per plan and as MAPE) into `--out` after
every step, so that a check cut short leaves what it measured.
`--cpu` runs the same steps on one CPU rank with tiny models (their plans made on the spot), which CI runs.
Measuring needs no solver: the plans are files, `estimate` prices without the ILP.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

__all__ = ["Run", "GPU_RUNS", "CPU_RUNS", "GPU_CLUSTER", "make_plans", "check", "reprice", "main"]

ROOT = Path(__file__).resolve().parents[2]
PLANS_DIR = ROOT / "benchmarks" / "gpu_plans"
GPU_CLUSTER = "1x1xH200-141GB"
CPU_CLUSTER = "1x1xcpu"


@dataclass(frozen=True, kw_only=True)
class Run:
    """One single-GPU configuration: a model, its micro-batching and recompute (what `estimate` takes)."""

    name: str
    model: str
    global_batch: int
    micro_batch: int
    recompute: str = "none"
    reference: bool = False  # the configuration the hand-written loop runs too
    compile: bool = False  # every block torch.compile'd (against the hand-written loop's compiled time)
    float8: str = ""  # the block Linears in float8 (needs torchao on the GPU machine)

    @property
    def plan_file(self) -> str:
        return f"{self.name}.json"


# Llama 3.2 1B / 3B dimensions (Meta's model cards) with an untied head: 1.50B / 3.61B parameters
LLAMA_1B = "llama:layers=16,hidden=2048,heads=32,kv_heads=8,ffn=8192,vocab=128256,seq=4096,rope_theta=500000"
LLAMA_3B = "llama:layers=28,hidden=3072,heads=24,kv_heads=8,ffn=8192,vocab=128256,seq=4096,rope_theta=500000"
MOE = "mixtral:layers=8,hidden=1024,heads=16,kv_heads=8,ffn=2816,vocab=32000,seq=2048,experts=8,top_k=2"
GPU_RUNS = (
    # the Llama of ../shared/references/gpu_h200.md's hand-written loop: 8 micro-batches of one 4,096-token row
    Run(name="llama1b-none-mb1x8", model=LLAMA_1B, global_batch=8, micro_batch=1, reference=True),
    Run(name="llama1b-selective-mb2x4", model=LLAMA_1B, global_batch=8, micro_batch=2, recompute="selective"),
    Run(name="llama1b-full-mb4x2", model=LLAMA_1B, global_batch=8, micro_batch=4, recompute="full"),
    # the hand loop's configuration compiled (to step at least as fast as its compiled blocks), and in float8
    Run(name="llama1b-none-mb1x8-compiled", model=LLAMA_1B, global_batch=8, micro_batch=1, compile=True),
    Run(name="llama1b-none-mb1x8-compiled-float8", model=LLAMA_1B, global_batch=8, micro_batch=1, compile=True,
        float8="tensorwise"),
    Run(name="llama3b-none-mb1x4", model=LLAMA_3B, global_batch=4, micro_batch=1),
    Run(name="llama3b-selective-mb2x2", model=LLAMA_3B, global_batch=4, micro_batch=2, recompute="selective"),
    Run(name="llama3b-full-mb4x1", model=LLAMA_3B, global_batch=4, micro_batch=4, recompute="full"),
    Run(name="gpt2-none-mb1x4", model="gpt2", global_batch=4, micro_batch=1),
    Run(name="gpt2-medium-none-mb4x2", model="gpt2-medium", global_batch=8, micro_batch=4),
    Run(name="moe-none-mb2x2", model=MOE, global_batch=4, micro_batch=2),
)
_TINY_LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32"
CPU_RUNS = (
    Run(name="tiny-llama-none-mb1x2", model=_TINY_LLAMA, global_batch=2, micro_batch=1, reference=True),
    Run(name="tiny-llama-selective-mb2x1", model=_TINY_LLAMA, global_batch=2, micro_batch=2, recompute="selective"),
    Run(name="tiny-llama-full-mb1x2", model=_TINY_LLAMA, global_batch=2, micro_batch=1, recompute="full"),
    Run(name="tiny-gpt-none-mb2x1", model="gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128", global_batch=2,
        micro_batch=2),
    Run(name="tiny-moe-none-mb1x2", model="mixtral:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,"
                                          "seq=32,experts=4,top_k=2", global_batch=2, micro_batch=1),
)


def make_plans(runs: tuple[Run, ...], cluster: str, out_dir: Path) -> list[Path]:
    """`autoshard estimate` of every run on `cluster` (one GPU), written as plan files into `out_dir`."""
    from autoshard.api import estimate_config

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for run in runs:
        plan, _ = estimate_config(run.model, cluster, dp=1, micro_batch=run.micro_batch,
                                  global_batch=run.global_batch, recompute=run.recompute, compile=run.compile,
                                  float8=run.float8)
        path = out_dir / run.plan_file
        plan.save(path)
        paths.append(path)
    return paths


def _torchrun(args: list[str], timeout_s: float) -> tuple[dict | None, str, float]:
    """(the JSON rank 0 printed, or None; the end of stderr; seconds) of `args` on one rank under torchrun."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *args]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_env())
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout_s:.0f} s", time.perf_counter() - t0
    wall = time.perf_counter() - t0
    start = proc.stdout.find("{")  # rank 0's JSON document: all of its stdout (measure --json, reference --json)
    if proc.returncode != 0 or start < 0:
        text = proc.stderr or proc.stdout  # the child's own message first, torchrun's traceback after it
        return None, text if len(text) <= 3000 else f"{text[:1500]}\n...\n{text[-1500:]}", wall
    return json.loads(proc.stdout[start:]), "", wall


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


def _profile(out: Path, timeout_s: float | None) -> dict:
    path = out / "profile.yaml"
    if timeout_s is None:
        return {"ok": False, "error": "not run: the check's budget was spent", "wall_s": 0.0}
    _, err, wall = _torchrun(["-m", "autoshard.cli", "profile", "--quick", "-o", str(path)], timeout_s)
    if not path.exists():
        return {"ok": False, "error": err, "wall_s": wall}
    import yaml

    gpu = yaml.safe_load(path.read_text())["gpu"]
    keys = ("name", "peak_tflops", "hbm_gbps", "kernel_launch_us", "host_us_per_op", "flash_attention_by_seq",
            "dtensor_us_per_op",
            "fsdp_us_per_module", "optimizer_us_per_tensor")
    best = max(row[3] for row in gpu["gemm_tflops"])
    return {"ok": True, "file": str(path), "wall_s": wall, "best_gemm_tflops": best,
            **{k: gpu.get(k) for k in keys}}


def _measure(run: Run, plan_path: Path, cluster: str | None, steps: int, warmup: int, timeout_s: float,
             trace: Path | None = None) -> dict:
    args = ["-m", "autoshard.cli", "measure", str(plan_path), "--steps", str(steps), "--warmup", str(warmup),
            "--json"] + (["--cluster", cluster] if cluster else []) + (["--trace", str(trace)] if trace else [])
    report, err, wall = _torchrun(args, timeout_s)
    row = {"run": run.name, "model": run.model, "global_batch": run.global_batch, "micro_batch": run.micro_batch,
           "recompute": run.recompute, "wall_s": round(wall, 1)}
    if report is None:
        return row | {"ok": False, "error": err}
    gib = 2**30
    measured, predicted = report["step"]["median_s"], report["predicted_s"]
    row |= {"ok": True, "measured_s": measured, "iqr_s": report["step"]["iqr_s"], "predicted_s": predicted,
            "time_error_pct": (predicted - measured) / measured * 100,
            "predicted_breakdown_s": report["predicted_breakdown_s"],
            "train_step_s": report["train_step"]["median_s"], "optimizer_s": report["optimizer"]["median_s"],
            "losses": report.get("losses", [])}
    if report.get("peak_reserved_bytes"):
        pred_mem, reserved = report["predicted_memory_bytes"], report["peak_reserved_bytes"]
        row |= {"predicted_memory_gib": pred_mem / gib, "peak_reserved_gib": reserved / gib,
                "peak_allocated_gib": report["peak_allocated_bytes"] / gib,
                "memory_error_pct": (pred_mem - reserved) / reserved * 100}
    return row


def _reference(run: Run, *, compile_blocks: bool, steps: int, warmup: int, timeout_s: float) -> dict:
    args = ["-m", "autoshard.measure.reference_loop", run.model, "--global-batch", str(run.global_batch),
            "--micro-batch", str(run.micro_batch), "--steps", str(steps), "--warmup", str(warmup), "--json"]
    report, err, wall = _torchrun(args + (["--compile"] if compile_blocks else []), timeout_s)
    row = {"run": run.name, "compile": compile_blocks, "wall_s": round(wall, 1)}
    if report is None:
        return row | {"ok": False, "error": err}
    gib = 2**30
    return row | {"ok": True, "measured_s": report["median_s"],
                  "peak_reserved_gib": (report["peak_reserved_bytes"] or 0) / gib or None,
                  "peak_allocated_gib": (report["peak_allocated_bytes"] or 0) / gib or None}


def _reprice(run: Run, profile: dict) -> dict:
    """The run priced on the profile this machine measured (`estimate --cluster 1x1@profile.yaml`)."""
    if not profile.get("ok"):
        return {}
    from autoshard.api import estimate_config

    try:
        plan, _ = estimate_config(run.model, f"1x1@{profile['file']}", dp=1, micro_batch=run.micro_batch,
                                  global_batch=run.global_batch, recompute=run.recompute, compile=run.compile,
                                  float8=run.float8, check_memory=False)
    except ValueError as exc:
        return {"profiled_error": str(exc)}
    return {"profiled_predicted_s": plan.prediction.iteration_time_s,
            "profiled_predicted_memory_gib": plan.prediction.memory.total_bytes / 2**30}


def _add_profiled(row: dict, run: Run, profile: dict) -> None:
    """The row's run priced on the profile the check measured, and that prediction's error, where both exist."""
    row |= _reprice(run, profile)
    if row.get("ok") and "profiled_predicted_s" in row:
        row["profiled_time_error_pct"] = (row["profiled_predicted_s"] - row["measured_s"]) / row["measured_s"] * 100


def _summarize(report: dict) -> None:
    """The report's MAPEs over its measured plans: step time as planned, on the measured profile, memory."""
    for key in ("time", "profiled_time", "memory"):
        report[f"{key}_mape_pct"] = _mape(report["plans"], f"{key}_error_pct")


def _not_run(name: str, budget_s: float | None) -> dict:
    return {"run": name, "ok": False, "error": f"not run: the check's budget of {budget_s:.0f} s was spent"}


def _mape(rows: list[dict], key: str) -> float | None:
    errors = [abs(r[key]) for r in rows if r.get("ok") and r.get(key) is not None]
    return sum(errors) / len(errors) if errors else None


def check(*, cpu: bool, out: Path, plans_dir: Path, steps: int, warmup: int, only: tuple[str, ...] = (),
          budget_s: float | None = None, profile: bool = True, trace: tuple[str, ...] = (),
          progress=print) -> dict:
    """Measure every plan, time the hand-written loop, profile; returns the report (also written to `out`).
    `trace`: the plans whose measurement also profiles one step (`measure --trace`, `trace-NAME.json` in `out`).
    `budget_s`: no step starts after that many seconds, and none runs past them (the rest are reported as not
    run), so a device lent for a fixed time is never held beyond it."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    every = {r.name: r for r in (CPU_RUNS if cpu else GPU_RUNS)}
    runs = tuple(every[name] for name in only) if only else tuple(every.values())  # in the order asked
    if cpu:
        plans_dir = out / "plans"
        make_plans(runs, CPU_CLUSTER, plans_dir)
    t_start = time.perf_counter()

    def within(step_s: float) -> float | None:
        """The timeout of a step that may take `step_s`: cut to what the budget has left; None: out of time."""
        if budget_s is None:
            return step_s
        left = budget_s - (time.perf_counter() - t_start)
        return min(step_s, left) if left > 20 else None

    device = "cpu" if cpu else (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")
    report: dict = {"date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", "host": platform.node(),
                    "device": device, "torch": torch.__version__, "transformers": transformers.__version__,
                    "command": "python scripts/gpu_check.py" + (" --cpu" if cpu else ""), "steps": steps,
                    "warmup": warmup}
    report |= {"profile": {"ok": False, "error": "not run yet"}, "plans": [], "reference": []}
    rows = report["plans"]

    def write() -> None:
        """The report as it stands, after every step: a check cut short still leaves what it measured."""
        for row, run in zip(rows, runs, strict=False):
            if "profiled_predicted_s" not in row:
                _add_profiled(row, run, report["profile"])
        _compare_float8_losses(rows, runs[:len(rows)])
        _summarize(report)
        report["wall_s"] = round(time.perf_counter() - t_start, 1)
        (out / "gpu_validation.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "gpu_validation.md").write_text(markdown(report))

    # what a lease is for first: the plans asked for, then the hand-written loop, then this machine's profile
    for run in runs:
        progress(f"measure {run.name}")
        limit = within(300 if cpu else 150)
        rows.append(_measure(run, plans_dir / run.plan_file, CPU_CLUSTER if cpu else None, steps, warmup,
                             timeout_s=limit, trace=out / f"trace-{run.name}.json" if run.name in trace else None)
                    if limit else _not_run(run.name, budget_s))
        progress(f"  {_row_line(rows[-1])}")
        write()
    reference = next((r for r in runs if r.reference), None)
    if reference is not None:
        for compile_blocks in (False, True):
            progress(f"hand-written loop{' (compiled blocks)' if compile_blocks else ''}: {reference.name}")
            limit = within(400 if cpu else 240)
            report["reference"].append(_reference(reference, compile_blocks=compile_blocks, steps=steps,
                                                  warmup=warmup, timeout_s=limit) if limit else
                                       {**_not_run(reference.name, budget_s), "compile": compile_blocks})
            row = report["reference"][-1]
            progress(f"  {reference.name}: " + (f"{row['measured_s'] * 1e3:.1f} ms a step" if row.get("ok") else
                                                 f"FAILED {row.get('error', '')[-600:]}"))
            write()
    if profile:
        progress(f"profile ({device})")
        report["profile"] = _profile(out, timeout_s=within(300 if cpu else 240))
    else:
        report["profile"] = {"ok": False, "error": "not run (--no-profile)", "skipped": True}
    write()
    return report


# A float8 plan's loss against its 16-bit twin's, step by step (same model, seed and synthetic batches): e4m3
# operands keep 3 mantissa bits, and on a randomly initialized model the loss barely moves over a few steps; the
# bound is the CPU test's (tests/distributed/test_float8_runtime.py)
FLOAT8_LOSS_RTOL = 0.02


def _compare_float8_losses(rows: list[dict], runs: tuple[Run, ...]) -> None:
    """Add `float8_loss_diff` (the largest relative difference over the steps) and `float8_loss_ok` to every
    float8 row whose 16-bit twin (the same run without float8) ran."""
    by_config = {(r.model, r.global_batch, r.micro_batch, r.recompute, r.compile): row
                 for r, row in zip(runs, rows, strict=True) if not r.float8}
    for run, row in zip(runs, rows, strict=True):
        twin = by_config.get((run.model, run.global_batch, run.micro_batch, run.recompute, run.compile))
        if not run.float8 or not row.get("losses") or twin is None or not twin.get("losses"):
            continue
        diff = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], twin["losses"], strict=False))
        row |= {"float8_loss_diff": diff, "float8_loss_ok": diff <= FLOAT8_LOSS_RTOL}


def _row_line(row: dict) -> str:
    if not row.get("ok"):
        return f"{row['run']}: FAILED {row.get('error', '')[-300:]}"
    line = (f"{row['run']}: measured {row['measured_s'] * 1e3:.1f} ms, predicted {row['predicted_s'] * 1e3:.1f} ms "
            f"({row['time_error_pct']:+.1f}%)")
    if "peak_reserved_gib" in row:
        line += (f"; memory predicted {row['predicted_memory_gib']:.2f} GiB, reserved {row['peak_reserved_gib']:.2f}"
                 f" ({row['memory_error_pct']:+.1f}%), allocated {row['peak_allocated_gib']:.2f}")
    if "float8_loss_diff" in row:
        line += (f"; loss within {row['float8_loss_diff'] * 100:.2f}% of its 16-bit twin's "
                 f"({'ok' if row['float8_loss_ok'] else 'ABOVE'} the {FLOAT8_LOSS_RTOL:.0%} bound)")
    return line


def markdown(report: dict) -> str:
    """The report as the markdown file `benchmarks/gpu_validation.md` keeps."""
    lines = [f"# Single-{'CPU-rank' if report['device'] == 'cpu' else 'GPU'} validation: predicted against measured",
             "", f"`{report['command']}` on {report['device']} ({report['host']}), torch {report['torch']}, "
             f"transformers {report['transformers']}, {report['date']}; {report['steps']} timed steps after "
             f"{report['warmup']} warm-up, medians; {report['wall_s']:.0f} s in all." + (
                 f" Predictions priced again by `python scripts/gpu_check.py --reprice` on {report['repriced']}."
                 if report.get("repriced") else ""), "",
             "| plan | measured ms | predicted ms | error | on this machine's profile | peak reserved GiB "
             "| peak allocated GiB | predicted GiB | memory error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["plans"]:
        if not r.get("ok"):
            lines.append(f"| {r['run']} | failed: {r.get('error', '').strip().splitlines()[-1:]} | | | | | | | |")
            continue
        mem = (f"{r['peak_reserved_gib']:.2f} | {r['peak_allocated_gib']:.2f} | {r['predicted_memory_gib']:.2f} | "
               f"{r['memory_error_pct']:+.1f}%") if "peak_reserved_gib" in r else "| | |"
        profiled = (f"{r['profiled_predicted_s'] * 1e3:.1f} ({r['profiled_time_error_pct']:+.1f}%)"
                    if "profiled_time_error_pct" in r else "")
        lines.append(f"| {r['run']} | {r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | "
                     f"{r['time_error_pct']:+.1f}% | {profiled} | {mem} |")
    fmt = lambda v: "n/a" if v is None else f"{v:.1f}%"  # noqa: E731
    lines += ["", f"Step time MAPE {fmt(report['time_mape_pct'])} (plans as made, datasheet profile), "
                  f"{fmt(report['profiled_time_mape_pct'])} (priced on this machine's profile); memory against "
                  f"the peak reserved, MAPE {fmt(report['memory_mape_pct'])}. Error = (predicted - measured) / "
                  "measured.", ""]
    if report["reference"]:
        lines += ["The same step written by hand (torchtitan's FSDP2 per block; `autoshard/measure/reference_loop.py`):",
                  "", "| loop | measured ms | peak reserved GiB |", "|---|---|---|"]
        for r in report["reference"]:
            what = f"{r['run']}, {'blocks compiled' if r['compile'] else 'eager'}"
            if r.get("ok"):
                mem = f"{r['peak_reserved_gib']:.2f}" if r.get("peak_reserved_gib") else ""
                lines.append(f"| {what} | {r['measured_s'] * 1e3:.1f} | {mem} |")
            else:
                lines.append(f"| {what} | failed: {r.get('error', '').strip().splitlines()[-1:]} | |")
    prof = report["profile"]
    lines += ["", "Profile (`autoshard profile --quick`, one rank): " + (
        f"best GEMM {prof['best_gemm_tflops']:.3g} TFLOP/s, {prof['hbm_gbps']:.4g} GB/s, host per op "
        f"{prof['host_us_per_op']} us, device per tiny kernel {prof['kernel_launch_us']} us, flash "
        f"attention by length {prof['flash_attention_by_seq']}, FSDP2 per module {prof['fsdp_us_per_module']} us, "
        f"AdamW per tensor {prof['optimizer_us_per_tensor']} us, {prof['wall_s']:.0f} s." if prof.get("ok")
        else prof.get("error", "") if prof.get("skipped") else f"failed: {prof.get('error', '')[-300:]}"), ""]
    return "\n".join(lines)


def reprice(report: dict, runs: tuple[Run, ...] = GPU_RUNS) -> dict:
    """The report with every measured plan priced again by this autoshard (the datasheet profile and the
    profile the check measured): the measurements stay, the predictions and errors follow the cost model."""
    from autoshard.api import estimate_config

    by_name = {r.name: r for r in runs}
    for row in report["plans"]:
        run = by_name.get(row["run"])
        if run is None or not row.get("ok"):
            continue
        plan, _ = estimate_config(run.model, GPU_CLUSTER, dp=1, micro_batch=run.micro_batch,
                                  global_batch=run.global_batch, recompute=run.recompute, compile=run.compile,
                                  float8=run.float8, check_memory=False)
        pred = plan.prediction
        row |= {"predicted_s": pred.iteration_time_s, "predicted_breakdown_s": pred.time.seconds(),
                "time_error_pct": (pred.iteration_time_s - row["measured_s"]) / row["measured_s"] * 100}
        if "peak_reserved_gib" in row:
            row["predicted_memory_gib"] = pred.memory.total_bytes / 2**30
            row["memory_error_pct"] = (row["predicted_memory_gib"] - row["peak_reserved_gib"]) / row["peak_reserved_gib"] * 100
        for key in ("profiled_predicted_s", "profiled_predicted_memory_gib", "profiled_error", "profiled_time_error_pct"):
            row.pop(key, None)
        _add_profiled(row, run, report["profile"])
    _summarize(report)
    report["repriced"] = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="one CPU rank, tiny models (what CI runs)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the report goes (default: $OUT if set, else benchmarks/)")
    parser.add_argument("--plans", type=Path, default=PLANS_DIR, help="the committed single-GPU plans")
    parser.add_argument("--only", nargs="*", default=(), help="run only these plans (by name), in this order")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: 6 on GPU, 2 on CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 2 on GPU, 1 on CPU)")
    parser.add_argument("--budget", type=float, default=None, metavar="S",
                        help="start no step after S seconds and run none past them (default: 450 on a GPU, none "
                             "with --cpu)")
    parser.add_argument("--trace", nargs="*", default=(), metavar="NAME",
                        help="these plans also profile one step (`measure --trace`): trace-NAME.json beside the report")
    parser.add_argument("--no-profile", action="store_true",
                        help="skip `autoshard profile` (a second pass of a lease that has profiled once)")
    parser.add_argument("--reprice", type=Path, default=None, metavar="JSON",
                        help="price the measured plans of a report (gpu_validation.json) again with this autoshard "
                             "and rewrite it and its .md beside it; measures nothing")
    parser.add_argument("--make-plans", action="store_true",
                        help=f"write the GPU plans into --plans (on a machine with the planner; {GPU_CLUSTER})")
    args = parser.parse_args(argv)
    if args.reprice:
        report = reprice(json.loads(args.reprice.read_text()))
        args.reprice.write_text(json.dumps(report, indent=1) + "\n")
        args.reprice.with_suffix(".md").write_text(markdown(report))
        print(f"{args.reprice}: step-time MAPE {report['time_mape_pct']:.1f}%, on the measured profile "
              f"{report['profiled_time_mape_pct']:.1f}%")
        return 0
    if args.make_plans:
        for path in make_plans(GPU_RUNS, GPU_CLUSTER, args.plans):
            print(path)
        return 0
    unknown = (set(args.only) | set(args.trace)) - {r.name for r in (CPU_RUNS if args.cpu else GPU_RUNS)}
    if unknown:
        print(f"gpu_check.py: unknown plan names {sorted(unknown)}", file=sys.stderr)
        return 2
    out = args.out or Path(os.environ.get("OUT") or ROOT / "benchmarks")
    steps = args.steps or (2 if args.cpu else 6)
    warmup = args.warmup if args.warmup is not None else (1 if args.cpu else 2)
    budget = args.budget if args.budget is not None else (None if args.cpu else 450.0)
    report = check(cpu=args.cpu, out=out, plans_dir=args.plans, steps=steps, warmup=warmup, only=tuple(args.only),
                   budget_s=budget, profile=not args.no_profile, trace=tuple(args.trace),
                   progress=lambda msg: print(msg, flush=True))
    failed = [r["run"] for r in report["plans"] + report["reference"] if not r.get("ok")]
    failed += ["profile"] if not report["profile"].get("ok") and not report["profile"].get("skipped") else []
    print(f"report: {out / 'gpu_validation.md'}; step-time MAPE {report['time_mape_pct']}; failed: {failed or 'none'}")
    return 1 if failed else 0
