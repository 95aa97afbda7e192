"""What expert parallelism costs in the model: all-to-all bytes, expert weights over ep, the busiest rank's load,
where it pays, and the errors.

The runtime's side (equality with one process, bytes issued) is tests/distributed/test_expert_parallel.py.
"""

import json
import subprocess
import sys

import pytest

from autoshard.api import capture_ref, estimate_config
from autoshard.cost_models.expert_parallel import EXPERT_LOAD_CV, ep_load_imbalance, expected_max_normal
from autoshard.cost_models.prediction import predicted_step_comm
from autoshard.errors import ConfigurationError
from autoshard.plans.contract import expert_parallel_degrees, expert_roles, num_experts

# 4 layers, 8 experts of ffn 1,024, top-2: small enough to capture in seconds
MOE = "mixtral:layers=4,hidden=512,heads=8,kv_heads=8,ffn=1024,vocab=8000,seq=512,experts=8,top_k=2"
CLUSTER = "1x8xH100-80GB"


def _estimate(ep: int, **kw):
    kw.setdefault("global_batch", 16)
    return estimate_config(MOE, CLUSTER, ep=ep, **kw)


def test_imbalance_is_none_without_ep_and_one_expert_of_eight_per_rank_is_the_capacity_factor():
    assert ep_load_imbalance(1, 8) == 1.0
    assert ep_load_imbalance(8, 8) == pytest.approx(1.25)  # Switch Transformer's 1.25, by construction of the cv
    assert pytest.approx(0.25 / expected_max_normal(8)) == EXPERT_LOAD_CV


def test_imbalance_grows_with_ep_and_shrinks_with_more_experts_per_rank():
    assert ep_load_imbalance(2, 8) < ep_load_imbalance(4, 8) < ep_load_imbalance(8, 8)
    assert ep_load_imbalance(8, 64) < ep_load_imbalance(8, 8)


def test_the_graph_knows_its_experts_and_the_degrees_the_runtime_runs():
    graph = capture_ref(MOE)
    assert num_experts(graph) == 8
    roles = expert_roles(graph)
    assert sum(1 for r in roles.values() if r.dispatch) == 4 and sum(1 for r in roles.values() if r.combine) == 4
    assert expert_parallel_degrees(graph, 8) == (2, 4, 8)
    assert expert_parallel_degrees(graph, 6) == (2,)
    assert expert_parallel_degrees(capture_ref("llama:layers=2,hidden=256,heads=4,seq=128"), 8) == ()


def test_the_all_to_alls_move_each_token_k_times_four_times_per_layer():
    """Per MoE layer and micro-batch: dispatch and combine forward, their gradients backward, each the rank's
    tokens x top-k rows of the hidden size (bf16), plus the E int64 counts before each dispatch."""
    plan, cluster = _estimate(4)
    comm = predicted_step_comm(plan, capture_ref(MOE), cluster)
    tokens = plan.micro_batch * 512
    per_layer = 4 * tokens * 2 * 512 * 2 + 8 * 8
    assert comm["all_to_all"] == pytest.approx(4 * plan.num_microbatches * per_layer)
    dense, _ = _estimate(1)
    assert "all_to_all" not in predicted_step_comm(dense, capture_ref(MOE), cluster)


def test_ep_divides_the_expert_weights_a_rank_holds():
    """ZeRO-0: every rank holds all the weights outside the experts and 1/ep of the experts' (bf16 params,
    fp32 master weights and Adam states scale alike)."""
    graph = capture_ref(MOE)
    experts = sum(p.numel for op in graph.ops if op.name in expert_roles(graph) for p in op.params)
    assert experts == 4 * 8 * 3 * 512 * 1024
    one, _ = _estimate(1)
    four, _ = _estimate(4)
    saved = one.prediction.memory.params_bytes - four.prediction.memory.params_bytes
    assert saved == pytest.approx(experts * 3 / 4 * 2)  # bf16 parameters


def test_ep_pays_where_the_expert_weights_traffic_is_exposed_and_not_where_it_hides():
    """ZeRO-1 over 16 GPUs on two nodes of 1x100 Gb/s: at one sample per GPU the experts' gradient
    reduce-scatter and parameter gather are exposed, and EP (experts over the 8 GPUs of a node, synchronized
    over 2) is faster; at 64x the batch they are paid once per step beside 8 micro-batches of compute, and the
    busiest rank's extra rows and the all-to-alls make EP the slower choice."""
    slow = "2x8xA100-80GB@ib-hdr100-1x100"
    small = {ep: estimate_config(MOE, slow, ep=ep, global_batch=16, zero=1)[0].prediction.iteration_time_s
             for ep in (1, 8)}
    big = {ep: estimate_config(MOE, slow, ep=ep, global_batch=1024, micro_batch=8,
                               zero=1)[0].prediction.iteration_time_s for ep in (1, 8)}
    assert small[8] < small[1], small
    assert big[8] > big[1], big


@pytest.mark.parametrize("kw,match", [
    ({"ep": 3}, "ep=3 must divide dp=8"),
    ({"ep": 16, "dp": 16}, "does not divide the 8 experts"),
    ({"ep": 2, "cp": 2, "seq": 512}, "ep > 1 with cp > 1 is not supported"),
])
def test_estimate_refuses_expert_parallel_degrees_the_runtime_cannot_run(kw, match):
    cluster = "2x8xH100-80GB" if kw.get("dp") == 16 else CLUSTER
    with pytest.raises(ConfigurationError, match=match):
        estimate_config(MOE, cluster, global_batch=16, **kw)


def test_estimate_refuses_ep_on_a_dense_model():
    with pytest.raises(ConfigurationError, match="no mixture-of-experts layers"):
        estimate_config("llama:layers=2,hidden=256,heads=4,seq=128", CLUSTER, global_batch=8, ep=2)


def test_cli_estimate_ep_prints_json_and_rejects_a_bad_degree_with_exit_2():
    ok = subprocess.run([sys.executable, "-m", "autoshard", "estimate", MOE, "--cluster", CLUSTER, "--ep", "4",
                         "--global-batch", "16", "--json"], capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ep"] == 4
    bad = subprocess.run([sys.executable, "-m", "autoshard", "estimate", MOE, "--cluster", CLUSTER, "--ep", "3",
                          "--global-batch", "16"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--ep 3 must divide --dp 8" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_an_expert_parallel_plan_round_trips_through_json(tmp_path):
    from autoshard.plans.plan import Plan

    plan, _ = _estimate(4)
    path = tmp_path / "ep.json"
    plan.save(path)
    assert Plan.load(path).ep == 4


def test_plan_searches_every_ep_degree_and_reports_each_beside_the_best_without_ep():
    out = subprocess.run([sys.executable, "-m", "autoshard", "plan", MOE, "--cluster", CLUSTER, "--global-batch", "16",
                          "--json"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    ep = data["expert_parallel"]
    assert sorted(ep["by_ep_s"]) == ["2", "4", "8"]
    times = {1: ep["without_ep_s"], **{int(k): v for k, v in ep["by_ep_s"].items()}}
    assert ep["chosen_ep"] == min(times, key=times.get)
    assert data["predicted"]["iteration_time_s"] == pytest.approx(times[ep["chosen_ep"]])


def test_explain_describes_an_expert_parallel_plan(tmp_path):
    plan, _ = _estimate(4)
    path = tmp_path / "ep.json"
    plan.save(path)
    out = subprocess.run([sys.executable, "-m", "autoshard", "explain", str(path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "expert parallel 4: each MoE layer's experts over 4 of the 8 data-parallel ranks" in out.stdout


def test_the_experts_and_the_router_are_planned_replicated_on_tensor_parallel_axes():
    """The runtime runs them on plain tensors, replicated on tp (runtime/expert_parallel.py): no strategy
    that splits them is offered, while attention keeps its column / row splits."""
    from autoshard.plans.contract import is_expert_weight, tp_replicated_ops
    from autoshard.plans.layouts import MeshSpec
    from autoshard.plans.strategies import strategies_in

    graph = capture_ref(MOE)
    replicated = tp_replicated_ops(graph)
    assert set(expert_roles(graph)) <= replicated
    routers = {n for n in replicated if graph.op(n).params and not any(map(is_expert_weight, graph.op(n).params))}
    assert routers == {f"model.layers.{i}.mlp.gate" for i in range(4)}
    mesh = MeshSpec.of(dp=4, tp=2)
    for name in replicated:
        for st in strategies_in(graph, graph.op(name), mesh, 1):
            assert all(axis == "dp" for lay in (*st.inputs, st.output) for axis, _ in lay.items), (name, st.name)
    q_proj = strategies_in(graph, graph.op("model.layers.0.self_attn.q_proj"), mesh, 1)
    assert any(axis == "tp" for st in q_proj for axis, _ in st.output.items)


def test_under_tensor_parallelism_every_tp_rank_computes_the_experts_whole():
    """Megatron 1D over tp=2 splits q_proj's work over the tp ranks (small GEMMs: their launch stays) and
    leaves the expert GEMMs' as they are."""
    def op_times(tp: int) -> dict[str, float]:
        plan, _ = estimate_config(MOE, CLUSTER, ep=2, tp=tp, dp=8 // tp, global_batch=8 // tp, micro_batch=1)
        return {p.op: p.time_s for p in plan.ops}

    one, two = op_times(1), op_times(2)
    expert = "model.layers.0.mlp.experts.grouped_mm_fallback"
    assert two[expert] >= one[expert]  # its own work whole, plus the all-to-alls of the same rows
    assert two["model.layers.0.self_attn.q_proj"] < one["model.layers.0.self_attn.q_proj"]


def test_a_gradient_reduction_is_shared_only_by_consumers_that_hand_back_a_partial_sum():
    """A producer read by a column-split op and by an op kept replicated on tp: the column-split one's
    input gradient is a partial sum, reduced in full (grad_share 1), while the forward's redistribution
    (none here) is shared by both."""
    from autoshard.cost_models.context import PlanContext
    from autoshard.cost_models.opcost import edge_cost
    from autoshard.hardware_profiles.cluster import ClusterSpec
    from autoshard.plans.layouts import Layout, MeshSpec

    graph = capture_ref(MOE)
    meta = graph.op("model.layers.0.post_attention_layernorm").output_meta
    ctx = PlanContext(mesh=MeshSpec.of(tp=2), cluster=ClusterSpec.parse("1x2xH100-80GB"), micro_batch=1,
                      num_microbatches=1)
    whole = edge_cost(meta, Layout(), Layout(), frozenset({"tp"}), ctx)
    shared = edge_cost(meta, Layout(), Layout(), frozenset({"tp"}), ctx, share=0.5)
    alone = edge_cost(meta, Layout(), Layout(), frozenset({"tp"}), ctx, share=0.5, grad_share=1.0)
    assert [k for k, _ in whole.comm] == ["all_reduce"]
    assert shared.comm[0][1] == pytest.approx(whole.comm[0][1] / 2)
    assert alone.comm == whole.comm


def test_the_planner_offers_tensor_parallel_meshes_with_ep_but_no_pipeline_for_a_moe_model():
    from autoshard.hardware_profiles.cluster import ClusterSpec
    from autoshard.planner.search import enumerate_candidates, parse_space

    cluster = ClusterSpec.parse(CLUSTER)
    found, _ = enumerate_candidates(capture_ref(MOE), cluster, global_batch=16, space=parse_space("dp,zero,tp1d,pp,ep"),
                                    cap_bytes=cluster.device_memory_bytes)
    assert any(c.mesh.tp_axes and c.ep > 1 for c in found)
    assert all(c.mesh.degree("pp") == 1 for c in found)
