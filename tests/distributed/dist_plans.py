"""Hand-made plans for the runtime tests: every op of a graph gets the strategy a family prescribes.

Families (the dp axis, when the mesh has one, adds `dp: S(batch)` to every activation layout):

- `replicate`: everything replicated on the tensor-parallel axes (pure DP / sharded DP, by `zero`);
- `megatron` / `megatron-sp`: Linears reading the residual stream are column-parallel (input R, weight S(out),
  output S(feat)), Linears reading a column-parallel result are row-parallel (input S(feat), weight S(in),
  output P); attention and pointwise ops on split activations follow on S(feat) (heads); the residual stream,
  norms and dropout are R, or S(seq) with sequence parallelism (whose column Linears keep the sequence shard
  for backward); token embeddings are vocabulary-parallel (weight S(in), output P);
- `torchtitan-sp`: `megatron-sp` whose column Linears take the gathered input (R) and keep it: the runtime
  gathers a norm's sequence shard once for all of them (q, k, v; gate, up), as torchtitan's PrepareModuleInput;
- `2d` (Optimus on tp_r x tp_c): activations blocked tp_r:S(batch), tp_c:S(feat); every Linear gathers its
  input over tp_c and its weight over tp_r (stored tp_r:S(in), tp_c:S(out)) inside a checkpoint; a head tied
  to the embedding is row-parallel on tp_c instead (its weight is stored like the embedding's);
- `3d` (Bian et al. on tp_x x tp_y x tp_z): layouts A = x:S(batch), y:S(batch), z:S(feat) and
  B = x:S(batch), y:S(feat), z:S(batch); a Linear reading A gathers y and produces B (reduce-scattered over z),
  one reading B gathers z and produces A.
"""

from __future__ import annotations

from autoshard.capture.ir import Op, OpGraph, OpKind
from autoshard.plans.layouts import BATCH, FEAT, IN, OUT, PARTIAL, SEQ, Layout, MeshSpec, layout
from autoshard.plans.plan import OpPlan, OpStrategy, ParamPlacement, Plan

__all__ = ["make_plan", "expected_param_bytes", "FAMILIES"]

FAMILIES = ("replicate", "megatron", "megatron-sp", "torchtitan-sp", "2d", "3d")
_UNPLANNED = (OpKind.INPUT, OpKind.INDEX)
_TP_FOLLOW = (OpKind.ATTENTION, OpKind.MATMUL, OpKind.SOFTMAX, OpKind.ELEMENTWISE, OpKind.DROPOUT)


def _params(op: Op, weight: tuple[Layout, Layout], bias: tuple[Layout, Layout]) -> tuple[ParamPlacement, ...]:
    """(compute, storage) of the weight for >= 2-D parameters, of the bias for 1-D ones."""
    out = []
    for p in op.params:
        compute, storage = weight if len(p.shape) >= 2 else bias
        out.append(ParamPlacement(name=p.name, compute=compute, storage=storage))
    return tuple(out)


def _same(lay: Layout) -> tuple[Layout, Layout]:
    return lay, lay


class _Builder:
    def __init__(self, graph: OpGraph, mesh: MeshSpec, family: str, tied: set[str]) -> None:
        self.graph, self.mesh, self.family, self.tied = graph, mesh, family, tied
        self.role: dict[str, str] = {}  # op -> role of its output ("rep", "tp", "A", "B", ...)

    def dp(self, lay: Layout) -> Layout:
        return lay.with_("dp", BATCH) if "dp" in self.mesh.names else lay

    def strategy(self, op: Op) -> OpStrategy:
        ins = [self.role.get(s, "const") for s in op.inputs]
        fn = {"replicate": self._replicate, "megatron": self._megatron, "megatron-sp": self._megatron,
              "torchtitan-sp": self._megatron,
              "2d": self._optimus, "3d": self._bian}[self.family]
        name, inputs, output, params, role, regather = fn(op, ins)
        self.role[op.name] = role
        return OpStrategy(name=name, inputs=tuple(self.dp(x) for x in inputs), output=self.dp(output),
                          params=params, save_sharded_input=regather)

    # -- families ------------------------------------------------------------------------------------
    def _replicate(self, op, ins):
        return "replicate", [Layout()] * len(ins), Layout(), _params(op, _same(Layout()), _same(Layout())), "rep", False

    def _megatron(self, op, ins):
        sp = self.family in ("megatron-sp", "torchtitan-sp")
        regather = self.family == "megatron-sp"
        stream = layout(tp=SEQ) if sp else Layout()
        split = [r == "tp" for r in ins]
        if op.kind is OpKind.LINEAR:
            if split and all(split):  # row-parallel
                return ("row", [layout(tp=FEAT)] * len(ins), layout(tp=PARTIAL),
                        _params(op, _same(layout(tp=IN)), _same(Layout())), "rep", False)
            return ("col", [Layout()] * len(ins), layout(tp=FEAT),
                    _params(op, _same(layout(tp=OUT)), _same(layout(tp=OUT))), "tp", regather)
        if op.kind is OpKind.EMBEDDING:  # vocabulary-parallel
            return "vocab", [Layout()] * len(ins), layout(tp=PARTIAL), _params(op, _same(layout(tp=IN)), _same(Layout())), "rep", False
        if op.kind in _TP_FOLLOW and any(split):
            lays = [layout(tp=FEAT) if s else Layout() for s in split]
            return "heads", lays, layout(tp=FEAT), (), "tp", False
        return "stream", [stream] * len(ins), stream, _params(op, _same(Layout()), _same(Layout())), "rep", False

    def _optimus(self, op, ins):
        blocked = layout(tp_r=BATCH, tp_c=FEAT)
        if op.kind is OpKind.LINEAR and any(p.name in self.tied for p in op.params):
            w = _same(layout(tp_c=IN))  # stored like the embedding it is tied to: (vocab, h) with h on tp_c
            return "2d-row-c", [blocked] * len(ins), layout(tp_r=BATCH, tp_c=PARTIAL), _params(op, w, _same(Layout())), "blk", False
        if op.kind is OpKind.LINEAR:
            w = (layout(tp_c=OUT), layout(tp_r=IN, tp_c=OUT))
            return "2d", [layout(tp_r=BATCH)] * len(ins), blocked, _params(op, w, _same(layout(tp_c=OUT))), "blk", True
        if op.kind is OpKind.EMBEDDING:
            return "2d-emb", [layout(tp_r=BATCH)] * len(ins), blocked, _params(op, _same(layout(tp_c=OUT)), _same(Layout())), "blk", False
        return "blocked", [blocked] * len(ins), blocked, _params(op, _same(layout(tp_c=OUT)), _same(layout(tp_c=OUT))), "blk", False

    def _bian(self, op, ins):
        a = layout(tp_x=BATCH, tp_y=BATCH, tp_z=FEAT)
        b = layout(tp_x=BATCH, tp_y=FEAT, tp_z=BATCH)
        reads_b = any(r == "B" for r in ins)
        if op.kind is OpKind.LINEAR and not reads_b:  # A -> B: gather y, partial on z
            w = (layout(tp_y=OUT, tp_z=IN), layout(tp_x=OUT, tp_y=OUT, tp_z=IN))
            return ("3d-yz", [layout(tp_x=BATCH, tp_z=FEAT)] * len(ins), layout(tp_x=BATCH, tp_y=FEAT, tp_z=PARTIAL),
                    _params(op, w, _same(layout(tp_y=OUT))), "B", False)
        if op.kind is OpKind.LINEAR:  # B -> A: gather z, partial on y
            w = (layout(tp_y=IN, tp_z=OUT), layout(tp_x=OUT, tp_y=IN, tp_z=OUT))
            return ("3d-zy", [layout(tp_x=BATCH, tp_y=FEAT)] * len(ins), layout(tp_x=BATCH, tp_y=PARTIAL, tp_z=FEAT),
                    _params(op, w, _same(layout(tp_z=OUT))), "A", False)
        lay, role = (b, "B") if reads_b else (a, "A")
        feat_axis = "tp_y" if reads_b else "tp_z"
        return "follow", [lay] * len(ins), lay, _params(op, _same(layout(**{feat_axis: OUT})), _same(layout(**{feat_axis: OUT}))), role, False


def make_plan(graph: OpGraph, mesh: MeshSpec, family: str, *, global_batch: int, zero: int = 0,
              zero_per_op: dict[str, int] | None = None, split: dict[str, int] | None = None) -> Plan:
    """A plan giving every planned op of `graph` the `family`'s strategy on `mesh` (see module docstring)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    tied = {owner for _, owner in graph.tied_params}
    builder = _Builder(graph, mesh, family, tied)
    zero_per_op, split = zero_per_op or {}, split or {}
    ops = []
    for op in graph.ops:
        if op.kind in _UNPLANNED:
            continue
        st = builder.strategy(op)
        if op.params:
            st = OpStrategy(name=st.name, inputs=st.inputs, output=st.output, params=st.params,
                            zero=zero_per_op.get(op.name, zero), split=split.get(op.name, 1),
                            save_sharded_input=st.save_sharded_input)
        ops.append(OpPlan(op=op.name, module=op.module_path, kind=op.kind.value, layer=op.layer, strategy=st,
                          inputs=op.inputs))
    dp = mesh.degree("dp")
    return Plan(model=graph.model_name, fingerprint=graph.fingerprint(), cluster=f"1x{mesh.size}xcpu", mesh=mesh,
                global_batch=global_batch, micro_batch=max(1, global_batch // dp), seq=graph.seq_len,
                ops=tuple(ops))




def expected_param_bytes(plan: Plan, graph: OpGraph) -> int:
    """Parameter bytes per rank a plan implies (even shards): each parameter's elements over the degrees of
    the axes its storage layout shards, and over dp when its op's ZeRO level is above 0. Tied parameters
    count once, with the highest ZeRO level of their ops (as the runtime groups them)."""
    dtype_bytes = {p.name: 4 for op in graph.ops for p in op.params}
    numel = {p.name: p.numel for op in graph.ops for p in op.params}
    shards: dict[str, int] = {}
    zero: dict[str, int] = {}
    for op_plan in plan.ops:
        for pp in op_plan.strategy.params:
            shards[pp.name] = pp.storage.shard_degree(plan.mesh)
            zero[pp.name] = max(zero.get(pp.name, 0), op_plan.strategy.zero)
    total = 0
    for name, n in numel.items():
        degree = shards.get(name, 1) * (plan.mesh.degree("dp") if zero.get(name, 0) > 0 else 1)
        total += n * dtype_bytes[name] // degree
    return total


def make_cp_plan(full: OpGraph, local: OpGraph, *, dp: int, cp: int, family: str, global_batch: int,
                 **options) -> Plan:
    """A context-parallel plan as `estimate` writes one: the strategies of `family` on the rank-local graph
    `local` (captured at seq / cp tokens) with cp folded into dp, under the real mesh, sequence length and
    fingerprint of the whole model `full`."""
    from dataclasses import replace

    folded = make_plan(local, MeshSpec.of(dp=dp * cp), family, global_batch=global_batch * cp, **options)
    mesh = MeshSpec.of(**({"dp": dp} if dp > 1 else {}), cp=cp)
    return replace(folded, mesh=mesh, global_batch=global_batch, micro_batch=max(1, global_batch // dp),
                   seq=full.seq_len, model=full.model_name, fingerprint=full.fingerprint())


def make_ep_plan(graph: OpGraph, *, dp: int, ep: int, global_batch: int, **options) -> Plan:
    """An expert-parallel plan as `estimate --ep` writes one: data parallel (or ZeRO) over dp, each MoE layer's
    experts over ep of the dp ranks."""
    from dataclasses import replace

    return replace(make_plan(graph, MeshSpec.of(dp=dp), "replicate", global_batch=global_batch, **options), ep=ep)
