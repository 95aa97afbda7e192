"""`autoshard` command line: argparse front end, no logic of its own.

Every command takes `--json`. User errors print one line on stderr and exit 2; no tracebacks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import replace as dc_replace

from autoshard.cost_models.zero_impl import ZERO_IMPLS
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
    args.progress(f"capturing {args.model}")
    loaded = load_model(args.model, seq=args.seq)
    graph = capture_model(loaded)
    args.progress.close()
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


def _prediction_text(pred, cluster, plan=None) -> list[str]:
    mem = pred.memory.gib()
    return [
        f"iteration time   {pred.iteration_time_s:.3f} s",
        f"throughput       {pred.tokens_per_s:,.0f} tokens/s, {pred.model_tflops_per_gpu:.1f} model TFLOP/s per GPU, "
        f"MFU {pred.mfu * 100:.1f}%",
        "time breakdown   " + ", ".join(f"{k} {v:.3f} s" for k, v in pred.time.seconds().items() if v > 0),
        f"memory per GPU   {mem['total']:.1f} of {cluster.device_memory_text}: " + ", ".join(
            f"{k} {v:.1f}" for k, v in mem.items() if k != "total" and v > 0.005),
        *(f"caution          {w}" for w in _warnings(pred, cluster, plan)),
    ]


def _warnings(pred, cluster, plan=None) -> list[str]:
    from autoshard.planner.envelope import (
        envelope_warnings,
        memory_warnings,
        sequence_warnings,
        sharding_warnings,
    )

    out = envelope_warnings(pred.mfu, cluster.gpu.name, cluster.num_gpus)
    if out and plan is not None and plan.float8:  # the envelope is of 16-bit runs; MFU counts the bf16 peak
        out = [f"predicted MFU {pred.mfu * 100:.1f}% counts the 16-bit peak while the block GEMMs run in float8, so "
               "16-bit runs do not bound it; torchao reports 1.25x-1.5x end-to-end over bf16 (8 to 512 H100s, "
               "docs.pytorch.org/ao, training workflows): a larger gain is a claim to measure"]
    if plan is not None:
        out += sequence_warnings(plan.seq, cluster.gpu.name, plan.attention,
                                 measured_curve=bool(cluster.gpu.flash_attention_by_seq))
        out += sharding_warnings(plan, cluster.gpu.name)
    return out + memory_warnings(pred.memory.total_bytes, cluster)


def _attention_kernel(plan) -> str:
    from autoshard.plans.contract import ATTENTION_KERNELS

    return ATTENTION_KERNELS.get(plan.attention, plan.attention or "unknown")


def _cmd_estimate(args) -> int:
    from autoshard.api import estimate_config

    args.progress(f"loading the graph of {args.model}")
    plan, cluster = estimate_config(
        args.model, args.cluster, tp=args.tp, pp=args.pp, dp=args.dp, micro_batch=args.micro_batch,
        global_batch=args.global_batch, seq=args.seq, recompute=args.recompute,
        sequence_parallel=args.sequence_parallel, virtual_stages=args.virtual_stages, schedule=args.schedule,
        zero=args.zero, attention=args.attention, fused_kernels=args.fused_kernels, fused_loss=args.fused_loss,
        loss_parallel=args.loss_parallel, zero_impl=args.zero_impl, cp=args.cp, cp_attention=args.cp_attention, ep=args.ep,
        ep_imbalance=args.ep_imbalance, tp_comm_overlap=args.tp_comm_overlap, allocator=args.allocator,
        compile=args.compile, float8=args.float8 or "")
    args.progress.close()
    pred = plan.prediction
    from autoshard.planner.estimate import sequence_parallel_default

    tp = plan.mesh.degree("tp")
    sp = tp > 1 and bool(args.sequence_parallel or sequence_parallel_default(tp, args.tp_comm_overlap))
    data = {"model": plan.model, "cluster": plan.cluster, "mesh": plan.mesh.to_json(),
            "pipeline": {"degree": plan.pipeline.degree, "schedule": plan.pipeline.schedule,
                         "virtual_stages": plan.pipeline.virtual_stages,
                         "layers_per_chunk": [b - a for a, b in plan.pipeline.stage_layers]},
            "num_microbatches": plan.num_microbatches, "attention": _attention_kernel(plan),
            "recompute": plan.recompute, "fused_kernels": args.fused_kernels, "fused_loss": args.fused_loss,
            "sequence_parallel": sp, "loss_parallel": args.loss_parallel,
            "zero_impl": args.zero_impl, "cp": args.cp, "cp_attention": args.cp_attention, "ep": args.ep,
            "tp_comm_overlap": args.tp_comm_overlap or "none", "compile": args.compile,
            "float8": args.float8 or "none",
            **prediction_json(pred), "warnings": _warnings(pred, cluster, plan)}
    from autoshard.planner.explain import batch_label, recompute_label
    from autoshard.plans.plan import ends_as_layers_stage_layers

    head = [f"{plan.model} on {plan.cluster}: mesh {str(plan.mesh) or 'one GPU'}, micro-batch "
            f"{batch_label(plan.micro_batch, plan.num_microbatches)}, "
            f"recompute {recompute_label(plan.recompute, plan.attention)}, attention {data['attention']}"
            + (", sequence parallel" if data["sequence_parallel"] else "")
            + (f", {plan.pipeline.schedule} x{plan.pipeline.virtual_stages}" if plan.pipeline.degree > 1 else "")
            + (f", context parallel {plan.mesh.degree('cp')} ({args.cp_attention} K/V)" if args.cp > 1 else "")
            + (f", expert parallel {plan.ep}" if plan.ep > 1 else "")
            + (", compiled blocks" if args.compile else "")
            + (f", float8 {args.float8}" if args.float8 else "")]
    per_chunk = data["pipeline"]["layers_per_chunk"]
    if len(set(per_chunk)) > 1:
        ends = (sum(per_chunk) + 2) % len(per_chunk) == 0 and per_chunk == [
            hi - lo for lo, hi in ends_as_layers_stage_layers(sum(per_chunk), len(per_chunk))]
        head.append(f"layers per chunk {','.join(map(str, per_chunk))} (the layers do not divide evenly: "
                    + ("the embedding and the head each take a layer's place, as Megatron-DeepSpeed, "
                       "Megatron-Core and torchtitan split them)" if ends else
                       "balanced by cost, embeddings and head included)"))
    if args.output:
        plan.save(args.output)
        data["plan_file"] = args.output
        head.append(f"plan written to  {args.output} (run it: torchrun --nproc-per-node {plan.mesh.size} "
                    f"-m autoshard measure {args.output})")
    _emit(args, data, "\n".join(head + _prediction_text(pred, cluster, plan)))
    return 0


# -- plan / explain / hardware ------------------------------------------------------------------------------
def _pred_row(pred) -> dict | None:
    if pred is None:
        return None
    return {"iteration_time_s": pred.iteration_time_s, "tokens_per_s": pred.tokens_per_s, "mfu": pred.mfu,
            "memory_gib_per_gpu": pred.memory.total_bytes / 2**30}


def _cmd_plan(args) -> int:
    from autoshard.api import plan_with_baselines
    from autoshard.planner.explain import block_table, explain_groups, explain_rows

    args.progress(f"loading the graph of {args.model}")
    compile_blocks = {"auto": None, "on": True, "off": False}[args.compile]
    plan, result, baselines, graph, cluster = plan_with_baselines(
        args.model, args.cluster, global_batch=args.global_batch, seq=args.seq, memory_cap=args.memory_cap,
        space=args.space, time_limit_s=args.time_limit, progress=args.progress, attention=args.attention,
        compile=compile_blocks, float8=args.float8 or "")
    from autoshard.planner.offers import float8_blocked_by, float8_offers

    offers = float8_offers(plan, graph, cluster)
    searched = None
    if cluster.gpu.fp8_gemm_speedup and not args.float8 and not plan.float8 and not offers:  # not on this layout
        from autoshard.api import float8_searches

        searched = float8_searches(args.model, graph, cluster, global_batch=plan.global_batch,
                                   memory_cap=args.memory_cap, space=args.space, time_limit_s=args.time_limit,
                                   attention=args.attention, compile=compile_blocks, progress=args.progress)
    args.progress.close()
    plan = dc_replace(plan, baselines=tuple(baselines.values()))
    pred = plan.prediction
    data = {"model": plan.model, "cluster": plan.cluster, "global_batch": plan.global_batch,
            "mesh": plan.mesh.to_json(), "ep": plan.ep, "micro_batch": plan.micro_batch,
            "num_microbatches": plan.num_microbatches,
            "recompute": plan.recompute, "attention": plan.attention, "compile": plan.compile,
            "float8": plan.float8 or "none", "pipeline": {"degree": plan.pipeline.degree,
                                                      "schedule": plan.pipeline.schedule,
                                                      "virtual_stages": plan.pipeline.virtual_stages},
            "predicted": {**_pred_row(pred), **prediction_json(pred)}, "warnings": _warnings(pred, cluster, plan),
            "ops": explain_rows(plan), "layer_groups": explain_groups(plan),
            "baselines": {k: _pred_row(b.prediction) for k, b in baselines.items()},
            "baseline_configs": {k: b.config or b.note for k, b in baselines.items()},
            "solve_time_s": result.solve_time_s,
            "search": {"considered": result.considered, "solved": result.solved,
                       "pruned_by_memory": result.pruned_memory, "optimal": result.optimal,
                       "solver": plan.solver},
            "context_parallel": result.context_parallel, "expert_parallel": result.expert_parallel,
            "float8_offer": offers,
            "float8_search": None if searched is None else {
                recipe: None if p is None else {"tokens_per_s": p.prediction.tokens_per_s, "mesh": p.mesh.to_json(),
                                                "configuration": _config_label(p)}
                for recipe, p in searched.items()},
            "plan_file_json": plan.to_json()}  # `explain` reads this document as it reads a plan file
    if args.plot:  # the picture first: a plot that fails leaves no plan file behind
        from autoshard.plotting import plot_plan

        plot_plan(plan, baselines, cluster, args.plot)
        data["plot"] = args.plot
    if args.output:
        plan.save(args.output)
        data["plan_file"] = args.output
    text = _plan_text(plan, result, baselines, cluster, block_table(plan), args, offers)
    at = next(i for i, line in enumerate(text) if line.startswith("lowering")) + 1
    if searched is not None:
        text[at:at] = _search_offer_text(plan, searched, float8_blocked_by(plan, cluster))
    if args.float8 and not plan.float8:  # the fastest plan is on a layout the runtime trains in 16 bits
        note = (f"asked for float8 ({args.float8}), but the fastest plan uses "
                f"{float8_blocked_by(plan, cluster) or 'a layout on DTensors'}, which the "
                "runtime trains in 16 bits: its GEMMs stay 16-bit; --space dp,zero,pp plans only layouts trained "
                "in float8")
        data["warnings"].append(note)
        text[at:at] = [f"caution          {note}"]
    _emit(args, data, "\n".join(text))
    return 0


def _offer_text(plan, offers: dict[str, float]) -> list[str]:
    if not offers:
        return []
    base = plan.prediction.tokens_per_s
    parts = [f"{recipe} {tps:,.0f} tokens/s ({100 * (tps / base - 1):+.1f}%)" for recipe, tps in offers.items()]
    return ["float8 offer     " + ", ".join(parts) + "; plan with --float8 RECIPE to use it (changes numerics)"]


def _config_label(plan) -> str:
    """A plan's layout in one line, as the baselines' configurations read."""
    from autoshard.planner.explain import batch_label

    pipe = plan.pipeline
    return (f"{plan.mesh}" + (f", {pipe.schedule} x{pipe.virtual_stages}" if pipe.degree > 1 else "")
            + f", micro-batch {batch_label(plan.micro_batch, plan.num_microbatches)}, recompute {plan.recompute}")


def _search_offer_text(plan, searched: dict, blocked: str) -> list[str]:
    """The float8 offer of a plan with no same-layout one (`float8_offers`): the float8 search's plans, and
    `blocked`, what of its layout the runtime does not train in float8 ("" for a context-parallel plan)."""
    base = plan.prediction.tokens_per_s
    head = "float8 offer     " + (f"not on this layout (autoshard's runtime trains float8 without {blocked}); "
                                  if blocked else "")
    if not any(searched.values()):
        return [head + "searched in float8: no plan fits"]
    parts = [f"{recipe}: no plan fits" if p is None else
             f"{recipe} {p.prediction.tokens_per_s:,.0f} tokens/s "
             f"({100 * (p.prediction.tokens_per_s / base - 1):+.1f}%: {_config_label(p)})"
             for recipe, p in searched.items()]
    faster = any(p is not None and p.prediction.tokens_per_s > base for p in searched.values())
    return [head + "searched in float8: " + ", ".join(parts)
            + ("; plan with --float8 RECIPE to use it (changes numerics)" if faster else "; none is faster")]


def _lowering_label(plan) -> str:
    compiled = "blocks torch.compile'd" if plan.compile else "eager"
    return compiled + (f", block Linears in float8 ({plan.float8} scaling)" if plan.float8 else ", 16-bit GEMMs")


def _plan_text(plan, result, baselines, cluster, table, args, offers: dict[str, float]) -> list[str]:
    from autoshard.planner.explain import batch_label, recompute_label

    pred = plan.prediction
    pipe = plan.pipeline
    lines = [f"{plan.model} on {cluster} ({cluster.num_gpus} GPUs), global batch {plan.global_batch}, "
             f"seq {plan.seq}",
             f"mesh             {plan.mesh}" + (f", {pipe.schedule} x{pipe.virtual_stages} over {pipe.degree} stages"
                                               if pipe.degree > 1 else "")
             + (f", experts over ep={plan.ep} of the dp ranks" if plan.ep > 1 else ""),
             f"micro-batch      {batch_label(plan.micro_batch, plan.num_microbatches)}, "
             f"recompute {recompute_label(plan.recompute, plan.attention)}"
             + (", layered gradient accumulation" if pipe.layered else ""),
             f"attention        {_attention_kernel(plan)}",
             f"lowering         {_lowering_label(plan)}",
             *_offer_text(plan, offers),
             *_prediction_text(pred, cluster, plan), "", "strategies per operator:", *("  " + t for t in table), "",
             f"{'':14s}{'tokens/s':>14s}{'MFU':>8s}{'GiB/GPU':>9s}  configuration",
             f"{'plan':14s}{pred.tokens_per_s:14,.0f}{pred.mfu * 100:7.1f}%{pred.memory.total_bytes / 2**30:9.1f}"]
    for name, b in baselines.items():
        if b.prediction is None:
            status = "does not fit" if b.note.startswith("does not fit") else "n/a"
            lines.append(f"{name:14s}{status:>14s}{'':17s}  {b.note.removeprefix('does not fit: ')}")
        else:
            p = b.prediction
            lines.append(f"{name:14s}{p.tokens_per_s:14,.0f}{p.mfu * 100:7.1f}%{p.memory.total_bytes / 2**30:9.1f}"
                         f"  {b.config}")
    if result.context_parallel:
        lines.append(_context_parallel_line(result.context_parallel))
    if result.expert_parallel:
        lines.append(_expert_parallel_line(result.expert_parallel))
    lines.append(f"\nsearch           {result.solve_time_s:.1f} s: {result.solved} ILPs solved of {result.considered} "
                 f"candidates ({result.pruned_memory} pruned by the memory bound; {plan.solver})"
                 + ("" if result.optimal else "; the best found when the time limit hit, not proven optimal"))
    if args.output:
        lines.append(f"plan written to  {args.output}")
    if args.plot:
        lines.append(f"picture written  {args.plot}")
    return lines


def _context_parallel_line(cp: dict) -> str:
    """Why the plan has the cp degree it has: each degree's best step against the best without CP."""
    def step(t):
        return "does not fit" if t is None else f"{t:.3f} s"

    tried = ", ".join(f"cp={c}: {step(t)}" for c, t in cp["by_cp_s"].items())
    without = step(cp["without_cp_s"])
    verdict = (f"cp={cp['chosen_cp']} chosen" if cp["chosen_cp"] > 1 else "not chosen")
    return f"context parallel {verdict}: best step {tried}; without CP {without} (data parallel and ZeRO around CP)"


def _expert_parallel_line(ep: dict) -> str:
    """Why the plan has the ep degree it has: each degree's best step against the best without EP."""
    def step(t):
        return "does not fit" if t is None else f"{t:.3f} s"

    tried = ", ".join(f"ep={e}: {step(t)}" for e, t in ep["by_ep_s"].items())
    verdict = f"ep={ep['chosen_ep']} chosen" if ep["chosen_ep"] > 1 else "not chosen"
    return f"expert parallel {verdict}: best step {tried}; without EP {step(ep['without_ep_s'])}"


def _cluster_or_none(text: str):
    """The plan's cluster for drawing capacity and nodes, if it still parses (a YAML file may be gone)."""
    from autoshard.hardware_profiles import ClusterSpec

    try:
        return ClusterSpec.parse(text)
    except AutoshardError:
        return None


def _cmd_explain(args) -> int:
    from autoshard.planner.explain import explain_groups, explain_rows, explain_text
    from autoshard.plans.plan import Plan

    plan = Plan.load(args.plan)
    shown = {"layer": args.layer, "op": args.op}
    text = explain_text(plan, **shown)  # an unknown layer or a pattern matching nothing: one line, exit 2
    data = {"model": plan.model, "cluster": plan.cluster, "mesh": plan.mesh.to_json(),
            "micro_batch": plan.micro_batch, "num_microbatches": plan.num_microbatches,
            "layer_groups": explain_groups(plan, **shown), "ops": explain_rows(plan, **shown)}
    if args.plot:
        from autoshard.plotting import plot_plan

        plot_plan(plan, {b.name: b for b in plan.baselines}, _cluster_or_none(plan.cluster), args.plot)
        data["plot"] = args.plot
    _emit(args, data, text + (f"\npicture written to {args.plot}" if args.plot else ""))
    return 0


def _cmd_check(args) -> int:
    from autoshard.check import check_plan

    args.progress(f"re-planning {args.model} against {args.against}")
    result = check_plan(args.model, args.against, tolerance=args.tolerance, memory_cap=args.memory_cap,
                        time_limit_s=args.time_limit, progress=args.progress)
    args.progress.close()
    _emit(args, result.to_json(), "\n".join(result.lines()))
    return 0 if result.ok else 1


def _cmd_hardware(args) -> int:
    from autoshard.hardware_profiles import hardware_table

    table = hardware_table()
    lines = [f"{'GPU':16s}{'bf16 TF':>9s}{'GEMM TF':>9s}{'HBM GB/s':>10s}{'GiB':>8s}  default node"]
    for g in table["gpus"]:
        lines.append(f"{g['name']:16s}{g['peak_tflops']:9.1f}{g['gemm_tflops_sustained']:9.1f}{g['hbm_gbps']:10.0f}"
                     f"{g['memory_gib']:8.1f}  "
                     f"{g.get('gpus_per_node', '')} per node, {g.get('intra_node', '')} + {g.get('inter_node', '')}")
    lines.append(f"\n{'link':18s}{'scope':>7s}{'all-reduce GB/s':>17s}{'latency us':>12s}")
    for lk in table["links"]:
        lines.append(f"{lk['name']:18s}{lk['scope']:>7s}{lk['all_reduce_busbw_gbps']:17.1f}{lk['latency_us']:12.1f}")
    lines.append("\nbf16 TF: datasheet dense peak; GEMM TF: the best large GEMM at the clock a GPU sustains at its "
                 "power limit (what estimates use)")
    _emit(args, table, "\n".join(lines))
    return 0


def _cmd_profile(args) -> int:
    from autoshard.cli_runtime import profile_command

    return profile_command(args, _emit)


def _cmd_measure(args) -> int:
    from autoshard.cli_runtime import measure_command

    return measure_command(args, _emit)


# -- argument checks: every one before any capture or search (issue 17) ----------------------------------------
# messages name the Python parameters (autoshard.errors); `_cli_message` turns them into these flags
_FLAGS = {"time_limit_s": "--time-limit", "output": "-o/--output", "path": "--plot"}


def _flag(param: str) -> str:
    return _FLAGS.get(param, "--" + param.replace("_", "-"))


def _cli_message(exc: AutoshardError) -> str:
    """The error's one line with each Python parameter it names written as the CLI flag (`global_batch=8` ->
    `--global-batch 8`, `global_batch` -> `--global-batch`)."""
    import re

    text = " ".join(str(exc).split())  # one line, whatever the message
    for param in getattr(exc, "params", ()):
        text = re.sub(rf"(?<![\w-]){re.escape(param)}=", _flag(param) + " ", text)
        text = re.sub(rf"(?<![\w-]){re.escape(param)}\b", _flag(param), text)
    return text


def _prepare_output(path: str, param: str) -> None:
    """Every file-writing option: create the file's directory (like mkdir -p) before any work, or fail now."""
    from pathlib import Path

    from autoshard.errors import ConfigurationError

    target = Path(path).expanduser()
    parent = target.parent
    if target.is_dir():
        raise ConfigurationError(f"{param}={path!r} is a directory; give a file name", params=(param,))
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(f"{param}={path!r}: cannot create directory {parent} ({exc.strerror or exc}); "
                                 "give a path in a writable directory", params=(param,)) from None
    if not os.access(parent, os.W_OK):
        raise ConfigurationError(f"{param}={path!r}: directory {parent} is not writable; give a path in a "
                                 "writable directory", params=(param,))


def _check_plot(path: str) -> None:
    """A PNG path in a writable directory (created now), and matplotlib to draw it: in that order, so a bad path
    is reported as such on a machine without matplotlib too."""
    import importlib.util

    from autoshard.errors import ConfigurationError

    if not path.lower().endswith(".png"):
        raise ConfigurationError(f"path={path!r}: only PNG is written; give a file name ending in .png",
                                 params=("path",))
    _prepare_output(path, "path")
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigurationError("path needs matplotlib: pip install 'autoshard[plot]'", params=("path",))


def _check_args(args) -> None:
    """Checks that need no model: sizes, the cluster, the search space and output paths."""
    from autoshard.errors import require_positive

    ints = {"inspect": ("seq", "batch"), "estimate": ("tp", "pp", "dp", "cp", "ep", "micro_batch", "global_batch",
                                                      "seq", "virtual_stages"), "plan": ("global_batch", "seq")}
    for name in ints.get(args.command, ()):
        if getattr(args, name) is not None:
            require_positive(name, getattr(args, name))
    if args.command == "check":
        from autoshard.check import parse_tolerance

        parse_tolerance(args.tolerance)
        require_positive("time_limit_s", args.time_limit, integer=False, unit=" of seconds")
        if args.memory_cap is not None:
            require_positive("memory_cap", args.memory_cap, integer=False, unit=" of GiB")
    if args.command == "plan":
        if args.memory_cap is not None:
            require_positive("memory_cap", args.memory_cap, integer=False, unit=" of GiB")
        require_positive("time_limit_s", args.time_limit, integer=False, unit=" of seconds")
        from autoshard.planner.search import parse_space

        parse_space(args.space)
    if args.command in ("plan", "estimate"):
        from autoshard.hardware_profiles import ClusterSpec

        ClusterSpec.parse(args.cluster)
    if getattr(args, "plot", None):
        _check_plot(args.plot)
    if args.command == "estimate" and args.output:
        other = [flag for flag, on in (("--fused-kernels", args.fused_kernels), ("--fused-loss", args.fused_loss),
                                       ("--loss-parallel", args.loss_parallel),
                                       ("--zero-impl", args.zero_impl != "fsdp2"),
                                       ("--cp-attention ring", args.cp_attention == "ring"),
                                       ("--tp-comm-overlap", bool(args.tp_comm_overlap)),
                                       # torchtitan's float8 tensor parallelism; the runtime refuses the plan
                                       ("--float8 with --tp", bool(args.float8) and args.tp > 1),
                                       ("--float8 with --ep", bool(args.float8) and args.ep > 1)) if on]
        if other:  # measure compares a run of the runtime with the plan's prediction: it must be the runtime's
            from autoshard.errors import ConfigurationError

            raise ConfigurationError(
                f"-o writes a plan for autoshard's runtime, which does not run what {', '.join(other)} prices "
                "(another engine); drop them to write the plan, or drop -o to predict that engine",
                params=("output",))
    if args.command in ("plan", "estimate", "profile") and args.output:
        _prepare_output(args.output, "output")
    if args.command == "measure" and args.trace:
        _prepare_output(args.trace, "trace")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2), like every other user error."""

    def error(self, message: str):  # noqa: D401 - argparse API
        print(f"{self.prog}: error: {message}; see `{self.prog} --help`", file=sys.stderr)
        raise SystemExit(2)


_SEQ_HELP = "tokens per sample (default: the model's; for a module:factory model, its token-id inputs' length)"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="autoshard", description="Auto-parallelization planner for PyTorch training.")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    m = sub.add_parser("models", help="list the model zoo")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=_cmd_models)

    i = sub.add_parser("inspect", help="capture a model and print its operator graph summary")
    i.add_argument("model", help="zoo name, spec string (gpt:layers=..,hidden=..,heads=..,seq=..) or module:factory")
    i.add_argument("--no-cache", action="store_true",
                   help="capture the model again instead of reading the graph cache (~/.cache/autoshard)")
    i.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    i.add_argument("--batch", type=int, default=1, help="batch size the per-sample figures are scaled to")
    i.add_argument("--quiet", action="store_true", help="no progress on stderr (shown only on a terminal)")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_cmd_inspect)

    e = sub.add_parser("estimate", help="predict a hand-given Megatron/DeepSpeed-style configuration")
    e.add_argument("model")
    e.add_argument("--no-cache", action="store_true",
                   help="capture the model again instead of reading the graph cache (~/.cache/autoshard)")
    e.add_argument("--cluster", required=True, help="NODESxGPUSxGPU[@NETWORK] or a cluster YAML file")
    e.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (Megatron 1D)")
    e.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    e.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: GPUs / (tp x pp x cp))")
    e.add_argument("--cp", type=int, default=1,
                   help="context-parallel degree: each sequence's tokens over cp ranks, two of 2 x cp chunks per "
                        "rank (head-tail, for a causal mask's balance); everything but attention runs on the "
                        "rank's tokens, attention gathers the keys and values of the others")
    e.add_argument("--cp-attention", choices=("allgather", "ring"), default="allgather",
                   help="how context-parallel attention gets the other ranks' keys and values: allgather (K/V "
                        "all-gathered before, their gradients reduce-scattered after; Llama 3, and what "
                        "autoshard's runtime runs) or ring (passed around the cp ranks beside the attention "
                        "blocks: ring attention, torch's SDPA context_parallel, Megatron-Core)")
    e.add_argument("--ep", type=int, default=1,
                   help="expert-parallel degree (mixture-of-experts models): each MoE layer's experts over ep of "
                        "the dp ranks (a divisor of dp, no GPUs of its own), tokens dispatched and combined by "
                        "all-to-all")
    e.add_argument("--ep-imbalance", type=float, default=None,
                   help="the busiest ep rank's routed rows over the mean (a measured max / mean); default: the "
                        "cost model's, from the experts per rank (1.25 for one of 8)")
    e.add_argument("--micro-batch", type=int, default=1)
    e.add_argument("--global-batch", type=int, required=True)
    e.add_argument("--seq", type=int, default=None, help=_SEQ_HELP)
    e.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                   help="activation recompute: full (every block's forward again in backward); selective: with "
                        "eager attention the score tensors (Korthikanti et al.), with a fused attention kernel "
                        "torchtitan's op-level policy (attention and every other matmul kept), which is what "
                        "autoshard's runtime runs; Megatron's selective on a fused kernel costs about none")
    e.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="tokens sharded over the tensor-parallel ranks between the matmuls (Korthikanti et al. "
                        "2022); on by default with --tp-comm-overlap all, which overlaps its collectives")
    e.add_argument("--virtual-stages", type=int, default=1, help="model chunks per pipeline rank")
    e.add_argument("--schedule", choices=("1f1b", "interleaved-1f1b", "gpipe", "looped-bfs"), default=None)
    e.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage over dp")
    e.add_argument("--attention", choices=("auto", "eager", "flash", "sdpa"), default="auto",
                   help="attention kernel: flash (FlashAttention-2, as PyTorch SDPA, Megatron-Core, torchtitan), "
                        "eager (materialized scores: Megatron-LM before flash attention), sdpa (HF masked SDPA); "
                        "auto = flash unless the model spec names one (attn=)")
    e.add_argument("--fused-kernels", action="store_true",
                   help="Megatron's engine: each pointwise region as one fused kernel (Megatron-LM's fused "
                        "kernels, torch.compile) that keeps only its inputs for backward, a fused Adam, and "
                        "gradients summed into the fp32 main_grad inside the weight-gradient GEMM (gradient "
                        "accumulation fusion), and under --sequence-parallel each column-parallel Linear gathering "
                        "its input shard itself, again in backward; default: one kernel per ATen op, each keeping what its derivative "
                        "needs, torch's AdamW and autograd's gradient adds, as eager PyTorch runs them")
    e.add_argument("--fused-loss", action="store_true",
                   help="price the cross-entropy as one kernel each way over the 16-bit logits, which keeps them "
                        "and writes a 16-bit gradient (flash-attn's CrossEntropyLoss, llm-foundry's default); "
                        "default: torch's cross_entropy on fp32-upcast logits, three fp32 logit-sized buffers at "
                        "the start of backward, as torchtitan and autoshard's runtime run it")
    e.add_argument("--loss-parallel", action="store_true",
                   help="price the cross-entropy on each tensor-parallel rank's vocabulary shard of the head's "
                        "output, three fp32 all-reduces per token instead of gathering the logits (Megatron-LM's "
                        "vocab_parallel_cross_entropy, torchtitan's loss_parallel under TP); default: the outputs "
                        "gathered whole for the loss on every rank, as autoshard's runtime hands them to the caller")
    e.add_argument("--zero-impl", choices=ZERO_IMPLS, default="fsdp2",
                   help="how --zero 3 gathers parameters: fsdp2 (one gather per block, prefetched beside compute: "
                        "autoshard's runtime, torchtitan, FSDP, DeepSpeed since late 2021) or deepspeed-2021 "
                        "(DeepSpeed's ZeRO-3 before its mid-2021 rewrite: one gather per submodule, each waited "
                        "for, again for recompute, at ~24 GB/s per GPU; DeepSpeed PR #1188, issue #1174)")
    e.add_argument("--tp-comm-overlap", nargs="?", const="all", default="", choices=("backward", "all"),
                   help="tensor-parallel collectives overlap compute, as autoshard's runtime does not (plans never "
                        "assume it): 'all' (the default when given), each collective pipelined with the GEMM it feeds or "
                        "is fed by, as Megatron-Core's --tp-comm-overlap and torchtitan's async TP (both with "
                        "sequence parallelism, which it turns on); "
                        "'backward': each linear's input-gradient collective runs beside its weight-gradient GEMM, "
                        "as Megatron-LM's asynchronous tensor-parallel communication (2022 on)")
    e.add_argument("--compile", action="store_true",
                   help="every repeated block torch.compile'd (torchtitan's --compile, autoparallel(compile=True)): "
                        "its pointwise ops as fused kernels keeping only what backward needs, the host issuing one "
                        "compiled graph per block and phase instead of every ATen op")
    e.add_argument("--float8", choices=("tensorwise", "rowwise"), default=None,
                   help="the block Linears in float8 (torchao Float8Linear, torchtitan's float8 converter): fp8 "
                        "GEMMs plus the casts and amax reductions; tensorwise also gathers FSDP2 weights in float8. "
                        "H100/H200 only; pair with --compile, which fuses the casts")
    e.add_argument("--allocator", choices=("expandable", "caching"), default="expandable",
                   help="PyTorch CUDA allocator mode: expandable (expandable_segments:True, as torchtitan and "
                        "autoshard's runtime run) or caching (PyTorch's default: ~15%% of per-step memory "
                        "fragmented, GMLake)")
    e.add_argument("-o", "--output", default=None, help="write the configuration as a plan file (for measure)")
    e.add_argument("--quiet", action="store_true", help="no progress on stderr (shown only on a terminal)")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=_cmd_estimate)

    pl = sub.add_parser("plan", help="dry run: the fastest plan for MODEL on a cluster, with baselines")
    pl.add_argument("model")
    pl.add_argument("--no-cache", action="store_true",
                    help="capture the model again instead of reading the graph cache (~/.cache/autoshard)")
    pl.add_argument("--cluster", required=True, help="NODESxGPUSxGPU[@NETWORK] or a cluster YAML file")
    pl.add_argument("--global-batch", type=int, default=None, help="samples per iteration (default 4 per GPU)")
    pl.add_argument("--seq", type=int, default=None, help=_SEQ_HELP)
    pl.add_argument("--memory-cap", type=float, default=None, help="GiB per GPU (default: the GPU's memory)")
    pl.add_argument("--space", default=None,
                    help="families searched: dp,zero,tp1d,tp2d,tp3d,pp,cp,ep (default all; cp from 32,768 tokens "
                         "per sequence, for models given by name, spec or factory; ep for mixture-of-experts "
                         "models)")
    pl.add_argument("--attention", choices=("auto", "eager", "flash", "sdpa"), default="auto",
                    help="attention kernel priced for zoo and spec models (default auto: flash for decoders, "
                         "the model's own otherwise)")
    pl.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                    help="torch.compile every repeated block where the runtime can (all plans but context or "
                         "expert parallelism with tensor parallelism): auto (default) on GPU clusters, off on CPU "
                         "ranks; priced as fused kernels and a host cost per compiled graph")
    pl.add_argument("--float8", choices=("tensorwise", "rowwise"), default=None,
                    help="train the block Linears in float8 (torchao; H100/H200 clusters only) where the runtime "
                         "can (plans without tensor or expert parallelism); default: 16-bit")
    pl.add_argument("--time-limit", type=float, default=20.0, help="seconds per ILP solve")
    pl.add_argument("-o", "--output", default=None, help="write the plan as versioned JSON")
    pl.add_argument("--plot", default=None, help="write a picture of the plan (PNG)")
    pl.add_argument("--quiet", action="store_true", help="no progress on stderr (shown only on a terminal)")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=_cmd_plan)

    x = sub.add_parser("explain", help="why each operator got its strategy, and the runner-up")
    x.add_argument("plan", help="a plan file written by `autoshard plan -o`, or what `autoshard plan --json` printed")
    x.add_argument("--layer", type=int, default=None, help="only the operators of layer N")
    x.add_argument("--op", default=None, metavar="PATTERN",
                   help="only operators whose name contains PATTERN or matches it as a glob (fnmatch), "
                        "e.g. 'mlp' or '*.attn.*proj'")
    x.add_argument("--plot", default=None, help="write a picture of the plan (PNG)")
    x.add_argument("--json", action="store_true")
    x.set_defaults(func=_cmd_explain)

    pr = sub.add_parser("profile", help="under torchrun: measure GEMMs, kernels and collectives on this job's ranks "
                                        "and write a cluster file for --cluster")
    pr.add_argument("-o", "--output", required=True, help="the cluster YAML to write")
    pr.add_argument("--quick", action="store_true", help="fewer shapes and sizes (under a minute on CPU ranks)")
    pr.add_argument("--rounds", type=int, default=1,
                    help="measure everything this many times and write the median of each number (a shared or "
                         "busy machine: 3)")
    pr.add_argument("--cpu", action="store_true", help="profile CPU ranks (gloo) even if CUDA is available")
    pr.add_argument("--quiet", action="store_true", help="no progress on stderr (shown only on a terminal)")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=_cmd_profile)

    ms = sub.add_parser("measure", help="under torchrun: run a plan file on this job's ranks, time its steps, "
                                        "compare with the prediction")
    ms.add_argument("plan", help="a plan file (`autoshard plan -o`, `autoshard estimate -o`)")
    ms.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    ms.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ms.add_argument("--cluster", default=None, help="cluster of this job (default: the plan's)")
    ms.add_argument("--trace", default=None, metavar="FILE",
                    help="after the timed steps, profile one more with torch.profiler and write its summary (JSON: "
                         "how busy the device was, the top ops by host time and kernels by device time) to FILE")
    ms.add_argument("--quiet", action="store_true", help="no progress on stderr (shown only on a terminal)")
    ms.add_argument("--json", action="store_true")
    ms.set_defaults(func=_cmd_measure)

    c = sub.add_parser("check", help="for CI: re-plan MODEL on a committed plan's cluster, batch and sequence "
                                     "and fail (exit 1) if it got slower, needs more memory or no longer fits")
    c.add_argument("model", help="the model as it is now (zoo name, spec or module:factory)")
    c.add_argument("--against", required=True, help="the committed plan file (`autoshard plan -o`)")
    c.add_argument("--tolerance", default="2%", help="allowed throughput drop / memory growth (default 2%%)")
    c.add_argument("--memory-cap", type=float, default=None, help="GiB per GPU (default: the GPU's memory)")
    c.add_argument("--time-limit", type=float, default=20.0, help="seconds per ILP solve")
    c.add_argument("--no-cache", action="store_true",
                   help="capture the model again instead of reading the graph cache (~/.cache/autoshard)")
    c.add_argument("--quiet", action="store_true", help="no progress on stderr (shown only on a terminal)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=_cmd_check)

    h = sub.add_parser("hardware", help="list the GPU and interconnect profiles")
    h.add_argument("--json", action="store_true")
    h.set_defaults(func=_cmd_hardware)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s",
                        stream=sys.stderr)
    # an installed torchao that transformers imports logs its unloadable CUDA kernels (and torch its pytree
    # registrations) on every command: noise for a CLI whose errors are one line
    for noisy in ("torchao", "torch.utils._pytree"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if getattr(args, "no_cache", False):
        os.environ["AUTOSHARD_NO_CACHE"] = "1"  # read by autoshard.capture.disk_cache
    from autoshard.progress import Progress

    # progress on stderr while the command runs (capture, search, profile, measure): a terminal only
    args.progress = Progress(enabled=not (getattr(args, "json", False) or getattr(args, "quiet", False)))
    try:
        _check_args(args)
        return args.func(args)
    except AutoshardError as exc:
        args.progress.close()
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank raises it: rank 0 says it once
            print(f"autoshard: error: {_cli_message(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        args.progress.close()
        print("autoshard: interrupted", file=sys.stderr)
        return 130
    finally:
        args.progress.close()


if __name__ == "__main__":
    sys.exit(main())
