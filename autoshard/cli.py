"""`autoshard` command line: argparse front end, no logic of its own.

Every command takes `--json`. User errors print one line on stderr and exit 2; no tracebacks.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from autoshard.errors import AutoshardError

__all__ = ["main", "build_parser"]


def _emit(args, data: dict, text: str) -> None:
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        print(text)


# -- models / inspect ------------------------------------------------------------------------------------
def _cmd_models(args) -> int:
    from autoshard.models import SOURCES, ZOO
    from autoshard.reports import zoo_rows

    rows = zoo_rows()
    lines = [f"{'name':14s} {'family':7s} {'params':>10s}  source"]
    lines += [f"{r['name']:14s} {r['family']:7s} {r['params'] / 1e9:9.2f}B  {SOURCES[r['name']]}" for r in rows]
    _emit(args, {"models": rows}, "\n".join(lines))
    del ZOO
    return 0


def _cmd_inspect(args) -> int:
    from autoshard.capture import capture_model
    from autoshard.models import load_model
    from autoshard.reports import inspect_report

    t0 = time.perf_counter()
    loaded = load_model(args.model, seq=args.seq)
    graph = capture_model(loaded)
    report = inspect_report(graph, batch=args.batch, capture_s=time.perf_counter() - t0)
    text = [f"model            {report['model']}",
            f"parameters       {report['params']:,} ({report['params'] / 1e9:.3f} B)",
            f"layers           {report['layers']} ({', '.join(report['blocks']) or 'no repeated blocks'})",
            f"sequence length  {report['seq']}",
            f"fwd FLOPs/token  {report['flops_per_token']:.4g} (matmuls), {report['flops_per_token_all']:.4g} (all)",
            f"operators        {report['num_ops']}: " + ", ".join(f"{k} {v}" for k, v in report['ops_by_kind'].items()),
            f"capture time     {report['capture_s']:.2f} s"]
    if report["unknown_ops"]:
        text.append(f"unknown ops      {', '.join(report['unknown_ops'])} (kept, priced as memory-bound)")
    _emit(args, report, "\n".join(text))
    return 0


# -- estimate ---------------------------------------------------------------------------------------------
def prediction_json(pred) -> dict:
    """The figures every prediction reports, under the keys scripts rely on."""
    mem = pred.memory.gib()
    return {
        "iteration_time_s": pred.iteration_time_s,
        "tokens_per_s": pred.tokens_per_s,
        "model_tflops_per_gpu": pred.model_tflops_per_gpu,
        "mfu": pred.mfu,
        "memory_gib": {"params": mem["params"], "grads": mem["grads"], "optimizer": mem["optimizer"],
                       "activations": mem["activations"], "transient": mem["transient"], "other": mem["other"],
                       "total": mem["total"]},
        "breakdown_s": pred.time.seconds(),
    }


def _prediction_text(pred, cluster) -> list[str]:
    mem = pred.memory.gib()
    cap = cluster.device_memory_bytes / 2**30
    return [
        f"iteration time   {pred.iteration_time_s:.3f} s",
        f"throughput       {pred.tokens_per_s:,.0f} tokens/s, {pred.model_tflops_per_gpu:.1f} model TFLOP/s per GPU, "
        f"MFU {pred.mfu * 100:.1f}%",
        "time breakdown   " + ", ".join(f"{k} {v:.3f} s" for k, v in pred.time.seconds().items() if v > 0),
        f"memory per GPU   {mem['total']:.1f} of {cap:.0f} GiB: " + ", ".join(
            f"{k} {v:.1f}" for k, v in mem.items() if k != "total" and v > 0.005),
    ]


def _cmd_estimate(args) -> int:
    from autoshard.api import estimate_config

    plan, cluster = estimate_config(
        args.model, args.cluster, tp=args.tp, pp=args.pp, dp=args.dp, micro_batch=args.micro_batch,
        global_batch=args.global_batch, seq=args.seq, recompute=args.recompute,
        sequence_parallel=args.sequence_parallel, virtual_stages=args.virtual_stages, schedule=args.schedule,
        zero=args.zero)
    pred = plan.prediction
    data = {"model": plan.model, "cluster": plan.cluster, "mesh": plan.mesh.to_json(),
            "pipeline": {"degree": plan.pipeline.degree, "schedule": plan.pipeline.schedule,
                         "virtual_stages": plan.pipeline.virtual_stages},
            "num_microbatches": plan.num_microbatches, **prediction_json(pred)}
    head = [f"{plan.model} on {plan.cluster}: mesh {plan.mesh}, micro-batch {plan.micro_batch} x "
            f"{plan.num_microbatches}, recompute {plan.recompute}"
            + (f", {plan.pipeline.schedule} x{plan.pipeline.virtual_stages}" if plan.pipeline.degree > 1 else "")]
    _emit(args, data, "\n".join(head + _prediction_text(pred, cluster)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autoshard", description="Auto-parallelization planner for PyTorch training.")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("models", help="list the model zoo")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=_cmd_models)

    i = sub.add_parser("inspect", help="capture a model and print its operator graph summary")
    i.add_argument("model", help="zoo name, spec string (gpt:layers=..,hidden=..,heads=..,seq=..) or module:factory")
    i.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    i.add_argument("--batch", type=int, default=1, help="batch size the per-sample figures are scaled to")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_cmd_inspect)

    e = sub.add_parser("estimate", help="predict a hand-given Megatron/DeepSpeed-style configuration")
    e.add_argument("model")
    e.add_argument("--cluster", required=True, help="NODESxGPUSxGPU[@NETWORK] or a cluster YAML file")
    e.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (Megatron 1D)")
    e.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    e.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: GPUs / (tp x pp))")
    e.add_argument("--micro-batch", type=int, default=1)
    e.add_argument("--global-batch", type=int, required=True)
    e.add_argument("--seq", type=int, default=None)
    e.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    e.add_argument("--sequence-parallel", action="store_true")
    e.add_argument("--virtual-stages", type=int, default=1, help="model chunks per pipeline rank")
    e.add_argument("--schedule", choices=("1f1b", "interleaved-1f1b", "gpipe", "looped-bfs"), default=None)
    e.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage over dp")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=_cmd_estimate)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s",
                        stream=sys.stderr)
    try:
        return args.func(args)
    except AutoshardError as exc:
        print(f"autoshard: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autoshard: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
