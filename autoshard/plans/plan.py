"""Plan: what the planner decided, as frozen data that round-trips through versioned JSON.

A plan names a mesh, the pipeline around it, micro-batching and recompute, and for every planned operator a
strategy: the layouts of its inputs and output, the placement of each parameter, its sharded-DP level and
operator split. The runtime reads nothing else; `explain` reads the costs kept beside each choice.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from autoshard.capture.ir import OpGraph, OpKind, is_call_of
from autoshard.errors import ConfigurationError, PlanFileError
from autoshard.plans.breakdown import MemoryBreakdown, TimeBreakdown
from autoshard.plans.layouts import Layout, MeshSpec

__all__ = ["ParamPlacement", "OpStrategy", "OpPlan", "PipelineSpec", "Prediction", "Baseline", "Plan", "PLAN_VERSION",
           "SCHEDULES", "RECOMPUTE_MODES", "graph_fields", "check_fingerprint", "even_stage_layers",
           "ends_as_layers_stage_layers"]

log = logging.getLogger(__name__)

PLAN_VERSION = 1
SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe", "looped-bfs")
RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True)
class ParamPlacement:
    """Where one parameter lives on the tensor-parallel axes.

    `compute` is its placement when the op runs; `storage` where it rests between uses. They differ for 2D/3D
    weights, which are stored sharded further and all-gathered for each use (their gradients reduce-scattered
    back). The data-parallel axis is described by the op's `zero` level, not here.
    """

    name: str
    compute: Layout
    storage: Layout

    def to_json(self) -> dict:
        return {"name": self.name, "compute": self.compute.to_json(), "storage": self.storage.to_json()}

    @classmethod
    def from_json(cls, d: dict) -> ParamPlacement:
        return cls(name=d["name"], compute=Layout.from_json(d["compute"]), storage=Layout.from_json(d["storage"]))


@dataclass(frozen=True, kw_only=True)
class OpStrategy:
    """One operator's parallel strategy on the plan's mesh.

    `inputs` are the layouts the op computes on (one per activation input, aligned with `Op.inputs`); the
    runtime redistributes to them. `output` is the layout the op produces (P for a row-parallel Linear).
    `zero`: 0 parameters replicated over dp (gradients all-reduced once per step); 1 optimizer states sharded
    (gradients reduce-scattered once per step, parameters gathered once: Megatron's distributed optimizer);
    2 gradients sharded too, reduce-scattered after every micro-batch (FSDP SHARD_GRAD_OP); 3 parameters
    sharded too, gathered for each use (FULL_SHARD). `split`: OSDP
    operator splitting into that many slices along the input dim. `save_sharded_input`: keep the input shard
    for backward and gather it again there (sequence parallelism, Korthikanti et al. 2022).
    """

    name: str
    inputs: tuple[Layout, ...]
    output: Layout
    params: tuple[ParamPlacement, ...] = ()
    zero: int = 0
    split: int = 1
    save_sharded_input: bool = False

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.split < 1:
            raise ValueError(f"split must be >= 1, got {self.split}")

    def __hash__(self) -> int:
        # strategies are dict keys all over the search (memoized costs); hashing the nested layouts each time
        # cost a tenth of it. Kept on the instance, never pickled: str hashes differ between processes.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.name, self.inputs, self.output, self.params, self.zero, self.split,
                      self.save_sharded_input))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def to_json(self) -> dict:
        return {"name": self.name, "inputs": [x.to_json() for x in self.inputs], "output": self.output.to_json(),
                "params": [p.to_json() for p in self.params], "zero": self.zero, "split": self.split,
                "save_sharded_input": self.save_sharded_input}

    @classmethod
    def from_json(cls, d: dict) -> OpStrategy:
        return cls(name=d["name"], inputs=tuple(Layout.from_json(x) for x in d["inputs"]),
                   output=Layout.from_json(d["output"]),
                   params=tuple(ParamPlacement.from_json(p) for p in d["params"]), zero=int(d["zero"]),
                   split=int(d["split"]), save_sharded_input=bool(d["save_sharded_input"]))


@dataclass(frozen=True, kw_only=True)
class OpPlan:
    """The chosen strategy of one operator, with its cost and the runner-up's, for `explain`."""

    op: str
    module: str
    kind: str
    layer: int | None
    strategy: OpStrategy
    inputs: tuple[str, ...] = ()  # producer op of each activation input (the graph's edges), in order
    time_s: float = 0.0  # per micro-batch, forward + backward, incl. its own communication
    memory_bytes: float = 0.0
    runner_up: str | None = None
    runner_up_time_s: float | None = None
    runner_up_memory_bytes: float | None = None

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "strategy"}
        d["strategy"] = self.strategy.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict) -> OpPlan:
        rest = {k: v for k, v in d.items() if k not in ("strategy", "inputs")}
        return cls(strategy=OpStrategy.from_json(d["strategy"]), inputs=tuple(d.get("inputs", ())), **rest)


@dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """Pipeline stages over the `pp` axis. `stage_layers[i]` = (first, last+1) block indices of stage i's
    chunk(s) in model order (len = degree x virtual_stages); embeddings go with the first chunk and the head
    with the last. `layered`: breadth-first (layered) gradient accumulation (Lamy-Poirier 2021)."""

    degree: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    stage_layers: tuple[tuple[int, int], ...] = ()
    layered: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; allowed: {', '.join(SCHEDULES)}")
        if self.degree < 1 or self.virtual_stages < 1:
            raise ValueError("pipeline degree and virtual stages must be >= 1")


@dataclass(frozen=True, kw_only=True)
class Prediction:
    iteration_time_s: float
    tokens_per_s: float
    mfu: float
    model_tflops_per_gpu: float
    memory: MemoryBreakdown
    time: TimeBreakdown

    def to_json(self) -> dict:
        return {"iteration_time_s": self.iteration_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "model_tflops_per_gpu": self.model_tflops_per_gpu, "memory_bytes": asdict(self.memory),
                "time_s": asdict(self.time)}

    @classmethod
    def from_json(cls, d: dict) -> Prediction:
        return cls(iteration_time_s=d["iteration_time_s"], tokens_per_s=d["tokens_per_s"], mfu=d["mfu"],
                   model_tflops_per_gpu=d["model_tflops_per_gpu"], memory=MemoryBreakdown(**d["memory_bytes"]),
                   time=TimeBreakdown(**d["time_s"]))


@dataclass(frozen=True, kw_only=True)
class Baseline:
    """A hand-style configuration the planner priced beside its plan (planner/baselines.py): DP, FSDP, Megatron
    1D, 2D, 3D, the best DP x TP x PP grid. Kept in the plan file, so `explain --plot` draws them too."""

    name: str
    prediction: Prediction | None
    config: str  # what was chosen, e.g. "tp=8 pp=12 dp=16, 1f1b, micro-batch 1 sample x 8 micro-batches per replica, recompute full"
    note: str = ""  # why there is no prediction

    def to_json(self) -> dict:
        return {"name": self.name, "config": self.config, "note": self.note,
                "prediction": self.prediction.to_json() if self.prediction else None}

    @classmethod
    def from_json(cls, d: dict) -> Baseline:
        pred = d.get("prediction")
        return cls(name=d["name"], config=d.get("config", ""), note=d.get("note", ""),
                   prediction=Prediction.from_json(pred) if pred else None)


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: str
    fingerprint: str  # OpGraph.fingerprint of the graph the plan was made for
    # OpGraph.binding_fingerprint of that graph: what the runtime binds the plan to ("" in older plan files)
    binding_fingerprint: str = ""
    param_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (name, shape) of its parameters, by name
    cluster: str
    mesh: MeshSpec
    global_batch: int
    micro_batch: int
    seq: int | None
    recompute: str = "none"
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)
    ops: tuple[OpPlan, ...] = ()
    prediction: Prediction | None = None
    space: tuple[str, ...] = ()
    solve_time_s: float = 0.0
    attention: str = ""  # the attention kernel priced: flash, masked, eager or none ("" in older plan files)
    solver: str = ""  # the MILP solver that chose the strategies (HiGHS or CBC; "" for estimate's hand plans)
    # True: the search proved this the fastest plan of its space under the cost model; False: the best found
    # when an ILP or the search stopped at its time limit (the incumbent)
    optimal: bool = True
    # expert parallel: the experts of every mixture-of-experts layer over ep consecutive ranks of the dp group
    # (cost_models/expert_parallel.py, runtime/expert_parallel.py); 1: none
    ep: int = 1
    # every repeated block torch.compile'd by the runtime, after tensor parallelism and before FSDP2
    # (runtime/compile.py; priced by cost_models: fused kernels, compiled host cost)
    compile: bool = False
    # float8 training of the block Linears (torchao): "" none, "tensorwise" or "rowwise" (cost_models/float8.py)
    float8: str = ""
    baselines: tuple[Baseline, ...] = ()  # what `autoshard plan` priced beside the plan (explain --plot draws them)
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if self.global_batch < 1 or self.micro_batch < 1:
            raise ValueError("global_batch and micro_batch must be positive")
        if self.float8 not in ("", "tensorwise", "rowwise"):
            raise ValueError(f"float8 must be '', 'tensorwise' or 'rowwise', got {self.float8!r}")
        if self.ep < 1 or self.mesh.degree("dp") % self.ep:
            raise ValueError(f"ep must divide the dp degree {self.mesh.degree('dp')}, got {self.ep}")

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per iteration per data-parallel replica (the gradient accumulation steps)."""
        dp = self.mesh.degree("dp")
        return max(1, self.global_batch // (dp * self.micro_batch))

    def op_plan(self, op: str) -> OpPlan:
        for p in self.ops:
            if p.op == op:
                return p
        raise KeyError(op)

    # -- JSON ---------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "version": self.version, "model": self.model, "fingerprint": self.fingerprint, "cluster": self.cluster,
            "binding_fingerprint": self.binding_fingerprint,
            "param_shapes": {name: list(shape) for name, shape in self.param_shapes},
            "mesh": self.mesh.to_json(), "global_batch": self.global_batch, "micro_batch": self.micro_batch,
            "seq": self.seq, "recompute": self.recompute, "pipeline": asdict(self.pipeline),
            "space": list(self.space), "solve_time_s": self.solve_time_s, "attention": self.attention,
            "solver": self.solver, "optimal": self.optimal, "ep": self.ep, "compile": self.compile,
            "float8": self.float8,
            "prediction": self.prediction.to_json() if self.prediction else None,
            "baselines": [b.to_json() for b in self.baselines],
            "ops": [p.to_json() for p in self.ops],
        }

    @classmethod
    def from_json(cls, d: dict, *, source: str = "plan") -> Plan:
        if isinstance(d, dict) and "version" not in d and isinstance(d.get("plan_file_json"), dict):
            d = d["plan_file_json"]  # the output of `autoshard plan --json`, which carries the plan file
        if not isinstance(d, dict) or "version" not in d:
            raise PlanFileError(f"{source} is not an autoshard plan (no 'version' key); make one with "
                                "`autoshard plan MODEL --cluster SPEC -o plan.json`")
        if d["version"] != PLAN_VERSION:
            raise PlanFileError(f"{source} is plan version {d['version']}, this autoshard reads version "
                                f"{PLAN_VERSION}; re-run `autoshard plan` to regenerate it")
        try:
            pipe = d.get("pipeline") or {}
            pipe = {**pipe, "stage_layers": tuple(tuple(x) for x in pipe.get("stage_layers", ()))}
            return cls(
                version=d["version"], model=d["model"], fingerprint=d["fingerprint"], cluster=d["cluster"],
                binding_fingerprint=str(d.get("binding_fingerprint") or ""),
                param_shapes=tuple((name, tuple(int(x) for x in shape))
                                   for name, shape in (d.get("param_shapes") or {}).items()),
                mesh=MeshSpec.from_json(d["mesh"]), global_batch=int(d["global_batch"]),
                micro_batch=int(d["micro_batch"]), seq=d.get("seq"), recompute=d.get("recompute", "none"),
                pipeline=PipelineSpec(**pipe), space=tuple(d.get("space", ())),
                solve_time_s=float(d.get("solve_time_s", 0.0)), attention=str(d.get("attention", "")),
                solver=str(d.get("solver", "")), optimal=bool(d.get("optimal", True)), ep=int(d.get("ep", 1)),
                compile=bool(d.get("compile", False)), float8=str(d.get("float8") or ""),
                prediction=Prediction.from_json(d["prediction"]) if d.get("prediction") else None,
                baselines=tuple(Baseline.from_json(b) for b in d.get("baselines") or ()),
                ops=tuple(OpPlan.from_json(p) for p in d["ops"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanFileError(f"{source} is corrupt ({type(exc).__name__}: {exc}); regenerate it with "
                                "`autoshard plan`") from exc

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a crash mid-write leaves any previous file intact."""
        path = Path(path)
        text = json.dumps(self.to_json(), indent=1, sort_keys=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.",
                                   suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text + "\n")
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a plan is an ordinary file
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        path = Path(path)
        if not path.exists():
            raise PlanFileError(f"plan file {path} does not exist; make one with `autoshard plan ... -o {path}`")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PlanFileError(f"plan file {path} is not valid JSON ({exc}); regenerate it with "
                                "`autoshard plan`") from exc
        return cls.from_json(data, source=f"plan file {path}")


_SHOWN = 3  # differences an error names


def graph_fields(graph: OpGraph) -> dict[str, str | tuple[tuple[str, tuple[int, ...]], ...]]:
    """What a plan records of the graph it is made for: `Plan(**graph_fields(graph), ...)`."""
    shapes: dict[str, tuple[int, ...]] = {}
    for op in graph.ops:
        for p in op.params:
            shapes.setdefault(p.name, p.shape)
    return {"model": graph.model_name, "fingerprint": graph.fingerprint(),
            "binding_fingerprint": graph.binding_fingerprint(), "param_shapes": tuple(sorted(shapes.items()))}


def check_fingerprint(plan: Plan, graph: OpGraph, *, exact: bool = False) -> None:
    """Refuse a plan made for another model, naming what differs.

    The plan applies to its own graph, and to one whose binding fingerprint is the plan's: the same ops
    holding parameters and the same module calls, all the runtime binds a plan to; the rest differs only
    inside modules' own forwards (another transformers version writes them differently), which the plan
    does not place. `exact`: only the plan's own graph will do (pricing needs a strategy for every op)."""
    if plan.fingerprint == graph.fingerprint() or not (plan.fingerprint or exact):
        return
    if not exact and plan.binding_fingerprint and plan.binding_fingerprint == graph.binding_fingerprint():
        log.warning("this model's graph (fingerprint %s) differs from the plan's (%s) only in parameter-free "
                    "ops inside modules (%s), as another transformers version may write them; the plan does "
                    "not place those ops, so it applies, but its predicted figures were priced on its own "
                    "graph", graph.fingerprint(), plan.fingerprint, _unplaced_differences(plan, graph))
        return
    found = _binding_differences(plan, graph) or [_unnamed_difference(plan, graph, exact=exact)]
    more = f"; and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
    raise PlanFileError(f"the plan was made for another graph (fingerprint {plan.fingerprint or 'none'}, "
                        f"this model's {graph.fingerprint()}): {'; '.join(found[:_SHOWN])}{more}; "
                        "re-plan for this model")


def _binding_differences(plan: Plan, graph: OpGraph) -> list[str]:
    """How the ops the plan binds to differ from the graph's binding ops, in graph order."""
    planned = {p.op: p for p in plan.ops if p.strategy.params or is_call_of(p.op, p.module)}
    ops = {op.name: op for op in graph.binding_ops()}
    shapes = dict(plan.param_shapes)
    out = []
    for name, op in ops.items():
        p = planned.get(name)
        if p is None:
            out.append(f"op {name} (module {op.module_path or 'root'}) is in the model only")
            continue
        if p.kind != op.kind.value or p.module != op.module_path:
            out.append(f"op {name} is a {p.kind} of {p.module or 'root'} in the plan, a {op.kind.value} of "
                       f"{op.module_path or 'root'} in the model")
        in_plan, in_model = sorted(pp.name for pp in p.strategy.params), sorted(pm.name for pm in op.params)
        if in_plan != in_model:
            out.append(f"op {name} holds {', '.join(in_plan) or 'no parameters'} in the plan, "
                       f"{', '.join(in_model) or 'none'} in the model")
        out.extend(f"parameter {pm.name} of op {name} is {_shape(shapes[pm.name])} in the plan, "
                   f"{_shape(pm.shape)} in the model"
                   for pm in op.params if pm.name in shapes and shapes[pm.name] != pm.shape)
    out.extend(f"op {name} (module {p.module or 'root'}) is in the plan only"
               for name, p in planned.items() if name not in ops)
    if not out and plan.seq and graph.seq_len and plan.seq != graph.seq_len:
        out.append(f"the plan is for sequences of {plan.seq} tokens, the model's inputs have {graph.seq_len}")
    return out


def _unnamed_difference(plan: Plan, graph: OpGraph, *, exact: bool) -> str:
    """Why the graphs differ when the ops the plan binds to agree as far as the plan records them."""
    unplaced = _unplaced_differences(plan, graph)
    if exact:
        return (f"parameter-free ops inside modules differ ({unplaced}) and pricing needs a strategy for "
                "each op")
    if not plan.binding_fingerprint:
        return (f"parameter-free ops inside modules differ ({unplaced}); the plan does not place them, but "
                "it was made by an older autoshard, which records only the whole graph's fingerprint")
    return ("the output shapes of the module calls or parameter ops it places differ (the plan records "
            "parameter shapes only)")


def _unplaced_differences(plan: Plan, graph: OpGraph) -> str:
    """The parameter-free ops one graph has and the other lacks, as far as the plan's ops tell (it keeps
    no index ops and no shapes)."""
    planned = {p.op for p in plan.ops}
    model_only = [op.name for op in graph.ops
                  if op.kind not in (OpKind.INPUT, OpKind.INDEX) and op.name not in planned]
    names = {op.name for op in graph.ops}
    plan_only = [p.op for p in plan.ops if p.op not in names]
    parts = [f"{len(found)} op{'s' * (len(found) > 1)} only in the {where}, e.g. {found[0]}"
             for found, where in ((model_only, "model"), (plan_only, "plan")) if found]
    return ", and ".join(parts) or "the same ops, with other shapes or inputs"


def _shape(shape: tuple[int, ...]) -> str:
    return f"({', '.join(map(str, shape))})"


@functools.cache
def even_stage_layers(num_layers: int, chunks: int) -> tuple[tuple[int, int], ...]:
    """Megatron's partition: the same number of layers in every chunk."""
    if chunks < 1 or num_layers % chunks:
        raise ConfigurationError(f"{num_layers} layers do not split evenly into {chunks} pipeline chunks "
                                 "(pipeline degree x virtual stages); pick a degree that divides the layer count")
    per = num_layers // chunks
    return tuple((i * per, (i + 1) * per) for i in range(chunks))


def ends_as_layers_stage_layers(num_layers: int, chunks: int) -> tuple[tuple[int, int], ...]:
    """The partition large runs use when the layers do not split evenly but the layers plus two do: the
    embedding and the head each take one layer's place, so the first and the last chunk hold one layer fewer
    (none where every other chunk holds one). BLOOM's Megatron-DeepSpeed (`--pp-partition-method
    'type:transformer|embedding'`: 70 layers on 12 stages as 5, 6, ..., 6, 5), Megatron-Core's
    `--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split`, torchtitan's default split
    points (`generate_split_points`, input and output weighted as one layer each) and Llama 3's schedule ("the
    first model chunk on the first stage has only the embedding, and the last model chunk on the last stage has
    only output projection and loss calculation", Llama 3 paper §3.3.2)."""
    if chunks < 2 or (num_layers + 2) % chunks:
        raise ConfigurationError(f"{num_layers} layers plus the embedding and the head do not split evenly into "
                                 f"{chunks} pipeline chunks; pick a degree that divides {num_layers + 2}")
    per = (num_layers + 2) // chunks
    bounds = [0] + [min(num_layers, max(0, (i + 1) * per - 1)) for i in range(chunks)]
    return tuple((bounds[i], bounds[i + 1]) for i in range(chunks))
