"""Float8 against bf16 by GEMM shape on one GPU: the GEMM alone (`torch._scaled_mm`, tensorwise scales, against
`torch.mm`) and a whole Linear's forward and backward compiled (torchao `Float8Linear`, tensorwise, against
`nn.Linear`), which adds the casts, amax reductions and transposes. The figures the cost model's float8 pricing
(autoshard/cost_models/float8.py) is checked against; written to benchmarks/float8_shapes.md and .json.

    PYTHONPATH=. python scripts/float8_shapes.py [--budget 200]   # on a GPU with fp8 tensor cores, torchao
    python scripts/float8_shapes.py --cpu                           # tiny shapes on the CPU: the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from autoshard.measure.profile import FP8_GEMM_SHAPES  # noqa: E402

# (M tokens, K in, N out): the block Linears of gpu_check's Llama 3.2 1B micro-batch (4,096 tokens), then larger
# Llama 3 widths (8B: 4096 / 14336, 70B: 8192 / 28672) at 8,192 tokens: what `autoshard profile` times too
GEMM_SHAPES = FP8_GEMM_SHAPES
LINEAR_SHAPES = ((4096, 2048, 2048), (4096, 2048, 512), (4096, 2048, 8192), (4096, 8192, 2048),
                 (8192, 4096, 14336), (8192, 8192, 8192), (8192, 8192, 28672))
CPU_SHAPES = ((64, 32, 48), (64, 48, 32))


def _time_s(fn, *, device: str, warmup: int = 3, reps: int = 15) -> float:
    """Median seconds of fn() (CUDA events on a GPU, a synchronized host clock elsewhere)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_row(m: int, k: int, n: int, device: str) -> dict:
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    bf16_s = _time_s(lambda: torch.mm(a, b.t()), device=device)
    row = {"m": m, "k": k, "n": n, "bf16_s": bf16_s, "bf16_tflops": 2 * m * k * n / bf16_s / 1e12}
    if device == "cuda":
        fp8 = torch.float8_e4m3fn
        a8, b8 = a.to(fp8), b.to(fp8)
        one = torch.ones((), device=device)
        fp8_s = _time_s(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                        device=device)
        row |= {"fp8_s": fp8_s, "fp8_tflops": 2 * m * k * n / fp8_s / 1e12, "gemm_speedup": bf16_s / fp8_s}
    return row


def linear_row(m: int, k: int, n: int, device: str) -> dict:
    """One Linear's forward and backward, compiled, bf16 against torchao's tensorwise Float8Linear."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    row = {"m": m, "k": k, "n": n}
    for name, float8 in (("bf16", False), ("fp8", True)):
        torch._dynamo.reset()
        lin = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device=device, dtype=torch.bfloat16)
        if float8:
            convert_to_float8_training(lin, config=Float8LinearConfig())
        step = torch.compile(lin)

        def fwd_bwd(step=step):
            step(x).backward(gy)

        t0 = time.perf_counter()
        fwd_bwd()
        row[f"{name}_compile_s"] = time.perf_counter() - t0
        row[f"{name}_fwd_bwd_s"] = _time_s(fwd_bwd, device=device)
    row["linear_speedup"] = row["bf16_fwd_bwd_s"] / row["fp8_fwd_bwd_s"]
    return row


def markdown(report: dict) -> str:
    lines = ["# Float8 against bf16 by shape: the GEMM alone and a compiled Linear", "",
             f"`{report['command']}` on {report['device']}, torch {report['torch']}, torchao {report['torchao']}, "
             f"{report['date']}; medians of 15 after 3 warm-ups; {report['wall_s']:.0f} s in all.", "",
             "| M x K x N | bf16 mm TFLOP/s | fp8 _scaled_mm TFLOP/s | GEMM speedup |", "|---|---|---|---|"]
    for r in report["gemm"]:
        fp8 = (f"{r['fp8_tflops']:.3g} | {r['gemm_speedup']:.2f}x" if "fp8_s" in r else "| ")
        lines.append(f"| {r['m']} x {r['k']} x {r['n']} | {r['bf16_tflops']:.3g} | {fp8} |")
    lines += ["", "One Linear, forward and backward (three GEMMs), each `torch.compile`d: bf16 `nn.Linear` against "
              "torchao `Float8Linear` (tensorwise: the casts, amax reductions and transposes included).", "",
              "| M x K x N | bf16 ms | float8 ms | speedup |", "|---|---|---|---|"]
    for r in report["linear"]:
        if "error" in r:
            lines.append(f"| {r['m']} x {r['k']} x {r['n']} | failed: {r['error'][:120]} | | |")
        else:
            lines.append(f"| {r['m']} x {r['k']} x {r['n']} | {r['bf16_fwd_bwd_s'] * 1e3:.3f} | "
                         f"{r['fp8_fwd_bwd_s'] * 1e3:.3f} | {r['linear_speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="float8_shapes.py", description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (checks the script, not figures)")
    parser.add_argument("--budget", type=float, default=200.0, metavar="S", help="start no shape after S seconds")
    parser.add_argument("--out", type=Path, default=None, help="default: $OUT if set, else benchmarks/")
    args = parser.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("float8_shapes.py: no CUDA device; run with --cpu to check the script", file=sys.stderr)
        return 2
    import torchao

    out = args.out or Path(os.environ.get("OUT") or ROOT / "benchmarks")
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    report = {"command": "python scripts/float8_shapes.py" + (" --cpu" if args.cpu else ""),
              "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
              "torchao": torchao.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "gemm": [], "linear": []}

    def write():
        report["wall_s"] = time.perf_counter() - t_start
        (out / "float8_shapes.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "float8_shapes.md").write_text(markdown(report))

    for shape in CPU_SHAPES if args.cpu else GEMM_SHAPES:
        report["gemm"].append(gemm_row(*shape, device))
        print(report["gemm"][-1], flush=True)
    write()
    for shape in (() if args.cpu else LINEAR_SHAPES):  # torch._scaled_mm has no CPU kernel for this
        if time.perf_counter() - t_start > args.budget:
            print(f"budget of {args.budget:.0f} s spent: {shape} and after not run", flush=True)
            break
        try:
            report["linear"].append(linear_row(*shape, device))
        except Exception as exc:  # noqa: BLE001 - a failed shape is a figure too
            report["linear"].append({"m": shape[0], "k": shape[1], "n": shape[2], "error": repr(exc)[-500:]})
        print(report["linear"][-1], flush=True)
        write()
    write()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
