"""What the GPU waits for: its host issuing eager ops (cost_models/host.py), and where full recompute stops."""

import dataclasses

import pytest

from autoshard.api import estimate_config, load_graph
from autoshard.cost_models.evaluate import recompute_stops_before
from autoshard.cost_models.host import BACKWARD_DISPATCHES
from autoshard.cost_models.template import PLANNED_KINDS
from autoshard.hardware_profiles import ClusterSpec
from autoshard.planner.estimate import HandConfig, estimate

TINY_LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32"


def _with_host(spec: str, **costs) -> ClusterSpec:
    cluster = ClusterSpec.parse(spec)
    base = dict(host_us_per_op=0.0, dtensor_us_per_op=0.0, fsdp_us_per_module=0.0, optimizer_us_per_tensor=0.0)
    return dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, **{**base, **costs}))


def test_a_host_bound_micro_batch_takes_its_dispatches_times_the_host_cost_forward_and_backward():
    graph = load_graph(TINY_LLAMA)
    host_us = 1000.0  # far above any kernel of this model: every phase waits for the host
    cluster = _with_host("1x1xH200-141GB", host_us_per_op=host_us)
    plan, _ = estimate(graph, cluster, HandConfig(dp=1, micro_batch=1, global_batch=4))
    dispatches = sum(op.dispatches for op in graph.ops if op.kind in PLANNED_KINDS)
    per_micro_batch = dispatches * host_us * 1e-6 * (1 + BACKWARD_DISPATCHES)
    t = plan.prediction.time
    assert t.compute_s + t.host_bound_s == pytest.approx(4 * per_micro_batch)
    assert t.host_bound_s > 0.99 * 4 * per_micro_batch
    assert plan.prediction.iteration_time_s == pytest.approx(4 * per_micro_batch + t.optimizer_s)


def test_gpt2_small_on_an_h200_waits_for_its_host_and_a_wide_model_at_4096_tokens_does_not():
    small, _ = estimate_config("gpt2", "1x1xH200-141GB", dp=1, micro_batch=1, global_batch=4)
    assert small.prediction.time.host_bound_s > small.prediction.time.compute_s
    wide, _ = estimate_config("llama:layers=2,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=32000,seq=4096",
                              "1x1xH200-141GB", dp=1, micro_batch=1, global_batch=4)
    assert wide.prediction.time.host_bound_s == 0.0


def test_cpu_ranks_pay_their_host_as_device_time_and_never_wait():
    plan, _ = estimate_config(TINY_LLAMA, "1x2xcpu", dp=2, micro_batch=1, global_batch=4)
    assert plan.prediction.time.host_bound_s == 0.0


def test_the_optimizer_on_a_gpu_takes_the_longer_of_its_kernels_and_its_per_tensor_host_work():
    graph = load_graph(TINY_LLAMA)
    tensors = sum(1 for op in graph.ops for p in op.params if p.owner)
    slow_host = _with_host("1x1xH200-141GB", optimizer_us_per_tensor=10_000.0)
    plan, _ = estimate(graph, slow_host, HandConfig(dp=1, micro_batch=1, global_batch=1))
    assert plan.prediction.time.optimizer_s == pytest.approx(tensors * 10_000e-6)
    kernels_only, _ = estimate(graph, _with_host("1x1xH200-141GB"), HandConfig(dp=1, micro_batch=1, global_batch=1))
    assert 0 < kernels_only.prediction.time.optimizer_s < 1e-3


def test_full_recompute_stops_before_the_last_matmul_of_a_llama_block_and_the_closing_add():
    """torch's non-reentrant checkpoint stops once the block's last saved tensor is saved again; down_proj saves
    its input before its GEMM runs, so neither its GEMM nor the residual add after it is recomputed."""
    graph = load_graph(TINY_LLAMA)
    assert recompute_stops_before(graph) == {f"model.layers.{i}.{op}" for i in (0, 1) for op in ("mlp.down_proj",
                                                                                                 "add_1")}
    cluster = _with_host("1x1xH200-141GB")
    full, _ = estimate(graph, cluster, HandConfig(dp=1, micro_batch=1, global_batch=1, recompute="full"))
    none, _ = estimate(graph, cluster, HandConfig(dp=1, micro_batch=1, global_batch=1))
    extra = full.prediction.time.compute_s - none.prediction.time.compute_s
    down = [op for op in graph.ops if op.name.endswith("mlp.down_proj")]
    from autoshard.cost_models.context import PlanContext
    from autoshard.cost_models.opcost import kernel_times_s
    from autoshard.plans.layouts import MeshSpec
    from autoshard.plans.strategies import strategies_for

    ctx = PlanContext(mesh=MeshSpec.of(), cluster=cluster, micro_batch=1)

    def forward_s(ops) -> float:
        return sum(kernel_times_s(op, strategies_for(op, ctx.mesh, 1)[0], ctx)[0] for op in ops)

    blocks = [op for op in graph.ops if op.layer is not None and op.kind in PLANNED_KINDS]
    skipped = [op for op in blocks if op.name in recompute_stops_before(graph)]
    assert extra == pytest.approx(forward_s(blocks) - forward_s(skipped), rel=1e-6)
    assert forward_s([op for op in skipped if op in down]) > 0


def test_a_fused_loss_keeps_fsdps_hooks_and_the_optimizers_per_tensor_host_work_and_megatrons_kernels_drop_them():
    # llm-foundry swaps the loss kernel but runs FSDP and a torch optimizer: their host costs stay; Megatron's
    # engine (fused kernels: its own DDP and fused Adam) pays neither
    kw = dict(dp=1, micro_batch=1, global_batch=1)
    eager, _ = estimate_config(TINY_LLAMA, "1x1xH200-141GB", **kw)
    fused_loss, _ = estimate_config(TINY_LLAMA, "1x1xH200-141GB", fused_loss=True, **kw)
    megatron, _ = estimate_config(TINY_LLAMA, "1x1xH200-141GB", fused_kernels=True, **kw)
    assert fused_loss.prediction.time.optimizer_s == pytest.approx(eager.prediction.time.optimizer_s)
    assert megatron.prediction.time.optimizer_s < eager.prediction.time.optimizer_s / 10
