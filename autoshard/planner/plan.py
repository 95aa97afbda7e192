"""Plan: what the planner decided, as frozen data that round-trips through versioned JSON.

A plan names a mesh, the pipeline around it, micro-batching and recompute, and for every planned operator a
strategy: the layouts of its inputs and output, the placement of each parameter, its sharded-DP level and
operator split. The runtime reads nothing else; `explain` reads the costs kept beside each choice.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from autoshard.cost_models.breakdown import MemoryBreakdown, TimeBreakdown
from autoshard.errors import PlanFileError
from autoshard.planner.layouts import Layout, MeshSpec

__all__ = ["ParamPlacement", "OpStrategy", "OpPlan", "PipelineSpec", "Prediction", "Plan", "PLAN_VERSION",
           "SCHEDULES", "RECOMPUTE_MODES"]

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
class Plan:
    model: str
    fingerprint: str
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
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if self.global_batch < 1 or self.micro_batch < 1:
            raise ValueError("global_batch and micro_batch must be positive")
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
            "mesh": self.mesh.to_json(), "global_batch": self.global_batch, "micro_batch": self.micro_batch,
            "seq": self.seq, "recompute": self.recompute, "pipeline": asdict(self.pipeline),
            "space": list(self.space), "solve_time_s": self.solve_time_s, "attention": self.attention,
            "solver": self.solver, "optimal": self.optimal, "ep": self.ep,
            "prediction": self.prediction.to_json() if self.prediction else None,
            "ops": [p.to_json() for p in self.ops],
        }

    @classmethod
    def from_json(cls, d: dict, *, source: str = "plan") -> Plan:
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
                mesh=MeshSpec.from_json(d["mesh"]), global_batch=int(d["global_batch"]),
                micro_batch=int(d["micro_batch"]), seq=d.get("seq"), recompute=d.get("recompute", "none"),
                pipeline=PipelineSpec(**pipe), space=tuple(d.get("space", ())),
                solve_time_s=float(d.get("solve_time_s", 0.0)), attention=str(d.get("attention", "")),
                solver=str(d.get("solver", "")), optimal=bool(d.get("optimal", True)), ep=int(d.get("ep", 1)),
                prediction=Prediction.from_json(d["prediction"]) if d.get("prediction") else None,
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
