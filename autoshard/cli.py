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
