"""Compiled blocks and float8 Linears: their pricing (cost_models/float8.py, host.py), the planner's choice
(planner/search.py `Lowering`), the plan field, and what the runtime refuses (runtime/compile.py)."""

import dataclasses
import math

import pytest

from autoshard.api import estimate_config, load_graph
from autoshard.cost_models.compute import gemm_time_s
from autoshard.cost_models.float8 import cast_bytes_per_elem, float8_linear
from autoshard.cost_models.host import COMPILED_GRAPH_US, COMPILED_US_PER_KERNEL
from autoshard.cost_models.prediction import predicted_step_comm
from autoshard.errors import ConfigurationError
from autoshard.hardware_profiles import ClusterSpec
from autoshard.hardware_profiles.profiles import load_gpu
from autoshard.plans.plan import Plan

TINY_LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32"
# the Llama of ../shared/references/gpu_h200.md's hand-written loop (gpu_check's llama1b-none-mb1x8)
LLAMA_1B = "llama:layers=16,hidden=2048,heads=32,kv_heads=8,ffn=8192,vocab=128256,seq=4096,rope_theta=500000"


def _step_s(model, cluster, **kw) -> float:
    plan, _ = estimate_config(model, cluster, **kw)
    return plan.prediction.iteration_time_s


def test_compiled_blocks_predict_the_h200_hand_loops_measured_speedup():
    # measured on one H200 (references/gpu_h200.md): the torchtitan-style loop took 0.91 s eager and 0.76 s with
    # every block compiled (0.835); nothing in the pricing is fitted to it
    kw = dict(dp=1, micro_batch=1, global_batch=8)
    eager = _step_s(LLAMA_1B, "1x1xH200-141GB", **kw)
    compiled = _step_s(LLAMA_1B, "1x1xH200-141GB", compile=True, **kw)
    assert compiled / eager == pytest.approx(0.76 / 0.91, abs=0.03)


def test_a_compiled_block_costs_its_host_a_graph_call_per_phase_and_a_launch_per_kernel():
    graph = load_graph(TINY_LLAMA)
    cluster = ClusterSpec.parse("1x1xH200-141GB")
    host_free = dataclasses.replace(cluster.gpu, fsdp_us_per_module=0.0)
    cluster = dataclasses.replace(cluster, gpu=host_free)
    from autoshard.planner.estimate import HandConfig, estimate

    _, ev = estimate(graph, cluster, HandConfig(dp=1, micro_batch=1, global_batch=1, compile=True))
    block_ops = [op for op in graph.ops if op.layer is not None and op.name in ev.op_costs]
    kernels = sum(1 for op in block_ops if op.kernels)
    blocks = len({op.layer for op in block_ops})
    host_fwd = sum(ev.op_costs[op.name].host_fwd_s for op in block_ops)
    assert host_fwd == pytest.approx(kernels * COMPILED_US_PER_KERNEL * 1e-6)
    eager_fwd = sum(op.dispatches for op in block_ops) * cluster.gpu.host_us_per_op * 1e-6
    assert host_fwd + blocks * COMPILED_GRAPH_US * 1e-6 < eager_fwd / 3


def test_a_float8_gemm_runs_at_the_profiles_fp8_speedup_where_it_is_compute_bound():
    h100 = dataclasses.replace(load_gpu("H100-80GB"), fp8_gemm_speedup_by_gflop=())  # the flat speedup alone
    bf16 = gemm_time_s(8192, 8192, 8192, h100) - h100.kernel_launch_us * 1e-6
    fp8 = gemm_time_s(8192, 8192, 8192, h100, float8=True) - h100.kernel_launch_us * 1e-6
    assert bf16 / fp8 == pytest.approx(h100.fp8_gemm_speedup)
    with pytest.raises(ValueError, match="no float8 tensor cores"):
        gemm_time_s(8192, 8192, 8192, load_gpu("A100-80GB"), float8=True)


@pytest.mark.parametrize("gpu", ["H100-80GB", "H200-141GB"])
def test_a_small_float8_gemm_gains_what_the_h200_measured_at_its_size_not_the_large_gemms_speedup(gpu):
    # benchmarks/float8_shapes.md: torch._scaled_mm over torch.mm 1.07x at 4096 x 2048 x 512 (8.6 GFLOP), 1.24x at
    # 4096 x 2048 x 2048, 1.84-1.86x at 8192 x 8192 x 28672
    g = load_gpu(gpu)

    def speedup(m, k, n):
        launch = g.kernel_launch_us * 1e-6
        return (gemm_time_s(m, n, k, g) - launch) / (gemm_time_s(m, n, k, g, float8=True) - launch)

    assert speedup(4096, 2048, 512) == pytest.approx(1.07, abs=0.01)
    assert speedup(4096, 2048, 2048) == pytest.approx(1.24, abs=0.01)
    assert speedup(8192, 8192, 28672) == pytest.approx(1.85, abs=0.01)
    assert speedup(65536, 8192, 28672) <= g.fp8_gemm_speedup  # beyond the curve: its last point, capped


def test_a_measured_fp8_speedup_curve_needs_fp8_tensor_cores():
    with pytest.raises(ValueError, match="set both or neither"):
        dataclasses.replace(load_gpu("A100-80GB"), fp8_gemm_speedup_by_gflop=((10.0, 1.2),))


def test_float8_covers_the_block_linears_and_leaves_the_head_in_16_bits():
    graph = load_graph(TINY_LLAMA)
    linears = [op for op in graph.ops if op.kind.value == "linear"]
    converted = [op for op in linears if float8_linear(op)]
    assert converted and all(op.layer is not None for op in converted)
    assert any(op.layer is None for op in linears)  # the head
    assert len(converted) == sum(1 for op in linears if op.layer is not None)


def test_tensorwise_float8_halves_the_zero3_weight_gathers_and_rowwise_does_not():
    kw = dict(dp=8, zero=3, micro_batch=1, global_batch=8, compile=True)
    plans = {r: estimate_config(TINY_LLAMA, "1x8xH100-80GB", float8=r, **kw)[0] for r in ("", "tensorwise", "rowwise")}
    graph, cluster = load_graph(TINY_LLAMA), ClusterSpec.parse("1x8xH100-80GB")
    gathers = {r: predicted_step_comm(p, graph, cluster)["all_gather"] for r, p in plans.items()}
    f8_numel = sum(p.numel for op in graph.ops if float8_linear(op) for p in op.params if p.owner and len(p.shape) == 2)
    assert gathers["rowwise"] == gathers[""]
    # ZeRO-3 gathers every weight forward and backward; a float8 weight's in 1 byte instead of bf16's 2
    assert gathers[""] - gathers["tensorwise"] == pytest.approx(2 * f8_numel * (2 - 1))


def test_tensorwise_float8_holds_gathered_weights_in_one_byte_and_casts_each_shard_once_per_gather():
    """FSDP2's float8 all-gather keeps the gathered weight as float8 between uses (ZeRO 0-2, and ZeRO-3 in a
    pipeline stage): a byte per element instead of bf16's two, measured on gloo ranks
    (tests/distributed/test_float8_runtime.py); rowwise gathers 16 bits. The weight is cast on its 1/dp shard
    before each gather, with a scale computed once per step: once per step at ZeRO-2, so the per-micro-batch
    cast shrinks with more micro-batches, twice per micro-batch (forward and backward gathers) at ZeRO-3."""
    from autoshard.cost_models.opcost import _float8_gather_cast_s
    from autoshard.cost_models.prediction import context_for

    graph, cluster = load_graph(TINY_LLAMA), ClusterSpec.parse("1x8xH100-80GB")
    f8_numel = sum(p.numel for op in graph.ops if float8_linear(op) for p in op.params if p.owner and len(p.shape) == 2)
    for zero, pp in ((2, 1), (3, 2)):
        kw = dict(dp=8 // pp, pp=pp, zero=zero, micro_batch=1, global_batch=8, compile=True)
        mem = {r: estimate_config(TINY_LLAMA, cluster, float8=r, **kw)[0].prediction.memory.params_bytes
               for r in ("", "tensorwise", "rowwise")}
        assert mem["rowwise"] == mem[""]
        saved = mem[""] - mem["tensorwise"]
        if pp == 1:  # every block Linear's weight, two bytes to one
            assert saved == pytest.approx(f8_numel * (2 - 1))
        else:  # the stage's own layer, held whole
            assert saved == pytest.approx(f8_numel / 2 * (2 - 1))
    q = next(op for op in graph.ops if float8_linear(op))
    casts = {}
    for zero, m in ((2, 1), (2, 4), (3, 1)):
        plan, _ = estimate_config(TINY_LLAMA, cluster, dp=8, zero=zero, micro_batch=1, global_batch=8 * m,
                                  compile=True, float8="tensorwise")
        st = next(p.strategy for p in plan.ops if p.op == q.name)
        casts[zero, m] = _float8_gather_cast_s(q, st, context_for(plan, cluster, graph))
    assert casts[2, 4][0] < casts[2, 1][0] and casts[2, 1][1] == casts[2, 4][1] == 0.0
    # one micro-batch: a cast and the step's scale pass in forward at either level; ZeRO-3 casts again for its
    # backward gather (no scale pass there)
    assert casts[3, 1][0] == pytest.approx(casts[2, 1][0])
    assert 0.0 < casts[3, 1][1] < casts[3, 1][0]
    rowwise, _ = estimate_config(TINY_LLAMA, cluster, dp=8, zero=3, micro_batch=1, global_batch=8, compile=True,
                                 float8="rowwise")
    st = next(p.strategy for p in rowwise.ops if p.op == q.name)
    assert _float8_gather_cast_s(q, st, context_for(rowwise, cluster, graph)) == (0.0, 0.0)


def test_eager_float8_casts_move_five_times_the_bytes_of_compiled_ones():
    for recipe in ("tensorwise", "rowwise"):
        assert cast_bytes_per_elem(recipe, "fwd", "x", compiled=False) == 25
        assert cast_bytes_per_elem(recipe, "fwd", "x", compiled=True) <= 5
    cluster = "1x1xH100-80GB"
    kw = dict(dp=1, micro_batch=1, global_batch=2)
    model = "llama:layers=2,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=32000,seq=4096"
    assert _step_s(model, cluster, float8="tensorwise", **kw) > _step_s(model, cluster, float8="tensorwise",
                                                                        compile=True, **kw)


def test_float8_is_refused_on_gpus_without_fp8_tensor_cores():
    with pytest.raises(ConfigurationError, match="A100-80GB has no fp8 tensor cores"):
        estimate_config(TINY_LLAMA, "1x8xA100-80GB", dp=8, global_batch=8, float8="tensorwise")
    from autoshard.api import plan

    with pytest.raises(ConfigurationError, match="no fp8 tensor cores"):
        plan(TINY_LLAMA, "1x2xA100-80GB", global_batch=4, float8="tensorwise")


def test_the_planner_compiles_on_gpus_tensor_parallel_plans_too_and_nothing_on_cpu_ranks():
    from autoshard.api import plan

    gpu = plan(TINY_LLAMA, "1x2xH100-80GB", global_batch=4, space="dp,zero")
    assert gpu.compile and not gpu.mesh.tp_axes
    assert not plan(TINY_LLAMA, "1x2xcpu", global_batch=4, space="dp,zero").compile
    tp = plan(TINY_LLAMA, "1x2xH100-80GB", global_batch=2, space="tp1d")
    assert tp.mesh.tp_axes and tp.compile  # blocks on DTensors compile too (runtime/compile.py)
    off = plan(TINY_LLAMA, "1x2xH100-80GB", global_batch=4, space="dp,zero", compile=False)
    assert not off.compile


def _block_levels_solved(compiled: bool, only: dict[str, int]) -> set | None:
    """Solve the ILP for TINY_LLAMA on dp 2 x tp 2 (H100s) with the parameter ops of the first block restricted
    to zero level only[name] (the rest free); the set of (zero, split) its parameter ops got, None if infeasible."""
    from autoshard.cost_models.context import PlanContext, default_precision
    from autoshard.cost_models.template import template_for
    from autoshard.planner.ilp import build_problem, solve
    from autoshard.plans.layouts import MeshSpec
    from autoshard.plans.plan import PipelineSpec
    from autoshard.plans.strategies import strategies_in

    graph, cluster, mesh = load_graph(TINY_LLAMA), ClusterSpec.parse("1x4xH100-80GB"), MeshSpec.of(dp=2, tp=2)
    ctx = PlanContext(mesh=mesh, cluster=cluster, micro_batch=1, num_microbatches=1,
                      precision=default_precision(cluster), seq=graph.seq_len, compile=compiled)
    tg, _ = template_for(graph, PipelineSpec())
    strategies = {}
    for op in tg.ops:
        found = strategies_in(graph, op, mesh, 1)
        key = next((k for k in only if op.name.endswith(k)), None)
        strategies[op.name] = [s for s in found if key is None or s.zero == only[key]]
    problem = build_problem(graph, ctx, PipelineSpec(), strategies, cap_bytes=80e9)
    solution = solve(problem, time_limit_s=30)
    if solution.status == "infeasible":
        return None
    block = set(graph.blocks[0].op_names[0])
    return {(strategies[n][i].zero, strategies[n][i].split) for n, i in solution.choice.items()
            if n in block and any(o.name == n and o.params for o in tg.ops)}


def test_a_compiled_plan_on_dtensors_keeps_every_block_one_fsdp_unit():
    # the ILP's `_whole_blocks` rows (runtime/compile.py `check_compile_plan` refuses the rest): one zero level
    # for every parameter op of a block, no split op, once its blocks compile on DTensors
    q_zero3 = {"q_proj": 3}
    assert len(_block_levels_solved(False, {"q_proj": 3, "o_proj": 0})) > 1  # eager: levels mix freely
    assert _block_levels_solved(True, {"q_proj": 3, "o_proj": 0}) is None  # compiled: no plan mixes them
    assert _block_levels_solved(True, q_zero3) == {(3, 1)}  # the rest follow q_proj's level, unsplit


def test_a_float8_plan_has_no_tensor_parallel_axes_and_round_trips_through_json():
    from autoshard.api import plan

    p = plan(TINY_LLAMA, "1x2xH100-80GB", global_batch=4, float8="tensorwise")
    assert p.float8 in ("tensorwise", "") and (not p.float8 or not p.mesh.tp_axes)
    back = Plan.from_json(p.to_json())
    assert (back.compile, back.float8) == (p.compile, p.float8)


def test_plans_written_before_compile_and_float8_load_as_eager_16_bit():
    p, _ = estimate_config(TINY_LLAMA, "1x2xcpu", dp=2, global_batch=4)
    d = p.to_json()
    del d["compile"], d["float8"]
    back = Plan.from_json(d)
    assert back.compile is False and back.float8 == ""


def test_the_runtime_refuses_compiled_dtensor_blocks_of_several_fsdp_units_and_with_cp_or_ep_by_tp():
    from autoshard.runtime.compile import check_compile_plan

    p, _ = estimate_config(TINY_LLAMA, "1x4xcpu", tp=2, dp=2, zero=3, global_batch=4)
    check_compile_plan(dataclasses.replace(p, compile=True))  # one zero level per block: runs
    q_proj = next(i for i, op in enumerate(p.ops) if op.layer == 1 and op.strategy.params)
    ops = list(p.ops)
    ops[q_proj] = dataclasses.replace(ops[q_proj], strategy=dataclasses.replace(ops[q_proj].strategy, zero=0))
    with pytest.raises(ConfigurationError, match="block 1 mixes zero levels or splits ops"):
        check_compile_plan(dataclasses.replace(p, ops=tuple(ops), compile=True))
    check_compile_plan(dataclasses.replace(p, ops=tuple(ops)))  # eager: nothing to refuse
    cp, _ = estimate_config(TINY_LLAMA, "1x4xcpu", tp=2, dp=1, cp=2, global_batch=2)
    with pytest.raises(ConfigurationError, match="context parallelism and tensor-parallel axes tp"):
        check_compile_plan(dataclasses.replace(cp, compile=True))
    dp, _ = estimate_config(TINY_LLAMA, "1x2xcpu", dp=2, global_batch=2)
    check_compile_plan(dataclasses.replace(dp, compile=True))


def test_the_runtime_refuses_float8_with_tensor_parallelism_naming_the_fix():
    from autoshard.runtime.compile import check_float8_plan

    p, _ = estimate_config(TINY_LLAMA, "1x2xcpu", tp=2, dp=1, global_batch=2)
    with pytest.raises(ConfigurationError, match="re-plan with --float8 none or without tensor parallelism"):
        check_float8_plan(dataclasses.replace(p, float8="tensorwise"), "cpu")


def test_estimate_prices_llama3_70b_fsdp_by_tp_on_256_h100s_in_float8_with_compiled_blocks():
    kw = dict(tp=8, dp=32, zero=3, micro_batch=1, global_batch=256, seq=8192, recompute="full",
              sequence_parallel=True)
    bf16 = _step_s("llama3-70b", "32x8xH100-80GB", compile=True, **kw)
    fp8 = _step_s("llama3-70b", "32x8xH100-80GB", compile=True, float8="tensorwise", **kw)
    assert math.isfinite(fp8) and fp8 < bf16


def test_the_planner_offers_float8_on_fp8_gpus_for_plans_the_runtime_runs_in_float8_and_nowhere_else():
    from autoshard.planner.offers import float8_offers

    graph = load_graph(TINY_LLAMA)
    h100, a100 = ClusterSpec.parse("1x2xH100-80GB"), ClusterSpec.parse("1x2xA100-80GB")
    dp, _ = estimate_config(TINY_LLAMA, h100, dp=2, global_batch=4, compile=True)
    offers = float8_offers(dp, graph, h100)
    assert set(offers) == {"tensorwise", "rowwise"}
    priced, _ = estimate_config(TINY_LLAMA, h100, dp=2, global_batch=4, compile=True, float8="tensorwise")
    assert offers["tensorwise"] == pytest.approx(priced.prediction.tokens_per_s)
    assert float8_offers(estimate_config(TINY_LLAMA, a100, dp=2, global_batch=4)[0], graph, a100) == {}
    tp, _ = estimate_config(TINY_LLAMA, h100, tp=2, dp=1, global_batch=4)
    assert float8_offers(tp, graph, h100) == {}
    assert float8_offers(priced, graph, h100) == {}


def test_only_tensor_expert_or_context_parallel_layouts_on_fp8_gpus_are_blocked_from_float8():
    from autoshard.planner.offers import float8_blocked_by

    h100, a100 = ClusterSpec.parse("1x2xH100-80GB"), ClusterSpec.parse("1x2xA100-80GB")
    tp, _ = estimate_config(TINY_LLAMA, h100, tp=2, dp=1, global_batch=4)
    dp, _ = estimate_config(TINY_LLAMA, h100, dp=2, global_batch=4)
    assert float8_blocked_by(tp, h100) == "tensor parallelism"
    assert float8_blocked_by(dp, h100) == ""
    assert float8_blocked_by(estimate_config(TINY_LLAMA, a100, tp=2, dp=1, global_batch=4)[0], a100) == ""


def test_a_plan_whose_layout_the_runtime_does_not_train_in_float8_offers_the_plans_the_float8_search_finds(capsys):
    """Llama 3 70B on 256 H100s: the 16-bit plan takes tensor parallelism, which the runtime does not train in
    float8; the offer is then the fastest plan of each recipe without it, here faster than the 16-bit plan and
    so the plan `plan --float8 RECIPE` chooses."""
    import json

    from autoshard import cli

    argv = ["plan", "llama3-70b", "--cluster", "32x8xH100-80GB", "--global-batch", "512", "--json"]
    assert cli.main(argv) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert dict(bf16["mesh"]).get("tp", 1) > 1 and bf16["float8_offer"] == {}
    assert set(bf16["float8_search"]) == {"tensorwise", "rowwise"}
    assert cli.main([*argv, "--float8", "tensorwise"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    offered = bf16["float8_search"]["tensorwise"]
    assert offered["mesh"] == fp8["mesh"] and not any(a.startswith("tp") for a, _ in offered["mesh"])
    assert offered["tokens_per_s"] == pytest.approx(fp8["predicted"]["tokens_per_s"])
    assert fp8["float8_search"] is None  # asked for float8: nothing to offer


def test_the_float8_search_offers_no_plan_where_only_layouts_the_runtime_does_not_train_in_float8_fit():
    """One sample on 2 H100s: no data-parallel layout exists, and the search's tensor-parallel plan keeps 16-bit
    GEMMs (the runtime does not train it in float8): nothing to offer. With 4 samples data parallelism fits."""
    from autoshard.api import float8_searches, load_graph

    graph = load_graph(TINY_LLAMA)
    h100 = ClusterSpec.parse("1x2xH100-80GB")
    assert float8_searches(TINY_LLAMA, graph, h100, global_batch=1, space="dp,zero,tp1d") == \
        {"tensorwise": None, "rowwise": None}
    found = float8_searches(TINY_LLAMA, graph, h100, global_batch=4, space="dp,zero,tp1d")
    assert {r: p.float8 for r, p in found.items()} == {"tensorwise": "tensorwise", "rowwise": "rowwise"}


def test_a_float8_plan_request_answered_on_a_16_bit_layout_says_so(capsys):
    """One sample on 2 H100s fits only tensor parallelism, which the runtime trains in 16 bits: `plan --float8`
    returns that plan with its GEMMs in 16 bits and a caution naming why and what to search instead."""
    import json

    from autoshard import cli

    assert cli.main(["plan", TINY_LLAMA, "--cluster", "1x2xH100-80GB", "--global-batch", "1", "--float8",
                     "tensorwise", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["float8"] == "none" and dict(out["mesh"]).get("tp") == 2
    assert any("asked for float8 (tensorwise)" in w and "tensor parallelism" in w and "--space dp,zero,pp" in w
               for w in out["warnings"])


def test_autoparallel_asked_for_float8_logs_when_the_fastest_plan_stays_16_bit(caplog):
    import logging

    from autoshard.planner.for_runtime import make_runtime_plan
    from autoshard.planner.search import Lowering

    with caplog.at_level(logging.WARNING, logger="autoshard.planner.for_runtime"):
        plan = make_runtime_plan(None, ClusterSpec.parse("1x2xH100-80GB"), (), global_batch=1,
                                 graph=load_graph(TINY_LLAMA), lowering=Lowering(float8="tensorwise"))
    assert plan.mesh.tp_axes and not plan.float8
    assert any("float8='tensorwise' was asked for" in r.getMessage() for r in caplog.records)


def test_gpu_check_judges_a_float8_plans_loss_against_its_16_bit_twin():
    from autoshard.validation.gpu_check import FLOAT8_LOSS_RTOL, Run, _compare_float8_losses

    runs = (Run(name="bf16", model="m", global_batch=8, micro_batch=1, compile=True),
            Run(name="fp8", model="m", global_batch=8, micro_batch=1, compile=True, float8="tensorwise"),
            Run(name="fp8-far", model="m", global_batch=8, micro_batch=2, compile=True, float8="tensorwise"),
            Run(name="bf16-mb2", model="m", global_batch=8, micro_batch=2, compile=True))
    rows = [{"ok": True, "losses": [10.0, 9.0]}, {"ok": True, "losses": [10.05, 9.09]},
            {"ok": True, "losses": [10.0, 9.9]}, {"ok": True, "losses": [10.0, 9.0]}]
    _compare_float8_losses(rows, runs)
    assert rows[1]["float8_loss_diff"] == pytest.approx(0.01) and rows[1]["float8_loss_ok"]
    assert rows[2]["float8_loss_diff"] == pytest.approx(0.1) and not rows[2]["float8_loss_ok"]
    assert 0.01 < FLOAT8_LOSS_RTOL < 0.1 and "float8_loss_diff" not in rows[0]


def test_estimates_configuration_line_names_compiled_blocks_and_the_float8_recipe(capsys):
    from autoshard.cli import main

    assert main(["estimate", TINY_LLAMA, "--cluster", "1x2xH100-80GB", "--global-batch", "4", "--compile",
                 "--float8", "tensorwise", "--quiet"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith(", compiled blocks, float8 tensorwise")
