"""`autoshard check MODEL --against plan.json`: does the model still plan as well as the committed plan?

For CI: a team commits the plan it trains with; a change to the model (more layers, a wider MLP, another
attention) or to autoshard re-plans it on the committed plan's cluster, global batch and sequence length, over
the plan's search space, and compares. It fails (exit 1 on the CLI) when

    the predicted throughput drops by more than the tolerance   (tokens/s, new against committed)
    the predicted memory per GPU grows by more than the tolerance
    no plan fits any more                                       (on the cluster, under --memory-cap if given)

and says what changed: mesh, micro-batching, recompute, pipeline, the strategies of the ops (grouped by the
change), and the time and memory breakdowns. Both predictions come from this autoshard's cost model: the
committed plan is priced again here (its own figures may be from an older autoshard), so the comparison is of
plans, not of cost models.

    from autoshard.check import assert_plan_holds      # in a test
    assert_plan_holds("my_pkg.model:build", "plans/llama.json", tolerance=0.02)
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from autoshard.errors import ConfigurationError, InfeasiblePlanError, PlanFileError
from autoshard.plans.plan import Plan

__all__ = ["PlanCheck", "check_plan", "assert_plan_holds", "parse_tolerance"]

GIB = 2**30
# the attention kernel a plan records -> the `plan --attention` choice that prices it again
_ATTENTION_CHOICE = {"flash": "flash", "masked": "sdpa", "eager": "eager"}


@dataclass(frozen=True, kw_only=True)
class PlanCheck:
    """The committed plan (priced again here) beside the plan the model gets now."""

    committed: Plan
    current: Plan | None  # None: no plan fits any more
    tolerance: float
    no_fit: str = ""  # why nothing fits (the planner's message), when `current` is None

    @property
    def throughput_change(self) -> float | None:
        """New tokens/s over committed - 1 (negative: slower)."""
        if self.current is None:
            return None
        return self.current.prediction.tokens_per_s / self.committed.prediction.tokens_per_s - 1

    @property
    def memory_change(self) -> float | None:
        """New memory per GPU over committed - 1 (positive: more)."""
        if self.current is None:
            return None
        return (self.current.prediction.memory.total_bytes / self.committed.prediction.memory.total_bytes) - 1

    @property
    def failures(self) -> list[str]:
        if self.current is None:
            return [f"no plan fits any more: {self.no_fit}"]
        out = []
        if self.throughput_change < -self.tolerance:
            out.append(f"predicted throughput {self.throughput_change * 100:+.1f}% (tolerance "
                       f"{self.tolerance * 100:g}%)")
        if self.memory_change > self.tolerance:
            out.append(f"predicted memory per GPU {self.memory_change * 100:+.1f}% (tolerance "
                       f"{self.tolerance * 100:g}%)")
        return out

    @property
    def ok(self) -> bool:
        return not self.failures

    def changes(self) -> list[str]:
        """What differs between the two plans, one line each."""
        if self.current is None:
            return []
        old, new = self.committed, self.current
        out = []
        for what, a, b in (("mesh", old.mesh, new.mesh), ("micro-batch", _batching(old), _batching(new)),
                           ("recompute", old.recompute, new.recompute),
                           ("pipeline", _pipeline(old), _pipeline(new)), ("expert parallel", old.ep, new.ep)):
            if str(a) != str(b):
                out.append(f"{what}: {a} -> {b}")
        out += _strategy_changes(old, new)
        for name, a, b in _breakdown(old, new):
            out.append(f"{name}: {a:.3f} -> {b:.3f}")
        return out

    def to_json(self) -> dict:
        def figures(plan: Plan | None) -> dict | None:
            if plan is None:
                return None
            pred = plan.prediction
            return {"mesh": plan.mesh.to_json(), "micro_batch": plan.micro_batch,
                    "num_microbatches": plan.num_microbatches, "recompute": plan.recompute,
                    "iteration_time_s": pred.iteration_time_s, "tokens_per_s": pred.tokens_per_s,
                    "memory_gib": pred.memory.total_bytes / GIB, "time_s": pred.time.seconds(),
                    "memory_breakdown_gib": pred.memory.gib()}

        return {"ok": self.ok, "failures": self.failures, "tolerance": self.tolerance,
                "throughput_change": self.throughput_change, "memory_change": self.memory_change,
                "committed": figures(self.committed), "current": figures(self.current),
                "changes": self.changes(), "no_fit": self.no_fit or None}

    def lines(self) -> list[str]:
        old = self.committed.prediction
        head = [f"{self.committed.model} on {self.committed.cluster}, global batch {self.committed.global_batch}"
                f"{f', seq {self.committed.seq}' if self.committed.seq else ''}",
                f"committed plan   {old.tokens_per_s:,.0f} tokens/s, {old.memory.total_bytes / GIB:.2f} GiB per GPU, "
                f"mesh {self.committed.mesh} (priced by this autoshard)"]
        if self.current is not None:
            new = self.current.prediction
            head.append(f"plan now         {new.tokens_per_s:,.0f} tokens/s ({self.throughput_change * 100:+.1f}%), "
                        f"{new.memory.total_bytes / GIB:.2f} GiB per GPU ({self.memory_change * 100:+.1f}%), "
                        f"mesh {self.current.mesh}")
        changes = self.changes()
        head += ["what changed:", *("  " + c for c in changes)] if changes else ["nothing changed in the plan"]
        verdict = (["OK: within the tolerance of " f"{self.tolerance * 100:g}%"] if self.ok
                   else ["FAILED: " + "; ".join(self.failures)])
        return head + verdict


def _batching(plan: Plan) -> str:
    return f"{plan.micro_batch} x {plan.num_microbatches}"


def _pipeline(plan: Plan) -> str:
    pipe = plan.pipeline
    return "none" if pipe.degree == 1 else f"{pipe.schedule} x{pipe.virtual_stages} over {pipe.degree} stages"


def _strategy_changes(old: Plan, new: Plan, shown: int = 6) -> list[str]:
    """Ops whose strategy differs, grouped by (old -> new strategy), most frequent first; ops only in one plan."""
    before = {p.op: p.strategy.name for p in old.ops}
    after = {p.op: p.strategy.name for p in new.ops}
    moves = Counter((before[op], after[op]) for op in before.keys() & after.keys() if before[op] != after[op])
    out = [f"strategy of {n} op{'s' if n > 1 else ''}: {a} -> {b}" for (a, b), n in moves.most_common(shown)]
    if len(moves) > shown:
        out.append(f"and {len(moves) - shown} more strategy changes")
    added, removed = len(after.keys() - before.keys()), len(before.keys() - after.keys())
    if added or removed:
        out.append(f"ops: {added} new, {removed} gone (the model's graph changed)")
    return out


def _breakdown(old: Plan, new: Plan) -> list[tuple[str, float, float]]:
    """(figure, committed, now) for the time (s) and memory (GiB) parts that moved by more than 1%."""
    rows = []
    for kind, a, b in (("s", old.prediction.time.seconds(), new.prediction.time.seconds()),
                       ("GiB", old.prediction.memory.gib(), new.prediction.memory.gib())):
        for name in a:
            x, y = a[name], b.get(name, 0.0)
            if max(x, y) > 0 and abs(y - x) > 0.01 * max(x, y):
                rows.append((f"{'time' if kind == 's' else 'memory'} {name} ({kind})", x, y))
    return rows


def parse_tolerance(text: str | float) -> float:
    """'2%' or '0.02' -> 0.02."""
    try:
        value = float(text[:-1]) / 100 if isinstance(text, str) and text.strip().endswith("%") else float(text)
    except ValueError:
        raise ConfigurationError(f"tolerance={text!r}: give a fraction (0.02) or a percentage (2%)",
                                 params=("tolerance",)) from None
    if not 0 <= value < 1:
        raise ConfigurationError(f"tolerance={text!r} must be between 0% and 100%", params=("tolerance",))
    return value


def _load(against: Plan | str | os.PathLike) -> Plan:
    if isinstance(against, Plan):
        return against
    path = Path(against)
    plan = Plan.load(path)
    if plan.space == ("manual",):
        raise PlanFileError(f"{path} was written by `autoshard estimate` (a hand-given configuration); `check` "
                            "compares with a plan the planner made: commit one from `autoshard plan MODEL "
                            f"--cluster {plan.cluster} -o {path.name}`")
    return plan


def check_plan(model, against: Plan | str | os.PathLike, *, tolerance: float | str = 0.02,
               memory_cap: float | None = None, time_limit_s: float = 20.0, progress=None) -> PlanCheck:
    """Re-plan `model` (a zoo name, spec or `module:factory`) on the committed plan's cluster, global batch,
    sequence length and search space, and compare (module docstring). `memory_cap` in GiB per GPU."""
    from autoshard.api import plan_with_baselines
    from autoshard.cost_models.reprice import price_plan

    tol = parse_tolerance(tolerance)
    committed = _load(against)
    space = ",".join(committed.space) if committed.space else None
    attention = _ATTENTION_CHOICE.get(committed.attention, "auto") if _is_ref(model) else "auto"
    try:
        current, _, _, graph, cluster = plan_with_baselines(
            model, committed.cluster, global_batch=committed.global_batch, seq=committed.seq,
            memory_cap=memory_cap, space=space, time_limit_s=time_limit_s, progress=progress,
            attention=attention, baselines=False)
    except InfeasiblePlanError as exc:
        from autoshard.api import load_graph, resolve_cluster

        graph, cluster = load_graph(model, seq=committed.seq, attention=attention), resolve_cluster(committed.cluster)
        return PlanCheck(committed=_priced(committed, graph, cluster, price_plan), current=None, tolerance=tol,
                         no_fit=" ".join(str(exc).split()))
    return PlanCheck(committed=_priced(committed, graph, cluster, price_plan), current=current, tolerance=tol)


def _is_ref(model) -> bool:
    from autoshard.models.names import is_zoo_or_spec

    return isinstance(model, str) and is_zoo_or_spec(model)


def _priced(committed: Plan, graph, cluster, price_plan) -> Plan:
    """The committed plan with this autoshard's prediction, where it still applies to the model's graph (else
    as it was recorded: the model changed under it)."""
    from dataclasses import replace

    try:
        return replace(committed, prediction=price_plan(committed, graph, cluster)[0].prediction)
    except (PlanFileError, ConfigurationError):
        return committed


def assert_plan_holds(model, against: Plan | str | os.PathLike, **kwargs) -> PlanCheck:
    """For a test: `check_plan`, raising AssertionError with the report when the plan got worse."""
    result = check_plan(model, against, **kwargs)
    assert result.ok, "\n".join(result.lines())
    return result
