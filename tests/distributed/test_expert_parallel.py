"""Expert-parallel plans on real gloo ranks equal one process, and issue the bytes the cost model prices.

Each case: a tiny Mixtral (2 layers, 4 experts, top-2) under a plan as `estimate --ep` writes one (data
parallel or ZeRO over dp, each MoE layer's experts over ep of the dp ranks), applied by the runtime: experts
kept per rank and routed by all-to-all (runtime/expert_parallel.py), FSDP2 over the dp ranks outside the
experts and over the ranks holding the same experts inside them; one case adds Megatron 1D tensor parallelism
(`estimate --tp 2 --ep 2`), the experts and router replicated on tp and the ep group the ranks at one tp
position. Loss and every gradient after one step, and
every parameter after three AdamW steps, against a single-process copy on the same global batch (fp32,
atol 1e-5); bytes per collective kind against `predicted_step_comm`.

The all-to-alls' bytes depend on the routing: a rank sends its own T·k rows in the dispatch and the combine's
gradient, and what its experts received in the combine and the dispatch's gradient. The cost model prices the
mean rank; the rows received over all ranks are the rows sent, so the all-to-all bytes averaged over the ranks
are compared with it, every other kind rank by rank.
"""

from __future__ import annotations

import functools

import pytest
from dist_checks import assert_matches_one_process, results_by_case
from dist_models import SEQ, build, example_batch
from dist_plans import make_ep_plan

from autoshard.cost_models.prediction import predicted_param_bytes, predicted_step_comm
from autoshard.hardware_profiles.cluster import ClusterSpec

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning")]

ATOL = 1e-5
BATCH = 4

# id: (world size, dp, ep, plan options); "planner": the plan the planner's search for that ep degree returns
# (planning.make_plan with ep, as planner/outer.py best_plan calls it), not a family
CASES = {
    "mixtral-ep2": (2, 2, 2, {}),
    "mixtral-ep2-compiled": (2, 2, 2, {"compile": True}),  # compiled blocks around the all-to-alls
    "mixtral-ep4": (4, 4, 4, {}),
    "mixtral-dp4-ep2-zero3": (4, 4, 2, {"zero": 3}),
    "mixtral-dp4-ep2-full-recompute": (4, 4, 2, {"recompute": "full"}),
    "mixtral-ep2-planner": (2, 2, 2, {"planner": True}),
    # Megatron 1D tensor parallelism around the experts, which run replicated on tp (estimate --tp 2 --ep 2)
    "mixtral-dp2-ep2-tp2": (4, 2, 2, {"tp": 2}),
}


@functools.cache
def _graph(seq: int):
    from autoshard.capture import capture

    x, _ = example_batch("mixtral", 2)
    return capture(build("mixtral"), (x[:, :seq],))


# the long suite's: compiled blocks around the all-to-alls (compiled blocks are checked in the quick suite by
# test_runtime_families.py)
LONG = {"mixtral-ep2-compiled"}


def _params(cases):
    return [pytest.param(c, marks=pytest.mark.long) if c in LONG else c for c in cases]


def _results(case_id: str) -> list[dict]:
    return _world_results(CASES[case_id][0], case_id in LONG)[case_id]


@functools.cache
def _world_results(world: int, long: bool) -> dict[str, dict]:
    from dataclasses import replace

    cases = []
    cluster = ClusterSpec.parse(f"1x{world}xcpu")
    graph = _graph(SEQ)
    for case_id, (w, dp, ep, options) in CASES.items():
        if w != world or (case_id in LONG) != long:
            continue
        options = dict(options)
        recompute, compiled = options.pop("recompute", "none"), options.pop("compile", False)
        if "tp" in options:
            from autoshard.planner.estimate import HandConfig, estimate

            plan, _ = estimate(graph, cluster, HandConfig(global_batch=BATCH, micro_batch=1, dp=dp, ep=ep,
                                                          **options))
            assert plan.ep == ep and plan.mesh.degree("tp") == options["tp"]
        elif options.pop("planner", False):
            from autoshard.planner.planning import make_plan

            plan, _ = make_plan(graph, cluster, global_batch=BATCH, space=frozenset({"dp", "zero", "ep"}), ep=ep)
            assert plan.ep == ep
        else:
            plan = replace(make_ep_plan(graph, dp=dp, ep=ep, global_batch=BATCH, **options), recompute=recompute)
        plan = replace(plan, compile=compiled)
        cases.append({"id": case_id, "model": "mixtral", "batch": BATCH, "plan": plan, "graph": graph,
                      "predicted_param_bytes": predicted_param_bytes(plan, graph, cluster),
                      "predicted_comm": predicted_step_comm(plan, graph, cluster)})
    return results_by_case(world, cases)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case_id", _params(CASES))
def test_expert_parallel_loss_gradients_and_adamw_steps_match_single_process(case_id):
    assert_matches_one_process(case_id, _results(case_id), ATOL)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case_id", _params(CASES))
def test_expert_parallel_bytes_per_step_equal_the_cost_model(case_id):
    """The ep group's all-to-alls (averaged over the ranks, see the module docstring) and every other
    collective (on each rank) within 5% of `predicted_step_comm`; parameter bytes per rank as predicted."""
    results = _results(case_id)
    mean_all_to_all = sum(r["comm"].get("all_to_all", 0) for r in results) / len(results)
    for rank, r in enumerate(results):
        measured = {k: v for k, v in r["comm"].items() if v}
        measured["all_to_all"] = mean_all_to_all
        predicted = {k: v for k, v in r["predicted_comm"].items() if v}
        print(f"{case_id} rank {rank}: measured {measured} predicted {predicted}")
        assert set(measured) == set(predicted), (measured, predicted)
        for kind, want in predicted.items():
            assert abs(measured[kind] - want) <= 0.05 * want, (kind, measured, predicted)
        assert r["param_bytes"] == r["predicted_param_bytes"]
