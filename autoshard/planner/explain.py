"""`autoshard explain plan.json`: why each operator got its strategy, and what it would have cost otherwise."""

from __future__ import annotations

from autoshard.planner.plan import OpPlan, Plan

__all__ = ["explain_rows", "explain_text", "block_table"]


def _label(p: OpPlan) -> str:
    st = p.strategy
    extra = (f" zero{st.zero}" if st.zero else "") + (f" split{st.split}" if st.split > 1 else "")
    return st.name + extra


def _representatives(plan: Plan) -> list[OpPlan]:
    """One row per op of the first block (every block is the same) and each op outside blocks."""
    first_layer = min((p.layer for p in plan.ops if p.layer is not None), default=None)
    return [p for p in plan.ops if p.layer is None or p.layer == first_layer]


def explain_rows(plan: Plan) -> list[dict]:
    rows = []
    for p in _representatives(plan):
        st = p.strategy
        rows.append({
            "op": p.op, "kind": p.kind, "layer": p.layer, "strategy": _label(p),
            "inputs": [str(x) for x in st.inputs], "output": str(st.output),
            "params": {pp.name: {"compute": str(pp.compute), "storage": str(pp.storage)} for pp in st.params},
            "time_ms": p.time_s * 1e3, "state_gib": p.memory_bytes / 2**30,
            "runner_up": p.runner_up,
            "runner_up_time_ms": None if p.runner_up_time_s is None else p.runner_up_time_s * 1e3,
            "runner_up_state_gib": None if p.runner_up_memory_bytes is None else p.runner_up_memory_bytes / 2**30,
            "why": _why(p),
        })
    return rows


def _why(p: OpPlan) -> str:
    if p.runner_up is None:
        return "only candidate"
    dt = (p.runner_up_time_s or 0.0) - p.time_s
    dm = (p.runner_up_memory_bytes or 0.0) - p.memory_bytes
    if dt > 1e-9:
        return f"{dt * 1e3:.3f} ms faster per micro-batch than {p.runner_up}"
    if dm > 0:
        return f"{dm / 2**30:.2f} GiB less state than {p.runner_up} (memory cap)"
    if dt < -1e-9:
        return (f"{p.runner_up} would save {-dt * 1e3:.3f} ms here, but not on the step: this op is off the "
                "slowest pipeline stage or its time is hidden")
    return f"ties with {p.runner_up}"


def block_table(plan: Plan) -> list[str]:
    """Per-block summary lines: op, strategy, layouts."""
    lines = [f"{'operator':46s} {'strategy':18s} {'input':26s} {'output':26s}"]
    for p in _representatives(plan):
        st = p.strategy
        inp = str(st.inputs[0]) if st.inputs else "-"
        lines.append(f"{p.op[-46:]:46s} {_label(p):18s} {inp[:26]:26s} {str(st.output)[:26]:26s}")
    return lines


def explain_text(plan: Plan) -> str:
    out = [f"{plan.model} on {plan.cluster}: mesh {plan.mesh}, micro-batch {plan.micro_batch}, recompute "
           f"{plan.recompute}" + (f", pipeline {plan.pipeline.degree} x {plan.pipeline.schedule}"
                                  if plan.pipeline.degree > 1 else ""), ""]
    out.append(f"{'operator':44s} {'chosen':16s} {'ms':>8s}  {'runner-up':20s} {'ms':>8s}  why")
    for r in explain_rows(plan):
        ru = r["runner_up"] or "-"
        rut = f"{r['runner_up_time_ms']:.3f}" if r["runner_up_time_ms"] is not None else "-"
        out.append(f"{r['op'][-44:]:44s} {r['strategy']:16s} {r['time_ms']:8.3f}  {ru[:20]:20s} {rut:>8s}  {r['why']}")
    return "\n".join(out)
