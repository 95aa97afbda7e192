"""`autoshard explain plan.json`: why each operator got its strategy, and what it would have cost otherwise.

Every layer is covered: layers whose operators got the same strategies, position by position (names compared
with the layer index replaced by `*`), are folded into one group and the output says which layers it stands
for; operators outside layers (embeddings, head) are shown once. Names are printed whole, never cut.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace

from autoshard.errors import PlanFileError
from autoshard.plans.plan import OpPlan, Plan

__all__ = ["LayerGroup", "batch_label", "block_table", "explain_groups", "explain_rows", "explain_text",
           "layer_groups", "layer_pattern"]


@dataclass(frozen=True, kw_only=True)
class LayerGroup:
    """Ops shown together: `layers` they stand for (empty: ops outside layers) and the first layer's ops."""

    layers: tuple[int, ...]
    ops: tuple[OpPlan, ...]

    @property
    def title(self) -> str:
        if not self.layers:
            return "outside layers"
        n = len(self.layers)
        if n == 1:
            return f"layer {self.layers[0]} (1 layer)"
        return f"layers {_ranges(self.layers)} ({n} layers, same choices)"


def batch_label(micro_batch: int, num_microbatches: int) -> str:
    """`1 sample x 64 micro-batches per replica`: says which number is the size and which the count."""
    return (f"{micro_batch} sample{'' if micro_batch == 1 else 's'} x {num_microbatches} "
            f"micro-batch{'' if num_microbatches == 1 else 'es'} per replica")


def recompute_label(recompute: str, attention: str) -> str:
    """The recompute mode and, for selective, what it recomputes on this attention kernel (runtime/recompute.py):
    with materialized scores (eager) Korthikanti et al.'s selective recompute; with a fused kernel torchtitan's
    op-level policy, which is not Megatron's (on a fused kernel, Megatron's selective recompute repeats only the
    attention kernel, about `none`'s cost)."""
    if recompute != "selective":
        return recompute
    if attention == "eager":
        return "selective (attention scores recomputed, Korthikanti et al.)"
    if attention in ("flash", "masked"):
        return "selective (torchtitan's op-level policy: attention and every other matmul kept)"
    return recompute


def layer_pattern(p: OpPlan) -> str:
    """The name with its layer index as `*`: `model.layers.3.mlp.up_proj` -> `model.layers.*.mlp.up_proj`.
    The index is the outermost numeric component equal to `p.layer` (capture/blocks.py numbers blocks so)."""
    if p.layer is None:
        return p.op
    parts = p.op.split(".")
    if str(p.layer) in parts:
        parts[parts.index(str(p.layer))] = "*"
    return ".".join(parts)


def _ranges(layers: tuple[int, ...]) -> str:
    """(0, 1, 2, 3, 8) -> '0-3, 8'."""
    spans: list[list[int]] = []
    for i in sorted(layers):
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _signature(ops: list[OpPlan]) -> tuple:
    """What must be equal for two layers to fold: per op position, the layer-free name and the strategy (its
    parameters by placement; their names carry the layer index)."""
    return tuple((layer_pattern(p), replace(p.strategy, params=tuple(replace(pp, name="") for pp in p.strategy.params)))
                 for p in ops)


def layer_groups(plan: Plan, *, layer: int | None = None) -> list[LayerGroup]:
    """Ops outside layers before the first layer, one group per distinct set of layer choices (in order of
    first layer), then the remaining ops outside layers. `layer`: only that layer's ops, as one group."""
    by_layer: dict[int, list[OpPlan]] = {}
    before: list[OpPlan] = []
    after: list[OpPlan] = []
    for p in plan.ops:
        if p.layer is not None:
            by_layer.setdefault(p.layer, []).append(p)
        else:
            (after if by_layer else before).append(p)
    if layer is not None:
        if layer not in by_layer:
            have = f"layers {_ranges(tuple(by_layer))}" if by_layer else "no layers"
            raise PlanFileError(f"layer {layer} is not in the plan of {plan.model}: it has {have}")
        return [LayerGroup(layers=(layer,), ops=tuple(by_layer[layer]))]
    folded: dict[tuple, list[int]] = {}
    for i in sorted(by_layer):
        folded.setdefault(_signature(by_layer[i]), []).append(i)
    groups = [LayerGroup(layers=tuple(ls), ops=tuple(by_layer[ls[0]])) for ls in folded.values()]
    outside = [LayerGroup(layers=(), ops=tuple(ops)) for ops in (before, after) if ops]
    return outside[:1] + groups + outside[1:] if before else groups + outside


def _matches(p: OpPlan, pattern: str) -> bool:
    names = (p.op, layer_pattern(p))
    return any(pattern in n or fnmatch.fnmatchcase(n, f"*{pattern}*") for n in names)


def _selected(plan: Plan, *, layer: int | None, op: str | None) -> list[LayerGroup]:
    groups = layer_groups(plan, layer=layer)
    if op is not None:
        groups = [LayerGroup(layers=g.layers, ops=tuple(p for p in g.ops if _matches(p, op))) for g in groups]
        groups = [g for g in groups if g.ops]
        if not groups:
            raise PlanFileError(f"no operator of the plan of {plan.model} matches {op!r} (a substring or an "
                                f"fnmatch pattern of names like {plan.ops[0].op if plan.ops else 'model.x'!r})")
    return groups


def _display_name(p: OpPlan, g: LayerGroup) -> str:
    """Folded groups show the layer-free name; a single layer shows the real one."""
    return p.op if len(g.layers) <= 1 else layer_pattern(p)


def _label(p: OpPlan) -> str:
    st = p.strategy
    extra = (f" zero{st.zero}" if st.zero else "") + (f" split{st.split}" if st.split > 1 else "")
    return st.name + extra


def _row(p: OpPlan, g: LayerGroup) -> dict:
    st = p.strategy
    return {
        "op": p.op, "name": _display_name(p, g), "kind": p.kind, "layer": p.layer,
        "layers": list(g.layers) if g.layers else None, "strategy": _label(p),
        "inputs": [str(x) for x in st.inputs], "output": str(st.output),
        "params": {pp.name: {"compute": str(pp.compute), "storage": str(pp.storage)} for pp in st.params},
        "time_ms": p.time_s * 1e3, "state_gib": p.memory_bytes / 2**30,
        "runner_up": p.runner_up,
        "runner_up_time_ms": None if p.runner_up_time_s is None else p.runner_up_time_s * 1e3,
        "runner_up_state_gib": None if p.runner_up_memory_bytes is None else p.runner_up_memory_bytes / 2**30,
        "why": _why(p),
    }


def explain_rows(plan: Plan, *, layer: int | None = None, op: str | None = None) -> list[dict]:
    """One row per op shown: ops outside layers once, each group of identical layers once (`layers` says
    which it stands for; `op` is the first layer's real name, `name` the one printed)."""
    return [_row(p, g) for g in _selected(plan, layer=layer, op=op) for p in g.ops]


def explain_groups(plan: Plan, *, layer: int | None = None, op: str | None = None) -> list[dict]:
    """The groups shown, for `--json`: title, layers (empty: outside layers) and the names in each."""
    return [{"title": g.title, "layers": list(g.layers), "num_layers": len(g.layers),
             "ops": [_display_name(p, g) for p in g.ops]} for g in _selected(plan, layer=layer, op=op)]


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


def _coverage(plan: Plan, *, layer: int | None = None, op: str | None = None) -> str:
    """One line saying what the table covers, so that nothing is left out silently."""
    groups = [g for g in layer_groups(plan) if g.layers]
    num_layers = sum(len(g.layers) for g in groups)
    line = (f"{num_layers} layers in {len(groups)} group{'' if len(groups) == 1 else 's'} of identical choices; "
            "ops outside layers shown once" if groups else "no repeated layers: every op shown")
    filters = ([f"layer {layer}"] if layer is not None else []) + ([f"ops matching {op!r}"] if op is not None else [])
    return line + (f"; shown: only {' and '.join(filters)}" if filters else "")


def block_table(plan: Plan) -> list[str]:
    """Per-group summary lines: op, strategy, input and output layouts, every layer covered."""
    groups = layer_groups(plan)
    cells = {id(g): [(_display_name(p, g), _label(p), str(p.strategy.inputs[0]) if p.strategy.inputs else "-",
                      str(p.strategy.output)) for p in g.ops] for g in groups}
    every = [c for rows in cells.values() for c in rows]
    wn = max([len("operator")] + [len(c[0]) + 2 for c in every])  # + 2: names are indented under their group
    ws = max([len("strategy")] + [len(c[1]) for c in every])
    wi = max([len("input")] + [len(c[2]) for c in every])
    lines = [_coverage(plan), f"{'operator':{wn}s} {'strategy':{ws}s} {'input':{wi}s} output"]
    for g in groups:
        lines.append(f"{g.title}:")
        lines += [f"  {name:{wn - 2}s} {label:{ws}s} {inp:{wi}s} {out}" for name, label, inp, out in cells[id(g)]]
    return lines


def explain_text(plan: Plan, *, layer: int | None = None, op: str | None = None) -> str:
    """The table `autoshard explain` prints: a header, what is covered, then each group's ops."""
    head = (f"{plan.model} on {plan.cluster}: mesh {plan.mesh}, micro-batch "
            f"{batch_label(plan.micro_batch, plan.num_microbatches)}, "
            f"recompute {recompute_label(plan.recompute, plan.attention)}"
            + (f", pipeline {plan.pipeline.degree} x {plan.pipeline.schedule}" if plan.pipeline.degree > 1 else ""))
    cp = plan.mesh.degree("cp")
    if cp > 1 and plan.seq:
        head += (f"\ncontext parallel {cp}: each sequence's {plan.seq:,} tokens over {cp} ranks ({plan.seq // cp:,} "
                 f"each, two head-tail chunks); attention all-gathers the keys and values of the other ranks, and "
                 f"the operators below see one rank's tokens, their 'dp' meaning dp x cp")
    if plan.ep > 1:
        dp = plan.mesh.degree("dp")
        head += (f"\nexpert parallel {plan.ep}: each MoE layer's experts over {plan.ep} of the {dp} data-parallel "
                 f"ranks, tokens dispatched to their experts and combined back by all-to-all (4 per layer and "
                 f"micro-batch); an expert op's zero level applies over the {dp // plan.ep} rank(s) holding the same "
                 f"experts, and its time includes the all-to-alls and the busiest rank's share of the routed rows"
                 + ("; the experts and router run replicated on the tensor-parallel axes, the ep group being the "
                    "ranks at one tensor-parallel position" if plan.mesh.tp_axes else ""))
    groups = _selected(plan, layer=layer, op=op)
    rows = {id(g): [_row(p, g) for p in g.ops] for g in groups}
    every = [r for rs in rows.values() for r in rs]
    wn = max([len("operator")] + [len(r["name"]) + 2 for r in every])  # + 2: names are indented under their group
    ws = max([len("chosen")] + [len(r["strategy"]) for r in every])
    wr = max([len("runner-up")] + [len(r["runner_up"] or "-") for r in every])
    out = [head, _coverage(plan, layer=layer, op=op), "",
           f"{'operator':{wn}s} {'chosen':{ws}s} {'ms':>8s}  {'runner-up':{wr}s} {'ms':>8s}  why"]
    for g in groups:
        out.append(f"{g.title}:")
        for r in rows[id(g)]:
            rut = f"{r['runner_up_time_ms']:.3f}" if r["runner_up_time_ms"] is not None else "-"
            out.append(f"  {r['name']:{wn - 2}s} {r['strategy']:{ws}s} {r['time_ms']:8.3f}  "
                       f"{r['runner_up'] or '-':{wr}s} {rut:>8s}  {r['why']}")
    return "\n".join(out)
