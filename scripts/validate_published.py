"""Predict every published training run and memory figure; report the errors.

    python scripts/validate_published.py [--ids PREFIX,...] [--json]

Time rows (`references/published_runs.csv`): each row becomes the `autoshard estimate` call that
`shared/tools/published.py` makes (same GPU mapping, cluster, degrees, batch, recompute and flags; the
functions below are copied from it and a test checks they agree), and the measured metric is converted to
seconds per iteration the same way. Memory rows (`references/published_memory.csv`): model states and
activations per GPU of Korthikanti et al. 2022 Fig. 1 (first pipeline stage; Megatron's attention, which
materializes the score matrix, as in their implementation), and ZeRO's model-state formula.

Writes benchmarks/published_validation.md and .json. No constant is fitted to these rows.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "references" / "published_runs.csv"
MEMORY = ROOT / "references" / "published_memory.csv"

# -- copied from shared/tools/published.py (keep in sync; tests/test_validation.py checks) ------------------
GPU = {
    "A100-80GB": "A100-80GB", "A100 (": "A100-80GB", "a100_80gb": "A100-80GB", "a100_40gb": "A100-40GB",
    "H100": "H100-80GB", "h100_80gb": "H100-80GB", "V100": "V100-32GB",
}


def gpu_of(row):
    hw = row["hardware"]
    for k, v in GPU.items():
        if k in hw:
            return v
    if row["id"].startswith(("ptdp21", "kor22", "mtnlg", "bloom")):
        return "A100-80GB"
    raise ValueError(f"no GPU for {row['id']}")


def num(x):
    return float(x) if x not in ("", None) else None


def measured_seconds(row):
    m, v, n = row["metric"], row["value"], num(row["n_gpus"])
    if m == "iteration_time_s":
        return float(v)
    if m == "iteration_time_ms":
        return float(v) / 1000
    if m == "achieved_TFLOPs_per_GPU_incl_recompute":
        B, s, l, h, V = num(row["gbs"]), num(row["seq"]), num(row["layers"]), num(row["hidden"]), num(row["vocab"])
        F = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
        return F / (float(v) * 1e12 * n)
    if m == "model_TFLOPs_per_GPU":
        B, s, l, h, V = num(row["gbs"]), num(row["seq"]), num(row["layers"]), num(row["hidden"]), num(row["vocab"])
        F = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
        return F / (float(v) * 1e12 * n)
    if m == "MFU_pct":
        t = re.search(r"tokens/s/GPU ([0-9.]+)", row["notes"])
        if not t:
            raise ValueError("no tokens/s in notes")
        return num(row["gbs"]) * num(row["seq"]) / (float(t.group(1)) * n)
    raise ValueError(f"metric {m} not handled")


def model_spec(row):
    kind = "llama" if "llama" in row["model"].lower() else "gpt"
    parts = [f"layers={int(num(row['layers']))}", f"hidden={int(num(row['hidden']))}",
             f"heads={int(num(row['heads']))}", f"seq={int(num(row['seq']))}"]
    if row["vocab"]:
        parts.append(f"vocab={int(num(row['vocab']))}")
    if row["ffn"]:
        parts.append(f"ffn={int(num(row['ffn']))}")
    if row["kv_heads"]:
        parts.append(f"kv_heads={int(num(row['kv_heads']))}")
    return kind + ":" + ",".join(parts)


def estimate_args(row):
    n = int(num(row["n_gpus"]))
    gpn = 16 if "DGX-2" in row["hardware"] else 8
    nodes = max(1, n // gpn)
    gpus_here = gpn if n >= gpn else n
    net = ""
    if row["id"].startswith("vtrain_"):
        net = "@ib-hdr-4x200"
    cluster = f"{nodes}x{gpus_here}x{gpu_of(row)}{net}"
    dp = row["dp"]
    zero = None
    if dp.startswith("FSDP"):
        zero = 3 if "SHARD_GRAD_OP" not in dp else 2
        dp = str(n // (int(num(row["tp"]) or 1) * int(num(row["pp"]) or 1)))
    elif row["id"].startswith("ptdp21_t2_zero3"):
        zero = 3
    tp, pp = int(num(row["tp"]) or 1), int(num(row["pp"]) or 1)
    dp = int(num(dp)) if dp else n // (tp * pp)
    gbs = int(num(row["gbs"]))
    mbs = int(num(row["mbs"])) if row["mbs"] else 1
    rc = row["recompute"].lower()
    recompute = "full" if rc.startswith(("full", "yes", "checkpointing")) else (
        "selective" if "selective" in rc else "none")
    args = ["estimate", model_spec(row), "--cluster", cluster, "--tp", str(tp), "--pp", str(pp), "--dp", str(dp),
            "--micro-batch", str(mbs), "--global-batch", str(gbs), "--recompute", recompute, "--json"]
    if "sequence" in rc or "+ sp" in rc:
        args.append("--sequence-parallel")
    if row["vp"]:
        args += ["--virtual-stages", str(int(num(row["vp"])))]
    if zero:
        args += ["--zero", str(zero)]
    return args
# -- end of copy -------------------------------------------------------------------------------------------


def predict(args: list[str]) -> dict:
    """Run `autoshard estimate` in-process with exactly these arguments; returns its JSON."""
    import contextlib
    import io

    from autoshard.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(args)
    if code != 0:
        raise RuntimeError(err.getvalue().strip() or f"exit {code}")
    return json.loads(out.getvalue())


def time_rows(ids: tuple[str, ...] = ()) -> list[dict]:
    rows = list(csv.DictReader(RUNS.open()))
    if ids:
        rows = [r for r in rows if r["id"].startswith(ids)]
    out = []
    for r in rows:
        rec = {"id": r["id"], "source": r["where"], "measured_s": None, "predicted_s": None, "error_pct": None}
        try:
            rec["measured_s"] = measured_seconds(r)
            args = estimate_args(r)
            rec["command"] = "autoshard " + " ".join(args)
            got = predict(args)
            rec["predicted_s"] = got["iteration_time_s"]
            rec["mfu"] = got["mfu"]
            rec["error_pct"] = 100 * (got["iteration_time_s"] - rec["measured_s"]) / rec["measured_s"]
        except Exception as exc:  # noqa: BLE001 - a row we cannot predict is reported, and counts
            rec["failure"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        out.append(rec)
    return out


def _memory_prediction(r: dict) -> float:
    """GiB (or GB for ZeRO rows) of the row's metric, predicted."""
    from autoshard.api import estimate_config

    if r["id"].startswith("zero20"):
        stage = int(r["id"][-1])
        plan, _ = estimate_config("gpt-7.5b", "8x8xA100-80GB", dp=64, global_batch=64, zero=stage,
                                  check_memory=False)
        mem = plan.prediction.memory
        return (mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes) / 1e9 * (7.5 / 7.47)
    spec = (f"gpt:layers={r['layers']},hidden={r['hidden']},heads={r['heads']},seq={r['seq']},"
            f"vocab={r['vocab']},attn=eager")
    interleave = int(r["interleave"] or 1)
    rc = {"any": "none", "none": "none", "selective": "selective", "full": "full"}[r["recompute"]]
    tp, pp, dp = int(r["tp"]), int(r["pp"]), int(r["dp"])
    mbs = int(r["mbs"])
    gbs = mbs * dp * max(pp * 2, 8)  # enough micro-batches to fill the pipeline
    plan, cluster = estimate_config(
        spec, f"{max(1, tp * pp * dp // 8)}x{min(8, tp * pp * dp)}xA100-80GB", tp=tp, pp=pp, dp=dp,
        micro_batch=mbs, global_batch=gbs, recompute=rc, sequence_parallel=r["sequence_parallel"] == "yes",
        virtual_stages=interleave, check_memory=False)
    mem = plan.prediction.memory
    if r["metric"].startswith("params_plus_optimizer"):
        return (mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes) / 2**30
    return mem.activations_bytes / 2**30


def memory_rows() -> list[dict]:
    out = []
    for r in csv.DictReader(MEMORY.open()):
        rec = {"id": r["id"], "metric": r["metric"], "published": float(r["value_gib"])}
        try:
            rec["predicted"] = _memory_prediction(r)
            rec["error_pct"] = 100 * (rec["predicted"] - rec["published"]) / rec["published"]
        except Exception as exc:  # noqa: BLE001
            rec["failure"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        out.append(rec)
    return out


def mape(recs: list[dict], prefix: str = "") -> float:
    errs = [abs(r["error_pct"]) for r in recs if r.get("error_pct") is not None and r["id"].startswith(prefix)]
    return sum(errs) / len(errs) if errs else math.nan


def _markdown(times: list[dict], mems: list[dict]) -> str:
    lines = ["# Published-run validation", "",
             "Generated by `python scripts/validate_published.py`. Predicted iteration time of each published run "
             "(the `autoshard estimate` call shown) against the measured one; no constant is fitted to these rows.",
             "", "| run | measured s | predicted s | error |", "|---|---:|---:|---:|"]
    for r in times:
        if r.get("error_pct") is None:
            lines.append(f"| {r['id']} | {r['measured_s'] or float('nan'):.3f} | not predicted: {r.get('failure', '')} | |")
        else:
            lines.append(f"| {r['id']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} | {r['error_pct']:+.1f}% |")
    lines += ["", "| group | MAPE |", "|---|---:|"]
    for prefix in ("ptdp21_t1_", "kor22_", "mpt_", "meg19", ""):
        lines.append(f"| {prefix or 'all'} | {mape(times, prefix):.1f}% |")
    lines += ["", "## Memory per GPU", "", "| figure | published | predicted | error |", "|---|---:|---:|---:|"]
    for r in mems:
        if r.get("error_pct") is None:
            lines.append(f"| {r['id']} | {r['published']:.2f} | not predicted: {r.get('failure', '')} | |")
        else:
            lines.append(f"| {r['id']} | {r['published']:.2f} | {r['predicted']:.2f} | {r['error_pct']:+.1f}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ids", default="", help="comma-separated id prefixes (default: every row)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="do not write benchmarks/")
    a = ap.parse_args(argv)
    ids = tuple(p for p in a.ids.split(",") if p)
    times = time_rows(ids)
    mems = memory_rows() if not ids else []
    result = {"time": times, "memory": mems, "mape": {p or "all": mape(times, p)
                                                       for p in ("ptdp21_t1_", "kor22_", "mpt_", "meg19", "")}}
    if not a.no_write:
        (ROOT / "benchmarks").mkdir(exist_ok=True)
        (ROOT / "benchmarks" / "published_validation.md").write_text(_markdown(times, mems))
        (ROOT / "benchmarks" / "published_validation.json").write_text(json.dumps(result, indent=1) + "\n")
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        print(_markdown(times, mems))
    return 0


if __name__ == "__main__":
    sys.exit(main())
