"""Context parallelism on real gloo ranks equals one process, and issues the bytes the cost model prices.

Each case: a context-parallel plan as `estimate --cp` writes one (strategies from the rank-local graph, captured
at seq / cp tokens, with cp folded into dp), applied by the runtime: each rank runs two head-tail chunks of
every sequence, attention all-gathers keys and values over the cp group (with tensor parallelism, on the rank's
heads over the cp ranks at its tp position). Loss and every gradient after one
step, and every parameter after three AdamW steps, against a single-process copy on the same global batch
(fp32, atol 1e-5); bytes per collective kind against `predicted_step_comm`.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
from dist_checks import assert_matches_one_process, results_by_case
from dist_models import SEQ, build, example_batch
from dist_plans import make_cp_plan

from autoshard.cost_models.prediction import predicted_param_bytes, predicted_step_comm
from autoshard.hardware_profiles.cluster import ClusterSpec

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning")]

ATOL = 1e-5
BATCH = 4

# id: (world size, model, dp, cp, plan options); qwen2: grouped-query attention (2 key/value heads of 4);
# "recompute": full recompute, whose recomputed attention gathers the keys and values again; "planner": the
# plan the planner's CP search returns (planning.make_plan with cp, as planner/outer.py best_plan calls it), not a family
CASES = {
    "llama-cp2": (2, "llama", 1, 2, {}),
    "llama-cp2-full-recompute": (2, "llama", 1, 2, {"recompute": "full"}),
    "gpt2-cp2": (2, "gpt2", 1, 2, {}),
    "llama-cp2-compiled": (2, "llama", 1, 2, {"compile": True}),  # compiled blocks around the K/V gathers
    "qwen2-cp2-zero3": (2, "qwen2", 1, 2, {"zero": 3}),
    "llama-dp2-cp2": (4, "llama", 2, 2, {}),
    "llama-cp2-planner": (2, "llama", 1, 2, {"planner": True}),
    # Megatron 1D tensor parallelism inside each cp rank (estimate --cp 2 --tp 2): attention on its heads
    "llama-cp2-tp2": (4, "llama", 1, 2, {"tp": 2}),
    "qwen2-cp2-tp2-sp": (4, "qwen2", 1, 2, {"tp": 2, "sequence_parallel": True}),  # 1 K/V head per tp rank
}


# the long suite's: the 4-rank world (CP composed with dp and tp; the 2-rank one covers CP itself) and compiled
# blocks around CP (compiled blocks are checked in the quick suite by test_runtime_families.py)
def _long(case_id: str) -> bool:
    return CASES[case_id][0] == 4 or case_id == "llama-cp2-compiled"


def _params(cases):
    return [pytest.param(c, marks=pytest.mark.long) if _long(c) else c for c in cases]


@functools.cache
def _graph(model: str, seq: int):
    from autoshard.capture import capture

    x, _ = example_batch(model, 2)
    return capture(build(model), (x[:, :seq],))


def _planner_plan(model: str, cluster, cp: int):
    from autoshard.planner.planning import make_plan

    full, local = _graph(model, SEQ), _graph(model, SEQ // cp)
    plan, _ = make_plan(local, cluster, global_batch=BATCH * cp, space=frozenset({"dp", "zero"}), cp=cp)
    assert plan.mesh.degree("cp") == cp
    return replace(plan, model=full.model_name, fingerprint=full.fingerprint())


def _results(case_id: str) -> list[dict]:
    return _world_results(CASES[case_id][0], _long(case_id))[case_id]


@functools.cache
def _world_results(world: int, long: bool) -> dict[str, dict]:
    cases = []
    cluster = ClusterSpec.parse(f"1x{world}xcpu")
    for case_id, (w, model, dp, cp, options) in CASES.items():
        if w != world or _long(case_id) != long:
            continue
        local = _graph(model, SEQ // cp)
        options = dict(options)
        recompute, compiled = options.pop("recompute", "none"), options.pop("compile", False)
        if "tp" in options:
            from autoshard.planner.estimate import HandConfig, estimate

            plan, _ = estimate(local, cluster, HandConfig(global_batch=BATCH, micro_batch=1, dp=dp, cp=cp,
                                                          recompute=recompute, **options))
        elif options.pop("planner", False):
            plan = _planner_plan(model, cluster, cp)
        else:
            plan = make_cp_plan(_graph(model, SEQ), local, dp=dp, cp=cp, family="replicate", global_batch=BATCH,
                                **options)
            plan = replace(plan, recompute=recompute)
        plan = replace(plan, compile=compiled)
        cases.append({"id": case_id, "model": model, "batch": BATCH, "plan": plan, "graph": local,
                      "predicted_param_bytes": predicted_param_bytes(plan, local, cluster),
                      "predicted_comm": predicted_step_comm(plan, local, cluster)})
    return results_by_case(world, cases)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case_id", _params(CASES))
def test_context_parallel_loss_gradients_and_adamw_steps_match_single_process(case_id):
    assert_matches_one_process(case_id, _results(case_id), ATOL)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case_id", _params(CASES))
def test_context_parallel_bytes_per_step_equal_the_cost_model(case_id):
    """The keys' and values' all-gather (forward) and reduce-scatter (backward) on the cp group, and the
    gradient reduction over dp x cp, as measured on every rank, within 5% of `predicted_step_comm`."""
    for rank, r in enumerate(_results(case_id)):
        measured = {k: v for k, v in r["comm"].items() if v}
        predicted = {k: v for k, v in r["predicted_comm"].items() if v}
        print(f"{case_id} rank {rank}: measured {measured} predicted {predicted}")
        assert set(measured) == set(predicted), (measured, predicted)
        for kind, want in predicted.items():
            assert abs(measured[kind] - want) <= 0.05 * want, (kind, measured, predicted)
        assert r["param_bytes"] == r["predicted_param_bytes"]
