"""What the runtime does around each module call, read off a plan (which names each op's producers).

The runtime acts at *leaf-module* granularity: an op whose whole computation is one call of a leaf module
(Linear, Conv1D, Embedding, a norm, Dropout, an activation module) gets a `ModuleSpec`: the layouts its
activation inputs are redistributed to before the call, the layout its output is sent to afterwards, and
the placements of its parameters. Ops inside a module's own forward (attention math, residual adds, rotary
embeddings) have no module to hook: DTensor's sharding propagation runs them on whatever layouts their
producers hand over, which is why outputs are redistributed on the producer's side when every consumer asks
for the same layout (one collective instead of one per consumer, and the only way to reach a consumer that
is not a module).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from torch import nn

from autoshard.capture.ir import OpGraph, OpKind, is_call_of
from autoshard.errors import PlanFileError
from autoshard.plans.layouts import FEAT, Layout
from autoshard.plans.plan import OpPlan, ParamPlacement, Plan, check_fingerprint

__all__ = ["ModuleSpec", "module_specs", "sent_layout", "is_call_of", "param_owners", "producers_of", "check_fingerprint"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModuleSpec:
    """The runtime's view of one planned leaf-module op."""

    path: str  # the module's FQN
    op: str  # the plan's op name
    kind: str
    inputs: tuple[Layout, ...]  # compute layouts of the activation inputs, in argument order
    output: Layout | None  # where the output goes after the call; None: left as produced
    params: dict[str, ParamPlacement] = field(default_factory=dict)  # local name ('weight') -> placement
    zero: int = 0
    split: int = 1
    regather: bool = False  # save_sharded_input: gather inside a checkpoint, again in backward
    fused: int = 1  # > 1: a fused projection whose output one attention op splits into this many parts
    # layouts the activation inputs arrive in (their producers' outputs after redistribution); None: a model
    # input or a tensor made by the model off the gradient path (mask, positions). Read on local shards only.
    arriving: tuple[Layout | None, ...] = ()
    arriving_from: tuple[str | None, ...] = ()  # the module path of each input's producer, None if not a module
    # module paths of the output's consumers when every consumer is a planned module call (() for an output
    # of the model), None when the model's own code consumes it too (local shards: whether gradients may come
    # back as partial sums)
    module_consumers: tuple[str, ...] | None = None


def _is_module_call(op_plan: OpPlan, leaves: set[str]) -> bool:
    """The op is a whole call of a leaf module: named after it."""
    return op_plan.module in leaves and is_call_of(op_plan.op, op_plan.module)


def sent_layout(op_plan: OpPlan, specs: dict[str, ModuleSpec]) -> Layout:
    """Layout op `op_plan`'s output is handed over in: where the runtime sends a planned module call's output
    (every call of a module runs its first call's spec), anything else as the op produces it."""
    spec = specs.get(op_plan.module)
    if spec is not None and spec.output is not None and is_call_of(op_plan.op, op_plan.module):
        return spec.output
    return op_plan.strategy.output


def param_owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """id(parameter) -> every (module, local name, module path) holding it (tied weights have several)."""
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        for local, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mod, local, path))
    return owners


def _local_params(model: nn.Module, module: nn.Module, op_plan: OpPlan) -> dict[str, ParamPlacement]:
    out = {}
    for pp in op_plan.strategy.params:
        try:
            param = model.get_parameter(pp.name)
        except AttributeError:
            raise PlanFileError(f"the plan places parameter {pp.name!r} (op {op_plan.op}) which the model does "
                                "not have; the plan was made for another model: re-plan") from None
        local = next((k for k, v in module._parameters.items() if v is param), None)
        if local is None:
            raise PlanFileError(f"op {op_plan.op} is planned with parameter {pp.name!r}, which module "
                                f"{op_plan.module!r} does not hold; re-plan for this model")
        out[local] = pp
    return out


def producers_of(plan: Plan, graph: OpGraph | None = None) -> dict[str, tuple[str, ...]]:
    """op -> its producer ops, in input order: from the plan (`OpPlan.inputs`), or from `graph` when given
    (checked against the plan's fingerprint first: `check_fingerprint`)."""
    if graph is not None:
        check_fingerprint(plan, graph)
        return {op.name: op.inputs for op in graph.ops}
    if plan.ops and not any(p.inputs for p in plan.ops):
        raise PlanFileError("the plan does not name the producers of its ops (it was made by an older autoshard); "
                            "regenerate it with `autoshard plan ... -o plan.json`")
    return {p.op: p.inputs for p in plan.ops}


def _consumers(producers: dict[str, tuple[str, ...]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, srcs in producers.items():
        for src in srcs:
            out.setdefault(src, []).append(name)
    return out


def _consumer_layouts(producers, by_op: dict[str, OpPlan], consumers: list[str], producer: str):
    wanted: list[tuple[str, Layout]] = []
    for name in consumers:
        plan = by_op.get(name)
        if plan is None:
            continue  # index ops (masks, positions) are not planned
        for i, src in enumerate(producers[name]):
            if src == producer and i < len(plan.strategy.inputs):
                wanted.append((name, plan.strategy.inputs[i]))
    return wanted


def _output_layout(producers, by_op, consumers, producer, module_ops: dict[str, OpPlan]) -> Layout | None:
    wanted = _consumer_layouts(producers, by_op, consumers, producer)
    if not wanted:
        return None
    if any(module_ops.get(c) is not None and module_ops[c].strategy.save_sharded_input for c, _ in wanted):
        return None  # that consumer gathers inside its checkpoint: hand over the shard
    layouts = {lay for _, lay in wanted}
    if len(layouts) == 1:
        return layouts.pop()
    log.debug("consumers of %s want different layouts (%s): each module consumer redistributes itself",
              producer, ", ".join(sorted(map(str, layouts))))
    return None


def _fused_parts(producers, by_op: dict[str, OpPlan], op_plan: OpPlan, consumers: list[str]) -> int:
    """How many parts an attention op takes from this Linear's output (3 for GPT-2's c_attn: q, k, v), when
    the output is feature-sharded on a tensor-parallel axis: the weight's output dim is then sharded part by
    part, where it is stored and where it is used (2D / 3D), so the split is local."""
    st = op_plan.strategy
    if op_plan.kind != "linear" or not any(p == FEAT and a != "dp" for a, p in st.output.items):
        return 1
    for name in consumers:
        consumer = by_op.get(name)
        if consumer is not None and consumer.kind == OpKind.ATTENTION.value and producers[name].count(op_plan.op) > 1:
            return producers[name].count(op_plan.op)
    return 1


def module_specs(plan: Plan, graph: OpGraph | None, model: nn.Module) -> dict[str, ModuleSpec]:
    """module path -> ModuleSpec for every planned leaf-module op of `model` (the first call of a module).

    `graph` (optional) is the graph the plan was made from: its fingerprint is checked and its edges used;
    without it the plan's own record of each op's producers is used."""
    producers = producers_of(plan, graph)
    modules = dict(model.named_modules())
    missing = sorted({p.module for p in plan.ops if p.module not in modules})
    if missing:
        raise PlanFileError(f"the plan names modules the model does not have ({', '.join(missing[:3])}); it was "
                            "made for another model: re-plan for this one")
    leaves = {n for n, m in modules.items() if n and next(m.children(), None) is None}
    by_op = {p.op: p for p in plan.ops}
    module_ops = {p.op: p for p in plan.ops if _is_module_call(p, leaves)}
    consumers = _consumers(producers)
    specs: dict[str, ModuleSpec] = {}
    for name, op_plan in module_ops.items():
        if op_plan.module in specs:
            if op_plan.strategy != by_op[specs[op_plan.module].op].strategy:
                log.warning("module %s is called more than once with different strategies; the runtime "
                            "applies the first (%s) to every call", op_plan.module, specs[op_plan.module].op)
            continue
        module = model.get_submodule(op_plan.module)
        st = op_plan.strategy
        users = consumers.get(name, [])
        specs[op_plan.module] = ModuleSpec(
            path=op_plan.module, op=name, kind=op_plan.kind, inputs=st.inputs,
            output=_output_layout(producers, by_op, users, name, module_ops),
            params=_local_params(model, module, op_plan), zero=st.zero, split=st.split,
            regather=st.save_sharded_input, fused=_fused_parts(producers, by_op, op_plan, users),
            arriving_from=tuple(module_ops[src].module if src in module_ops else None
                                for src in producers.get(name, ())),
            module_consumers=_module_consumers(users, module_ops))
    _warn_unhooked(plan, module_ops)
    # where each input arrives from (needs every spec's output); None: a model input or unplanned constant
    return {path: replace(spec, arriving=tuple(sent_layout(by_op[src], specs) if src in by_op else None
                                               for src in producers.get(spec.op, ())))
            for path, spec in specs.items()}


def _module_consumers(users: list[str], module_ops: dict[str, OpPlan]) -> tuple[str, ...] | None:
    if any(u not in module_ops for u in users):
        return None
    return tuple(dict.fromkeys(module_ops[u].module for u in users))


def _warn_unhooked(plan: Plan, module_ops: dict[str, OpPlan]) -> None:
    """Parameters of ops that are not whole leaf-module calls are replicated: say so once."""
    for p in plan.ops:
        if p.op not in module_ops and any(pp.storage.items for pp in p.strategy.params):
            log.warning("op %s (module %s) places parameters but is not a leaf-module call; its parameters "
                        "stay replicated", p.op, p.module)
