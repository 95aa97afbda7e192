"""The cost model's mechanisms, each against its closed form or its source (issue 14)."""

import pytest

from autoshard.capture import capture_model
from autoshard.cost_models.compute import gemm_time_s, measured_gemm_tflops
from autoshard.cost_models.context import PlanContext
from autoshard.cost_models.evaluate import dp_units, op_sites, selective_keeps
from autoshard.cost_models.memory import ALLOCATOR_FRAGMENTATION
from autoshard.cost_models.opcost import op_cost
from autoshard.cost_models.overlap import exposed_comm_s
from autoshard.hardware_profiles import ClusterSpec, load_gpu
from autoshard.models import load_model
from autoshard.planner.estimate import HandConfig, estimate
from autoshard.plans.layouts import Layout, MeshSpec
from autoshard.plans.strategies import strategies_for

TINY_LLAMA_SPEC = "llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32"

LLAMA = "llama:layers=4,hidden=256,heads=4,ffn=688,seq=128,vocab=512"


def _kernels_only(spec: str) -> ClusterSpec:
    """The cluster with its GPU's host costs left out: the tiny fixture model is bound by its host on a GPU
    (cost_models/host.py), which would hide the kernel-level mechanism a test is about."""
    import dataclasses

    cluster = ClusterSpec.parse(spec)
    gpu = dataclasses.replace(cluster.gpu, host_us_per_op=0.0, dtensor_us_per_op=0.0, fsdp_us_per_module=0.0,
                              optimizer_us_per_tensor=0.0)
    return dataclasses.replace(cluster, gpu=gpu)


@pytest.fixture(scope="module")
def llama():
    return capture_model(load_model(LLAMA))


# -- overlap ----------------------------------------------------------------------------------------------
def test_overlapped_communication_costs_its_first_unit_and_the_compute_it_slows():
    # comm shorter than compute: the first of 4 units is exposed, the rest slow compute by 1 - 1/s of itself
    assert exposed_comm_s(10.0, 4.0, units=4, slowdown=1.25) == pytest.approx(1.0 + 3.0 * 0.2)
    # comm longer than compute x slowdown: what outlasts compute is exposed
    assert exposed_comm_s(2.0, 8.0, units=4, slowdown=1.25) == pytest.approx(2.0 + 6.0 - 2.0)
    assert exposed_comm_s(5.0, 0.0, units=3, slowdown=1.5) == 0.0


def test_once_per_step_traffic_hides_where_the_runtime_issues_it_on_a_link_its_phase_may_already_fill():
    """ZeRO-1/2's gather overlaps the first forward, ZeRO-0/1's reduction the last backward, each sharing the link
    with that phase's own traffic: a free link hides all but the first unit, a saturated one nothing."""
    from autoshard.cost_models.evaluate import _Stage, iteration_sync_s
    from autoshard.plans.plan import PipelineSpec

    cluster = ClusterSpec.parse("1x8xA100-80GB")
    ctx = PlanContext(mesh=MeshSpec.of(dp=8), cluster=cluster, micro_batch=1, num_microbatches=4)
    s, pipe = ctx.gpu.overlap_slowdown, PipelineSpec()
    free = _Stage(fwd=1.0, bwd=2.0, dp_iter_fwd=0.4, dp_iter=0.8, units=4)
    assert iteration_sync_s(free, ctx, pipe, 4) == pytest.approx(
        exposed_comm_s(1.0, 0.4, units=4, slowdown=s) + exposed_comm_s(2.0, 0.8, units=4, slowdown=s))
    # the forward's own ZeRO-3 gathers and the backward's reduce-scatters already outlast their compute
    full = _Stage(fwd=1.0, bwd=2.0, dp_fwd=3.0, dp_bwd=6.0, dp_iter_fwd=0.4, dp_iter=0.8, units=4)
    assert iteration_sync_s(full, ctx, pipe, 4) == pytest.approx(0.4 + 0.8)
    # the backward's length does not hide the forward's gather
    longer = _Stage(fwd=1.0, bwd=20.0, dp_iter_fwd=0.4, units=4)
    assert iteration_sync_s(longer, ctx, pipe, 4) == pytest.approx(exposed_comm_s(1.0, 0.4, units=4, slowdown=s))


def test_a_pipeline_stage_reduces_its_gradients_after_its_last_backward_hidden_only_by_the_drain():
    """torch.distributed.pipelining's REDUCE_GRAD follows the stage's last backward (Megatron-LM's all-reduce
    the pipeline flush): in a pipeline the reduction is exposed, less what the stage's earlier finish hides."""
    from autoshard.cost_models.evaluate import _Stage, iteration_sync_s
    from autoshard.plans.plan import PipelineSpec

    cluster = ClusterSpec.parse("2x8xA100-80GB")
    ctx = PlanContext(mesh=MeshSpec.of(pp=2, dp=8), cluster=cluster, micro_batch=1, num_microbatches=4)
    pipe = PipelineSpec(degree=2, stage_layers=((0, 2), (2, 4)))
    st = _Stage(fwd=1.0, bwd=2.0, dp_iter=0.8, units=4)
    assert iteration_sync_s(st, ctx, pipe, 4) == pytest.approx(0.8)  # the first stage: all of it
    assert iteration_sync_s(st, ctx, pipe, 4, drain_s=0.5) == pytest.approx(0.3)
    assert iteration_sync_s(st, ctx, pipe, 4, drain_s=2.0) == 0.0
    flat = PlanContext(mesh=MeshSpec.of(dp=8), cluster=cluster, micro_batch=1, num_microbatches=4)
    assert iteration_sync_s(st, flat, PipelineSpec(), 4) < 0.8  # beside the last backward without a pipeline


def test_recompute_never_makes_a_comm_bound_zero2_step_faster():
    """A ZeRO-2 step whose backward is bound by its reduce-scatters: recompute lengthens the backward, which hid
    the step's gather twice over when the model put that gather there (1-2% faster with recompute)."""
    graph = capture_model(load_model("gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=51200"))
    cluster = ClusterSpec.parse("64x8xH100-80GB")
    t = {}
    for rc in ("none", "selective", "full"):
        plan, _ = estimate(graph, cluster, HandConfig(dp=512, micro_batch=1, global_batch=4096, zero=2, recompute=rc))
        t[rc] = plan.prediction.iteration_time_s
        assert plan.prediction.time.exposed_comm_s > 0.2 * plan.prediction.time.compute_s  # comm-bound case
    assert t["none"] <= t["selective"] * (1 + 1e-9) and t["selective"] <= t["full"] * (1 + 1e-9)


def test_overlap_is_never_free_on_the_datasheet_gpus():
    for name in ("A100-80GB", "H100-80GB", "H200-141GB", "V100-32GB", "V100-16GB"):
        assert load_gpu(name).overlap_slowdown > 1.0


# -- sustained tensor-core rate ------------------------------------------------------------------------------
def test_tensor_core_work_runs_at_the_sustained_clock_and_memory_bound_kernels_do_not():
    import dataclasses

    from autoshard.cost_models.compute import fused_attention_time_s, memory_bound_time_s

    # the measured ratios: best sustained GEMM over best burst (H200, all 8 GPUs busy; A100 after 10k warm-ups)
    assert load_gpu("H100-80GB").sustained_tensor_fraction == pytest.approx(698.6 / 823.9, abs=1e-3)
    assert load_gpu("A100-80GB").sustained_tensor_fraction == pytest.approx(256.5 / 267.9, abs=1e-3)
    for name in ("H100-80GB", "A100-80GB"):
        gpu = load_gpu(name)
        burst = dataclasses.replace(gpu, sustained_tensor_fraction=1.0)
        launch = gpu.kernel_launch_us * 1e-6
        assert (gemm_time_s(8192, 8192, 8192, gpu) - launch) == pytest.approx(
            (gemm_time_s(8192, 8192, 8192, burst) - launch) / gpu.sustained_tensor_fraction)
        assert (fused_attention_time_s(1e13, 1e6, gpu) - launch) == pytest.approx(
            (fused_attention_time_s(1e13, 1e6, burst) - launch) / gpu.sustained_tensor_fraction)
        assert memory_bound_time_s(1e9, gpu) == memory_bound_time_s(1e9, burst)
    # V100: the one measured rate, 101 TFLOPS at 8192^3, was taken on a PCIe card at its 1.38 GHz boost; the
    # SXM2's 125 TFLOPS assumes 1.53 GHz, which nothing measured shows it holding: the best GEMM is the measured one
    for name in ("V100-32GB", "V100-16GB"):
        v100 = load_gpu(name)
        assert v100.sustained_tensor_fraction == pytest.approx(1.38 / 1.53, abs=1e-3)
        best_tflops = 2 * 8192**3 / (gemm_time_s(8192, 8192, 8192, v100) - v100.kernel_launch_us * 1e-6) / 1e12
        assert best_tflops == pytest.approx(101, rel=0.02)  # less the model's wave quantization on 80 SMs


def test_fused_attention_follows_the_measured_curve_by_sequence_length_and_one_figure_without_it(tmp_path):
    import dataclasses

    from autoshard.cost_models.compute import fused_attention_time_s, max_attention_efficiency

    gpu = dataclasses.replace(load_gpu("A100-80GB"), flash_attention_by_seq=((4096, 0.6), (1024, 0.3)))
    assert gpu.flash_attention_by_seq == ((1024, 0.3), (4096, 0.6))  # sorted by length
    launch, flops, rate = gpu.kernel_launch_us * 1e-6, 1e13, gpu.sustained_tflops * 1e12

    def eff(seq):
        return flops / ((fused_attention_time_s(flops, 1e6, gpu, seq=seq) - launch) * rate)

    assert eff(2048) == pytest.approx(0.45)  # halfway in log2(seq)
    assert eff(256) == pytest.approx(0.3) and eff(65536) == pytest.approx(0.6)  # clamped at the ends
    assert eff(None) == pytest.approx(gpu.flash_attention_efficiency)  # no length: the one figure
    # the masked kernel has no curve; the bounds take the best of everything measured
    assert fused_attention_time_s(flops, 1e6, gpu, kernel="masked", seq=2048) == \
        fused_attention_time_s(flops, 1e6, gpu, kernel="masked")
    assert max_attention_efficiency(dataclasses.replace(gpu, flash_attention_by_seq=((1024, 0.9),))) == 0.9
    # a measured profile file carries the curve through `--cluster FILE`
    text = ("nodes: 1\ngpus_per_node: 8\ngpu:\n  name: A100-measured\n  peak_tflops: 312\n  fp32_tflops: 19.5\n"
            "  hbm_gbps: 2039\n  memory_gib: 80\n  num_sms: 108\n  max_gemm_efficiency: 0.85\n"
            "  hbm_efficiency: 0.8\n  kernel_launch_us: 4\n  flash_attention_efficiency: 0.5\n"
            "  flash_attention_by_seq: [[1024, 0.3], [4096, 0.6]]\nintra: nvswitch-a100\ninter: ib-hdr-8x200\n")
    (tmp_path / "c.yaml").write_text(text)
    assert ClusterSpec.parse(str(tmp_path / "c.yaml")).gpu.flash_attention_by_seq == ((1024, 0.3), (4096, 0.6))
    # full-score-matrix FLOPs: a causal kernel may pass 1 (it skips half), never 2
    assert dataclasses.replace(gpu, flash_attention_by_seq=((1024, 1.5),)).flash_attention_by_seq == ((1024, 1.5),)
    with pytest.raises(ValueError, match="flash_attention_by_seq"):
        dataclasses.replace(gpu, flash_attention_by_seq=((1024, 2.5),))


# -- data-parallel units -------------------------------------------------------------------------------------
def test_zero3_collectives_pay_their_latency_once_per_block_not_per_op(llama):
    cluster = ClusterSpec.parse("16x8xA100-80GB")
    ctx = PlanContext(mesh=MeshSpec.of(dp=128), cluster=cluster, micro_batch=1)
    op = next(o for o in llama.ops if o.layer == 0 and o.kind.value == "linear")
    st = next(s for s in strategies_for(op, ctx.mesh, 1) if s.zero == 3 and s.split == 1)
    alone = op_cost(op, st, ctx).dp_fwd_s
    in_block = op_cost(op, st, ctx, unit_numel=dp_units(llama)[op.name]).dp_fwd_s
    assert in_block < alone
    block = [o for o in llama.ops if o.layer == 0 and o.params]
    share = sum(op_cost(o, next(s for s in strategies_for(o, ctx.mesh, 1) if s.zero == 3 and s.split == 1), ctx,
                        **op_sites(llama)[o.name]).dp_fwd_s for o in block)
    gather = ctx.collective_s("all_gather", dp_units(llama)[op.name] * 2, ("dp",))
    assert share == pytest.approx(gather, rel=1e-9)  # the block's ops together pay one gather of the block


def test_planner_offers_every_zero_level_to_ops_with_parameters(llama):
    op = next(o for o in llama.ops if o.kind.value == "linear")
    assert {s.zero for s in strategies_for(op, MeshSpec.of(dp=4), 1)} == {0, 1, 2, 3}


def test_zero1_reduces_and_gathers_once_per_step_and_zero2_reduces_every_micro_batch(llama):
    """Where the runtime issues them (runtime/data_parallel.py set_microbatch): ZeRO-0 all-reduces and ZeRO-1
    reduce-scatters after the last backward, ZeRO-1 and -2 gather in the first forward, ZeRO-2 and -3
    reduce-scatter in every backward, ZeRO-3 gathers in every forward and backward."""
    cluster = ClusterSpec.parse("1x8xA100-80GB")
    ctx = PlanContext(mesh=MeshSpec.of(dp=8), cluster=cluster, micro_batch=1, num_microbatches=4)
    op = next(o for o in llama.ops if o.kind.value == "linear")
    by_zero = {s.zero: op_cost(op, s, ctx) for s in strategies_for(op, ctx.mesh, 1) if s.split == 1}
    assert by_zero[0].dp_iter_s > 0 and by_zero[0].dp_iter_fwd_s == 0 and by_zero[0].dp_bwd_s == 0
    assert by_zero[1].dp_bwd_s == 0 and by_zero[1].dp_iter_s > 0 and by_zero[1].dp_iter_fwd_s > 0
    assert by_zero[2].dp_bwd_s > 0 and by_zero[2].dp_iter_s == 0 and by_zero[2].dp_iter_fwd_s > 0
    assert by_zero[3].dp_fwd_s > 0 and by_zero[3].dp_iter_s == 0 and by_zero[3].dp_iter_fwd_s == 0
    # ZeRO-1's gather is ZeRO-2's: the same parameters, once per step
    assert by_zero[1].dp_iter_fwd_s == pytest.approx(by_zero[2].dp_iter_fwd_s)


def test_a_pipeline_stage_holds_zero2_and_zero3_gradients_whole_and_reduces_them_once_per_step(llama):
    """torch.distributed.pipelining defers FSDP's reduction to the step's end (PlanContext.grads_reduced_per_step;
    measured in tests/distributed/test_pipeline.py): ZeRO-2 and -3 in a pipeline hold ZeRO-1's states, reduce
    once per step, and gather once per step, in the first forward (runtime/pipeline.py `_gather_once_per_step`)."""
    cluster = ClusterSpec.parse("2x8xA100-80GB")
    flat = PlanContext(mesh=MeshSpec.of(dp=8), cluster=cluster, micro_batch=1, num_microbatches=4)
    piped = PlanContext(mesh=MeshSpec.of(pp=2, dp=8), cluster=cluster, micro_batch=1, num_microbatches=4)
    op = next(o for o in llama.ops if o.kind.value == "linear")
    costs = {(name, s.zero): op_cost(op, s, ctx) for name, ctx in (("flat", flat), ("piped", piped))
             for s in strategies_for(op, flat.mesh, 1) if s.split == 1}
    for zero in (2, 3):
        c = costs[("piped", zero)]
        assert c.grad_bytes == costs[("piped", 1)].grad_bytes > costs[("flat", zero)].grad_bytes
        assert c.param_bytes == costs[("piped", 1)].param_bytes
        assert c.dp_iter_s == pytest.approx(costs[("piped", 1)].dp_iter_s)  # the one reduce-scatter
        assert c.dp_bwd_s == 0 < costs[("flat", zero)].dp_bwd_s
        assert ("reduce_scatter", c.iter_comm[0][1]) in c.iter_comm and all(k != "reduce_scatter" for k, _ in c.comm)
    piped3, piped2 = costs[("piped", 3)], costs[("piped", 2)]
    assert piped3.dp_fwd_s == 0 and piped2.dp_iter_fwd_s > 0  # gathered once a step, as ZeRO-2
    assert piped3.dp_iter_fwd_s == pytest.approx(piped2.dp_iter_fwd_s)
    assert costs[("flat", 3)].dp_fwd_s > 0  # without a pipeline ZeRO-3 gathers for every forward


def test_a_pipelines_last_stage_holds_its_own_copy_of_a_tied_embedding():
    """GPT's head shares the word embedding: in a 2-stage pipeline the last stage holds a copy, priced like any
    parameter it owns (evaluate.with_stage_copies); without a pipeline there is one."""
    from autoshard.api import capture_ref

    graph = capture_ref("gpt:layers=4,hidden=256,heads=4,seq=128,vocab=512")
    cfg = dict(tp=1, dp=1, cp=1, cp_attention="allgather", micro_batch=1, global_batch=4, recompute="none",
               sequence_parallel=False, schedule=None, zero=0, fused_kernels=False, fused_loss=False,
               zero_impl="fsdp2", tp_comm_overlap="", allocator="expandable", precision=None, ep=1,
               ep_imbalance=None, compile=False, float8="")
    _, one = estimate(graph, ClusterSpec.parse("1x1xA100-80GB"), HandConfig(pp=1, virtual_stages=1, **cfg))
    _, two = estimate(graph, ClusterSpec.parse("1x2xA100-80GB"), HandConfig(pp=2, virtual_stages=1, **cfg))
    embedding = 512 * 256 * 2  # bf16 working copy
    held = sum(m.params_bytes for m in two.stage_memory)
    assert held == pytest.approx(one.stage_memory[0].params_bytes + embedding)
    assert two.op_costs["lm_head"].param_bytes == embedding and one.op_costs["lm_head"].param_bytes == 0


def test_torch_pipelining_keeps_each_in_flight_chunk_output_and_megatrons_schedules_free_it(llama):
    """torch.distributed.pipelining holds a chunk's output until its backward (stage.py fwd_cache; measured in
    tests/distributed/test_pipeline.py); Megatron's `deallocate_output_tensor` frees it once sent. 1F1B on
    4 stages: the first stage has 4 micro-batches in flight, each holding the 1/t slice it sent; the last holds
    one micro-batch's logits."""
    from autoshard.api import capture_ref

    graph, cluster = capture_ref(TINY_LLAMA_SPEC), ClusterSpec.parse("1x8xA100-80GB")
    kw = dict(tp=2, pp=4, dp=1, micro_batch=1, global_batch=8)

    def activations(**options) -> list[float]:
        return [m.activations_bytes for m in estimate(graph, cluster, HandConfig(**kw, **options))[1].stage_memory]

    kept, freed = activations(), activations(deallocate_pipeline_outputs=True)
    sent = 32 * 64 * 2 / 2  # seq x hidden x bf16 / tp, one sample
    logits = 32 * 128 * 2  # seq x vocab x bf16, whole on every tensor-parallel rank, one micro-batch under 1F1B
    # and torch's pipelining allocates a receive buffer per micro-batch (8) for what each cut carries each way
    recv = [8 * sent, 16 * sent, 16 * sent, 8 * sent]
    assert [k - f for k, f in zip(kept, freed, strict=True)] == pytest.approx(
        [r + x for r, x in zip(recv, [4 * sent, 3 * sent, 2 * sent, logits], strict=True)])
    assert activations(fused_kernels=True) == activations(fused_kernels=True, deallocate_pipeline_outputs=True)
    # torchtitan's async TP overlaps its collectives too, but on compiled blocks, with torch's pipelining
    assert activations(compile=True, tp_comm_overlap="all") != activations(compile=True, tp_comm_overlap="all",
                                                                          deallocate_pipeline_outputs=True)


def test_under_gpipe_the_last_stage_keeps_every_micro_batchs_log_probabilities_until_the_backward_phase():
    """The loss of each micro-batch saves its fp32 log-probabilities (log_softmax's output) until its backward:
    GPipe runs every forward first, so the last stage holds m of them (measured on 4 gloo ranks in
    tests/distributed/test_pipeline.py); 1F1B runs each backward after its forward, so it holds the one that
    `loss_per_stage` prices. A fused cross-entropy keeps a log-sum-exp per token instead."""
    from autoshard.api import capture_ref
    from autoshard.cost_models.evaluate import held_loss_bytes
    from autoshard.cost_models.template import template_for

    graph, cluster = capture_ref(TINY_LLAMA_SPEC), ClusterSpec.parse("1x4xA100-80GB")
    log_probs, tokens = 32 * 128 * 4 + 4, 32  # seq x vocab fp32 of one sample, nll_loss's total weight; per token
    for schedule, extra in (("gpipe", 7), ("1f1b", 0)):
        pipe = estimate(graph, cluster, HandConfig(pp=4, micro_batch=1, global_batch=8, schedule=schedule))[0].pipeline
        tg, stage = template_for(graph, pipe)
        for fused, per in ((False, log_probs), (True, 4 * tokens)):
            ctx = PlanContext(mesh=MeshSpec.of(pp=4), cluster=cluster, micro_batch=1, num_microbatches=8,
                              fused_loss=fused)
            assert held_loss_bytes(graph, tg.outputs, stage, ctx, pipe) == [0, 0, 0, extra * per]
            assert held_loss_bytes(graph, tg.outputs, stage, ctx, pipe, first=True)[3] == (extra + 1) * per

    def last_stage_activations(**options) -> float:
        cfg = HandConfig(pp=4, micro_batch=1, global_batch=8, schedule="gpipe", **options)
        return estimate(graph, cluster, cfg)[1].stage_memory[3].activations_bytes

    # the loss kernel is all that differs: the other 7 micro-batches' saved tensors are in the last stage's memory
    assert last_stage_activations() - last_stage_activations(fused_loss=True) == 7 * (log_probs - 4 * tokens)


def test_gradients_are_added_only_from_the_second_micro_batch_and_only_to_what_the_runtime_keeps(llama):
    """Autograd assigns a step's first gradient and adds the later ones. ZeRO-0/1 keep the full gradient across
    micro-batches (m - 1 adds of it), ZeRO-2/3 drop it after each reduce-scatter and add only the 1/dp shard;
    Megatron's engine adds every micro-batch into its main_grad buffer, except a Linear's weight, whose
    weight-gradient GEMM accumulates into it (gradient accumulation fusion). Sums are fp32 under bf16 mixed
    precision (FSDP2's reduce dtype, Megatron's main_grad): a bf16 gradient into an fp32 sum, an fp32 shard into
    an fp32 shard."""
    from autoshard.cost_models.compute import memory_bound_time_s
    from autoshard.cost_models.opcost import _grad_accumulation_s

    cluster = ClusterSpec.parse("1x8xA100-80GB")
    linear = next(o for o in llama.ops if o.kind.value == "linear" and o.params)
    norm = next(o for o in llama.ops if o.kind.value == "norm" and o.params)

    def add(op, numel, new=2):  # read the fp32 sum and the new gradient (bf16, or an fp32 shard), write the sum
        return memory_bound_time_s(numel * (new + 4 + 4), cluster.gpu, kernels=len(op.params))

    def accumulate(op, zero, m, fused=False):
        ctx = PlanContext(mesh=MeshSpec.of(dp=8), cluster=cluster, micro_batch=1, num_microbatches=m,
                          fused_pointwise=fused)
        st = next(s for s in strategies_for(op, ctx.mesh, 1) if s.zero == zero and s.split == 1)
        return _grad_accumulation_s(op, st, ctx)

    numel = sum(p.numel for p in linear.params if p.owner)
    assert accumulate(linear, 0, 1) == 0 and accumulate(linear, 3, 1) == 0
    assert accumulate(linear, 0, 4) == pytest.approx(0.75 * add(linear, numel))
    assert accumulate(linear, 3, 4) == pytest.approx(0.75 * add(linear, numel / 8, new=4))
    assert accumulate(linear, 3, 1, fused=True) == 0  # Llama's Linears have no bias: nothing left to add
    norm_numel = sum(p.numel for p in norm.params if p.owner)
    assert accumulate(norm, 3, 1, fused=True) == pytest.approx(add(norm, norm_numel))


# -- compute ------------------------------------------------------------------------------------------------
def _adamw_step_bytes(foreach: bool, numel_each: int = 4096, count: int = 3) -> float:
    """Bytes the ATen ops of one torch.optim.AdamW step read and write over fp32 parameters, per op: its distinct
    tensor arguments read once each, the ones its schema mutates written, and its new outputs written."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    total = 0

    def tensors(x):
        return {(t.data_ptr(), t.numel()): t.numel() * t.element_size()
                for t in tree_leaves(x) if isinstance(t, torch.Tensor) and t.numel() > 1}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal total
            out = func(*args, **(kwargs or {}))
            read = tensors((args, kwargs))
            mutated = [a for a, arg in zip(args, func._schema.arguments, strict=False)
                       if arg.alias_info is not None and arg.alias_info.is_write]
            written = {**tensors(mutated), **{k: v for k, v in tensors(out).items() if k not in read}}
            total += sum(read.values()) + sum(written.values())
            return out

    params = [torch.nn.Parameter(torch.randn(numel_each)) for _ in range(count)]
    for q in params:
        q.grad = torch.randn(numel_each)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    opt.step()  # creates the moments
    with Count():
        opt.step()
    return total / (numel_each * count)


@pytest.mark.parametrize("foreach", [False, True])
def test_the_optimizer_step_moves_the_bytes_torchs_adamw_passes_read_and_write(foreach):
    """torch.optim.AdamW (the runtime's optimizer; single-tensor on CPU, foreach on GPU) makes eight passes over
    parameter, gradient, moments and a temporary: 80 bytes per fp32 parameter, not a fused kernel's 28. Under bf16
    mixed precision it steps the fp32 parameters on their fp32 gradients (FSDP2's sharded parameters, reduce dtype
    fp32): the same 80; a fused kernel also writes the bf16 copy (32)."""
    from autoshard.cost_models.memory import BF16_MIXED, FP32, optimizer_step_bytes

    assert _adamw_step_bytes(foreach) == pytest.approx(optimizer_step_bytes(1, FP32), rel=0.02)
    assert optimizer_step_bytes(1, FP32) == 80
    assert optimizer_step_bytes(1, FP32, fused=True) == 28  # read p, g, m, v; write p, m, v
    assert optimizer_step_bytes(1, BF16_MIXED) == 80 and optimizer_step_bytes(1, BF16_MIXED, fused=True) == 32


def test_megatrons_engine_steps_with_a_fused_adam_and_the_runtime_with_torchs(llama):
    cluster = _kernels_only("1x8xA100-80GB")
    cfg = dict(dp=8, micro_batch=1, global_batch=8)
    eager = estimate(llama, cluster, HandConfig(**cfg))[0].prediction.time.optimizer_s
    fused = estimate(llama, cluster, HandConfig(fused_kernels=True, **cfg))[0].prediction.time.optimizer_s
    launch = load_gpu("A100-80GB").kernel_launch_us * 1e-6  # 8 passes against one kernel
    assert (eager - 8 * launch) == pytest.approx((fused - launch) * 80 / 32, rel=1e-6)


def test_measured_gemm_grid_is_interpolated_in_log_space_and_clamped():
    table = tuple((m, n, k, float(m * n * k) ** 0.25) for m in (64, 256, 1024) for n in (64, 256, 1024)
                  for k in (64, 256, 1024))
    assert measured_gemm_tflops(table, 256, 256, 256) == pytest.approx(256 ** 0.75)
    assert measured_gemm_tflops(table, 128, 128, 128) == pytest.approx(128 ** 0.75)  # a power law is exact
    assert measured_gemm_tflops(table, 8192, 1024, 1024) == pytest.approx(1024 ** 0.75)  # clamped
    gpu = load_gpu("cpu")
    from dataclasses import replace

    measured = replace(gpu, gemm_tflops=table, kernel_launch_us=1.0)
    assert gemm_time_s(256, 256, 256, measured) == pytest.approx(2 * 256 ** 3 / (256 ** 0.75 * 1e12) + 1e-6)


def test_eager_kernels_read_and_write_every_intermediate(llama):
    """RMSNorm in Hugging Face's Llama is six ATen kernels, its statistics in float32: eager costs more than
    one fused pass; --fused-kernels prices one pass per pointwise region."""
    norm = next(o for o in llama.ops if o.kind.value == "norm")
    assert norm.kernels >= 6 and norm.kernel_io_wide_numel > 0
    cluster = ClusterSpec.parse("1x8xA100-80GB")
    eager = PlanContext(mesh=MeshSpec.of(dp=8), cluster=cluster, micro_batch=4)
    fused = PlanContext(mesh=MeshSpec.of(dp=8), cluster=cluster, micro_batch=4, fused_pointwise=True)
    st = strategies_for(norm, eager.mesh, 4)[0]
    assert op_cost(norm, st, eager).fwd_s > 3 * op_cost(norm, st, fused).fwd_s


def test_fused_kernels_run_the_scale_and_mask_of_materialized_scores_inside_the_softmax():
    """Megatron-LM's FusedScaleMaskSoftmax: the (B, heads, s, s) scores are read once by the softmax kernel,
    not first by a scale and a mask of their own; eager PyTorch runs those as kernels of their own."""
    from autoshard.api import load_graph
    from autoshard.capture.ir import OpKind
    from autoshard.cost_models.opcost import score_shaped

    graph = load_graph("gpt:layers=2,hidden=512,heads=8,seq=1024,vocab=8192", attention="eager")
    scaled = [o for o in graph.ops if o.kind is OpKind.ELEMENTWISE and score_shaped(o.output_meta, graph.seq_len)]
    softmax = next(o for o in graph.ops if o.kind is OpKind.SOFTMAX)
    assert scaled  # the model scales (and masks) its scores before the softmax
    cluster = ClusterSpec.parse("1x8xA100-80GB")
    kw = {"mesh": MeshSpec.of(dp=8), "cluster": cluster, "micro_batch": 4, "seq": graph.seq_len}
    eager, fused = PlanContext(**kw), PlanContext(**kw, fused_pointwise=True)
    for op in scaled:
        st = strategies_for(op, eager.mesh, 4)[0]
        assert op_cost(op, st, eager).fwd_s > 0
        assert op_cost(op, st, fused).time_s == 0.0
    st = strategies_for(softmax, eager.mesh, 4)[0]
    assert op_cost(softmax, st, fused).fwd_s > 0  # the softmax still reads the scores and writes the probabilities


# -- recompute and memory -------------------------------------------------------------------------------------
def test_selective_recompute_with_fused_attention_keeps_attention_and_every_other_matmul(llama):
    keeps = selective_keeps(llama)
    block = [llama.op(n) for n in llama.blocks[0].op_names[0]]
    kept = [o.name.rsplit(".", 1)[-1] for o in block if keeps[o.name]]
    assert kept == ["q_proj", "v_proj", "scaled_dot_product_attention", "gate_proj", "down_proj"]


def test_selective_recompute_fits_where_none_does_not_and_costs_less_than_full():
    graph = capture_model(load_model("llama2-70b"))
    cluster = ClusterSpec.parse("8x8xA100-80GB")
    preds = {}
    for rc in ("none", "selective", "full"):
        plan, _ = estimate(graph, cluster, HandConfig(dp=64, micro_batch=1, global_batch=64, zero=3, recompute=rc))
        preds[rc] = plan.prediction
    gib = {rc: p.memory.total_bytes / 2**30 for rc, p in preds.items()}
    assert gib["none"] > 80 > gib["selective"] > gib["full"]  # torchtitan ran 70B with op-level AC in 80 GiB
    t = {rc: p.iteration_time_s for rc, p in preds.items()}
    assert t["none"] < t["selective"] < t["full"]


def test_memory_counts_allocator_fragmentation_on_what_is_allocated_every_step(llama):
    """PyTorch's default caching allocator loses ~15% of what is allocated per step (GMLake); expandable
    segments (torchtitan's and autoshard's runtime setting) do not."""
    cluster = ClusterSpec.parse("1x8xA100-80GB")
    expandable, _ = estimate(llama, cluster, HandConfig(dp=8, micro_batch=2, global_batch=16))
    caching, _ = estimate(llama, cluster, HandConfig(dp=8, micro_batch=2, global_batch=16, allocator="caching"))
    mem, frag = expandable.prediction.memory, caching.prediction.memory
    dynamic = frag.activations_bytes + frag.transient_bytes
    assert frag.total_bytes - mem.total_bytes == pytest.approx(ALLOCATOR_FRAGMENTATION["caching"] * dynamic)


def test_the_loss_holds_three_fp32_copies_of_the_logits_at_the_start_of_backward(llama):
    """Cross-entropy in fp32: log-probabilities, the gradient nll_loss returns and log_softmax's."""
    cluster = ClusterSpec.parse("1x8xA100-80GB")
    plan, _ = estimate(llama, cluster, HandConfig(dp=8, micro_batch=2, global_batch=16))
    logits = 2 * llama.seq_len * 512  # micro-batch x seq x vocab of the fixture's model
    assert plan.prediction.memory.transient_bytes >= 12 * logits



def test_a_fused_cross_entropy_holds_the_16bit_logits_and_their_gradient_instead_of_three_fp32_copies(llama):
    """flash-attn's CrossEntropyLoss (llm-foundry's default loss) saves the logits and writes a logit-sized
    gradient at their precision: 2 x 2 bytes per logit against eager's 3 x 4, and less HBM traffic."""
    cluster = _kernels_only("1x8xA100-80GB")
    cfg = dict(dp=8, micro_batch=2, global_batch=16)
    eager, _ = estimate(llama, cluster, HandConfig(**cfg))
    fused, _ = estimate(llama, cluster, HandConfig(**cfg, fused_loss=True))
    logits = 2 * llama.seq_len * 512  # micro-batch x seq x vocab of the fixture's model
    saved = eager.prediction.memory.transient_bytes - fused.prediction.memory.transient_bytes
    assert saved == pytest.approx((12 - 4) * logits)
    assert fused.prediction.iteration_time_s < eager.prediction.iteration_time_s
    # nothing else changes: the model's own activations and states are priced alike
    assert fused.prediction.memory.activations_bytes == eager.prediction.memory.activations_bytes

# -- ranks that share cores ------------------------------------------------------------------------------------
def test_cpu_ranks_beyond_the_cores_compute_at_their_share_and_pipelines_fill_the_idle_cores(llama):
    two = ClusterSpec.parse("1x2xcpu")  # the cpu profile: 2 cores
    four = ClusterSpec.parse("1x4xcpu")
    dp2, _ = estimate(llama, two, HandConfig(dp=2, micro_batch=4, global_batch=8))
    dp4, _ = estimate(llama, four, HandConfig(dp=4, micro_batch=2, global_batch=8))
    # four ranks on two cores: half the work each at half the speed
    assert dp4.prediction.time.compute_s == pytest.approx(dp2.prediction.time.compute_s, rel=0.15)
    pp4, _ = estimate(llama, four, HandConfig(pp=4, micro_batch=2, global_batch=8, schedule="gpipe"))
    pp4_gpu, _ = estimate(llama, ClusterSpec.parse("1x4xA100-80GB"),
                          HandConfig(pp=4, micro_batch=2, global_batch=8, schedule="gpipe"))
    assert pp4.prediction.time.bubble_s < 0.5 * pp4.prediction.iteration_time_s * 3 / 7
    assert pp4_gpu.prediction.time.bubble_s > 0


def test_tensor_parallel_collectives_pay_dtensors_measured_redistribute_cost_and_data_parallel_ones_do_not(llama):
    """The runtime issues tensor-parallel collectives through DTensor's redistribute, FSDP2 its own directly: a
    link's measured `redistribute_us` is added once per tensor-parallel collective (per micro-batch here: 2),
    at the figure of the closest group size, and to no data-parallel plan."""
    import dataclasses

    base = ClusterSpec.parse("1x2xcpu")
    extra = {k: [[2, 1000.0], [8, 5000.0]] for k in ("all_gather", "all_reduce", "reduce_scatter")}
    slow = dataclasses.replace(base, intra=dataclasses.replace(base.intra, redistribute_us=extra))
    assert slow.intra.redistribute_extra_us("all_reduce", 2) == 1000.0
    assert slow.intra.redistribute_extra_us("all_reduce", 4) == 1000.0  # 2 ranks is the closer measurement
    assert slow.intra.redistribute_extra_us("all_to_all", 2) == 0.0
    for cfg, at_least in ((HandConfig(tp=2, micro_batch=2, global_batch=4), 4 * 4),
                          (HandConfig(tp=2, sequence_parallel=True, micro_batch=2, global_batch=4), 4 * 4),
                          (HandConfig(dp=2, micro_batch=2, global_batch=4), None)):
        fast, _ = estimate(llama, base, cfg)
        paid, _ = estimate(llama, slow, cfg)
        delta_ms = (paid.prediction.iteration_time_s - fast.prediction.iteration_time_s) * 1e3
        if at_least is None:
            assert delta_ms == pytest.approx(0.0, abs=1e-9)
            continue
        collectives = delta_ms / 2  # per micro-batch, 1 ms each
        assert collectives == pytest.approx(round(collectives), abs=1e-6) and collectives >= at_least


def test_a_measured_curve_that_peaks_mid_size_is_reproduced_at_every_measured_size():
    """gloo on CPU ranks peaks at a few MB and falls beyond; the ring model's bandwidth is the curve's best point,
    so a mid-size collective is not priced at the largest one's bandwidth (it was: 2.4x too slow at 8 MB)."""
    import dataclasses

    from autoshard.cost_models.comm import GroupPlacement, bus_factor, collective_time_s

    base = ClusterSpec.parse("1x4xcpu")
    points = [[1 << 20, 0.2], [8 << 20, 0.5], [32 << 20, 0.25]]
    curve = {"all_gather": [{"ranks": 4, "points": points}]}
    intra = dataclasses.replace(base.intra, sync_us=0.0, latency_us=0.0, busbw_curve=curve)
    cluster = dataclasses.replace(base, intra=intra)
    for nbytes, busbw in points:
        want = nbytes * bus_factor("all_gather", 4) / (busbw * 1e9)
        assert collective_time_s("all_gather", nbytes, GroupPlacement(4, 4), cluster) == pytest.approx(want, rel=1e-6)


def test_a_sequence_parallel_input_is_gathered_once_per_attention_and_mlp_unless_megatrons_linears_regather(llama):
    """torchtitan (and the runtime for `col` Linears) gathers the normed sequence shard once where it is made, for
    q, k and v (gate and up) together, and keeps it gathered; Megatron-LM's column Linears each keep the shard
    and gather it again in backward (Korthikanti et al. 2022 sec. 4.2.2): 5 gathers forward and 5 in backward
    for a Llama layer with separate projections, against 2 and none."""
    cluster = ClusterSpec.parse("1x2xA100-80GB")
    whole = llama.seq_len * 256 * 2  # one sample's hidden states, bf16

    def layer0_gathers(**engine):
        _, ev = estimate(llama, cluster, HandConfig(tp=2, sequence_parallel=True, micro_batch=1, global_batch=1,
                                                    **engine))
        into = [e for (_, dst, _), e in ev.edge_costs.items()
                if dst.startswith("model.layers.0.") and dst.endswith("_proj")]
        fwd = sum(b for e in into for k, b in e.fwd_comm if k == "all_gather")
        every = sum(b for e in into for k, b in e.comm if k == "all_gather")
        return fwd / whole, (every - fwd) / whole

    assert layer0_gathers() == pytest.approx((2.0, 0.0))
    assert layer0_gathers(fused_kernels=True) == pytest.approx((5.0, 5.0))


def test_a_float8_input_under_tensor_parallelism_is_cast_once_on_its_shard_before_the_gather():
    """torchao's Float8ColwiseParallel / PrepareFloat8ModuleInput (torchtitan's float8 TP) cast the sequence shard
    to float8 and gather it in one byte, once for q, k and v: the edge prices the cast of the shard, its share
    of it, and the Linear casts no input of its own in forward."""
    from autoshard.cost_models.compute import memory_bound_time_s
    from autoshard.cost_models.float8 import cast_bytes_per_elem
    from autoshard.cost_models.opcost import edge_cost
    from autoshard.plans.layouts import SEQ, layout

    graph = capture_model(load_model(LLAMA))
    ctx = PlanContext(mesh=MeshSpec.of(tp=2), cluster=ClusterSpec.parse("1x2xH100-80GB"), micro_batch=1,
                      num_microbatches=1, float8="tensorwise", compile=True)
    q = next(op for op in graph.ops if op.name.endswith("layers.0.self_attn.q_proj"))
    per_elem = cast_bytes_per_elem("tensorwise", "fwd", "x", compiled=True)
    meta = graph.op(q.inputs[0]).output_meta
    kw = dict(share=1 / 3, gather_bytes_per_elem=1.0)
    plain = edge_cost(meta, layout(tp=SEQ), Layout(), frozenset({"tp"}), ctx, **kw)
    cast = edge_cost(meta, layout(tp=SEQ), Layout(), frozenset({"tp"}), ctx, input_cast_bytes_per_elem=per_elem, **kw)
    shard = meta.numel / 2  # the tokens one of 2 ranks holds
    assert plain.fwd_compute_s == 0 and cast.fwd_s == plain.fwd_s  # compute, not the collective's time
    assert cast.fwd_compute_s == pytest.approx(memory_bound_time_s(shard * per_elem, ctx.gpu, kernels=0) / 3)
    col = next(s for s in strategies_for(q, ctx.mesh, 1) if s.name == "col" and s.zero == 0)
    without_tp = PlanContext(mesh=MeshSpec.of(dp=2), cluster=ctx.cluster, micro_batch=1, num_microbatches=1,
                             float8="tensorwise", compile=True)
    dp_col = next(s for s in strategies_for(q, without_tp.mesh, 1) if s.zero == 0)
    x = q.gemm[0] * q.gemm[2]  # the gathered input's elements
    # data parallel: the Linear casts its whole input itself; under TP the edge did, on the shard
    assert op_cost(q, dp_col, without_tp).fwd_s - op_cost(q, col, ctx).fwd_s > 0.9 * memory_bound_time_s(
        x * per_elem, ctx.gpu, kernels=0)


def test_overlapped_tensor_parallel_collectives_hide_only_behind_the_gemm_they_are_pipelined_with():
    """--tp-comm-overlap all (Megatron-Core's userbuffers, torchtitan's async TP): a collective chunked with the
    GEMM it feeds hides up to that GEMM's time; next to no GEMM (a norm) it hides nothing. A 2-layer Llama
    with a tiny hidden size and long sequences on 8 ranks, where each gather outlasts its GEMM: the step keeps
    at least what exceeds the GEMMs exposed."""
    from autoshard.cost_models.evaluate import _beside_gemms

    graph = capture_model(load_model("llama:layers=2,hidden=64,heads=8,ffn=128,seq=4096,vocab=128"))
    cluster = _kernels_only("1x8xA100-80GB")
    cfg = dict(tp=8, micro_batch=1, global_batch=1, sequence_parallel=True, sequence_parallel_regather=True)
    none = estimate(graph, cluster, HandConfig(**cfg))[1]
    both = estimate(graph, cluster, HandConfig(**cfg, tp_comm_overlap="all"))[1]
    ctx_all = PlanContext(mesh=MeshSpec.of(tp=8), cluster=cluster, micro_batch=1, num_microbatches=1,
                          tp_overlap="all")
    q, norm = "model.layers.0.self_attn.q_proj", "model.layers.0.input_layernorm"
    gemm = both.op_costs[q].fwd_s
    assert _beside_gemms(5 * gemm, 0.0, q, norm, both.op_costs, graph, ctx_all) == pytest.approx(gemm)
    assert _beside_gemms(5 * gemm, 5 * gemm, norm, "model.embed_tokens", both.op_costs, graph, ctx_all) == 0.0
    hidden = none.prediction.time.exposed_comm_s - both.prediction.time.exposed_comm_s
    gemms = sum(c.fwd_s + c.bwd_s / 2 for n, c in both.op_costs.items() if n.endswith("_proj"))
    assert 0 < hidden <= gemms * (2 if any(c.recompute_s for c in both.op_costs.values()) else 1)


def test_async_tp_hides_a_shared_gather_beside_every_gemm_reading_it_but_not_their_summed_gradients_scatter():
    """Inductor's micro-pipeline TP (torchtitan's async TP) pipelines one all-gather with every matmul reading
    the gathered tensor (q, k and v), but fuses a reduce-scatter only with a matmul producing it, not with the
    sum of q, k and v's data gradients: that reduce-scatter stays exposed. Megatron-Core, which runs q, k and v
    as one GEMM, hides it beside that GEMM."""
    from autoshard.cost_models.evaluate import _beside_gemms
    from autoshard.cost_models.overlap import exposed_beside_s

    graph = capture_model(load_model("llama:layers=2,hidden=4096,heads=32,kv_heads=8,ffn=8192,seq=4096,vocab=128"))
    cluster = _kernels_only("1x8xA100-80GB")
    _, ev = estimate(graph, cluster, HandConfig(tp=8, micro_batch=1, global_batch=1, sequence_parallel=True,
                                                sequence_parallel_regather=False, tp_comm_overlap="all"))
    costs = ev.op_costs
    attn = "model.layers.0.self_attn"
    q, k, v, norm = f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj", "model.layers.0.input_layernorm"
    ctx = {engine: PlanContext(mesh=MeshSpec.of(tp=8), cluster=cluster, micro_batch=1, num_microbatches=1,
                               tp_overlap="all", compile=engine == "torchtitan")
           for engine in ("torchtitan", "megatron")}
    gemms = costs[q].fwd_s + costs[k].fwd_s + costs[v].fwd_s
    assert costs[k].fwd_s < gemms / 3 < costs[q].fwd_s  # grouped-query attention: k and v are the small GEMMs
    # forward: a gather as long as the three GEMMs together hides beside them as beside one GEMM that long (each
    # edge its third); beside each reader's GEMM alone, k's and v's thirds would outlast theirs
    gather = gemms
    grouped = sum(_beside_gemms(gather / 3, 0.0, r, norm, costs, graph, ctx["torchtitan"], readers=[q, k, v],
                                share=1 / 3) for r in (q, k, v))
    alone = sum(_beside_gemms(gather / 3, 0.0, r, norm, costs, graph, ctx["torchtitan"]) for r in (q, k, v))
    slow = cluster.gpu.overlap_slowdown
    assert alone < grouped == pytest.approx(gather - exposed_beside_s(gemms, gather, slowdown=slow))
    # backward: the summed gradient's reduce-scatter
    bwd = costs[q].bwd_s / 2
    assert _beside_gemms(0.0, bwd, q, norm, costs, graph, ctx["torchtitan"], readers=[q, k, v], share=1 / 3) == 0.0
    assert _beside_gemms(0.0, bwd, q, norm, costs, graph, ctx["megatron"], readers=[q, k, v], share=1 / 3) > 0.0
    assert _beside_gemms(0.0, bwd, q, norm, costs, graph, ctx["torchtitan"]) > 0.0  # one reader: fused


def test_inductors_fused_collective_matmuls_run_their_gemm_in_tp_row_chunks_at_the_measured_rate_by_shape():
    """torch's fused_all_gather_matmul / fused_matmul_reduce_scatter call the matmul once per M/tp-row shard
    (torch/distributed/_symmetric_memory): on the H100's measured GEMM grid a 1,024-row chunk runs slower per
    FLOP than the 8,192-row GEMM, so 8 chunks outlast it; nothing extra without tensor parallelism."""
    from autoshard.cost_models.async_tp import chunked_gemm_extra_s, partials_sum_s, staged_shard_s
    from autoshard.cost_models.compute import memory_bound_time_s

    h100 = load_gpu("H100-80GB")
    whole, chunk = gemm_time_s(8192, 512, 4096, h100), gemm_time_s(1024, 512, 4096, h100)
    assert 8 * chunk > whole
    assert chunked_gemm_extra_s(8192, 512, 4096, 8, h100) == pytest.approx(8 * chunk - whole)
    assert chunked_gemm_extra_s(8192, 512, 4096, 1, h100) == 0.0
    # the reduce-scatter's own sum reads the tp partials (the whole output) and writes one 1/tp of it; the
    # all-gather copies its shard into the symmetric buffer and waits on a barrier kernel
    out = 8192 * 4096 * 2
    assert partials_sum_s(out, 8, h100) == pytest.approx(memory_bound_time_s(out * 9 / 8, h100))
    assert staged_shard_s(out / 8, h100) == pytest.approx(memory_bound_time_s(out / 4, h100, kernels=2))


def test_async_tp_under_compile_adds_the_fused_ops_kernels_inside_compiled_blocks_and_megatron_adds_none():
    """Per block, torchtitan's async TP (Inductor, compiled blocks) runs: for the q, k, v gather one staged shard
    (each reader's edge its third) and each reader's GEMM in chunks; for o_proj's reduce-scatter o_proj's GEMM
    in chunks and the partials' sum; backward the mirror image (but not the summed q, k, v gradient's
    reduce-scatter, which NCCL runs). Megatron-Core's engine (no compile) is priced without them, and the output
    Linear, outside the compiled blocks, gathers by NCCL with nothing hidden."""
    import dataclasses

    from autoshard.cost_models.async_tp import chunked_gemm_extra_s, partials_sum_s, staged_shard_s
    from autoshard.cost_models.evaluate import _beside_gemms, _fused_tp_kernels_s, input_readers
    from autoshard.cost_models.prediction import context_for
    from autoshard.cost_models.template import template_for

    graph = capture_model(load_model("llama:layers=2,hidden=1024,heads=16,kv_heads=8,ffn=2048,seq=2048,vocab=512"))
    cluster = _kernels_only("1x8xH100-80GB")
    cfg = dict(tp=8, micro_batch=1, global_batch=1, tp_comm_overlap="all", loss_parallel=True)
    plan, ev = estimate(graph, cluster, HandConfig(**cfg, compile=True))
    ctx = dataclasses.replace(context_for(plan, cluster, graph), tp_overlap="all")  # estimate's own context
    megatron = dataclasses.replace(ctx, compile=False)
    assign = {p.op: p.strategy for p in plan.ops}
    tg, _ = template_for(graph, plan.pipeline)
    readers = input_readers(tg)
    edges = {(e.src, e.dst): e for e in tg.edges}
    attn, gpu = "model.layers.0.self_attn", cluster.gpu
    qkv = [(("model.layers.0.input_layernorm", f"{attn}.{x}_proj")) for x in "qkv"]
    m, h = 2048, 1024
    fused = {k: _fused_tp_kernels_s(edges[k], ev.edge_costs[(*k, 0)], graph, assign, ctx, readers=readers[k[0]],
                                    share=edges[k].shares["share"]) for k in qkv}
    staged = staged_shard_s(m // 8 * h * 2, gpu)
    kv = 8 * h // 16  # kv_heads x head dim
    chunks = chunked_gemm_extra_s(m, h // 8, h, 8, gpu) + 2 * chunked_gemm_extra_s(m, kv // 8, h, 8, gpu)
    assert sum(f for f, _ in fused.values()) == pytest.approx(staged + chunks)  # one staged shard for the three
    assert all(b == 0.0 for _, b in fused.values())  # their summed gradient: NCCL's reduce-scatter
    o = (f"{attn}.o_proj", "model.layers.0.add")
    fwd, bwd = _fused_tp_kernels_s(edges[o], ev.edge_costs[(*o, 1)], graph, assign, ctx)
    # o_proj: (m x h/8) @ (h/8 x h), its output reduce-scattered; backward gathers the output gradient into its
    # data-gradient GEMM (m x h) @ (h x h/8)
    assert fwd == pytest.approx(chunked_gemm_extra_s(m, h, h // 8, 8, gpu) + partials_sum_s(m * h * 2, 8, gpu))
    assert bwd == pytest.approx(chunked_gemm_extra_s(m, h // 8, h, 8, gpu) + staged_shard_s(m // 8 * h * 2, gpu))
    assert _fused_tp_kernels_s(edges[o], ev.edge_costs[(*o, 1)], graph, assign, megatron) == (0.0, 0.0)
    head = ("model.norm", "lm_head")
    c = ev.edge_costs[(*head, 0)]
    assert c.fwd_s > 0 and _beside_gemms(c.fwd_s, c.bwd_s, "lm_head", "model.norm", ev.op_costs, graph, ctx) == 0.0
    assert _beside_gemms(c.fwd_s, c.bwd_s, "lm_head", "model.norm", ev.op_costs, graph, megatron) > 0.0


@pytest.mark.parametrize("overlap", ["backward", "all"])
def test_a_float8_casts_amax_all_reduce_stays_exposed_under_every_tensor_parallel_overlap(overlap):
    """A tensorwise float8 Linear under tensor parallelism all-reduces the amax of each sharded operand before
    the cast its GEMMs wait for: no GEMM runs beside it (Megatron's asynchronous all-reduce and the fused
    collective-matmuls of async TP take only the collectives into and out of the Linears). With the edges'
    collectives left out, a stage's tensor-parallel time is the ops' own and none of it is hidden."""
    import dataclasses

    from autoshard.cost_models import evaluate as ev_mod
    from autoshard.cost_models.prediction import context_for

    graph = capture_model(load_model("llama:layers=2,hidden=4096,heads=32,kv_heads=8,ffn=8192,seq=4096,vocab=512"))
    cluster = _kernels_only("1x8xH100-80GB")
    plan, _ = estimate(graph, cluster, HandConfig(tp=8, micro_batch=1, global_batch=1, sequence_parallel=True,
                                                  compile=True, float8="tensorwise", loss_parallel=True))
    ctx = dataclasses.replace(context_for(plan, cluster, graph), tp_overlap=overlap)
    assign = {p.op: p.strategy for p in plan.ops}
    tg, stage = ev_mod.template_for(graph, plan.pipeline)
    op_costs, edges, outs = ev_mod._template_costs(graph, assign, ctx, tg)
    quiet = {k: dataclasses.replace(c, fwd_s=0.0, bwd_s=0.0, comm=(), fwd_comm=()) for k, c in edges.items()}
    st = ev_mod._accumulate(graph, assign, ctx, plan.pipeline, tg, op_costs, quiet, {}, stage)[0]
    own = sum(sum(tg.per_stage[o.name]) * (op_costs[o.name].tp_fwd_s + op_costs[o.name].tp_bwd_s) for o in tg.ops)
    assert own > 0 and st.tp == pytest.approx(own)
    assert st.tp_hidden == 0.0


# -- pipeline boundaries ---------------------------------------------------------------------------------------
def _cuts(graph, cluster, **cfg):
    from autoshard.cost_models.evaluate import cut_sends
    from autoshard.cost_models.prediction import context_for

    plan, _ = estimate(graph, cluster, HandConfig(**cfg))
    return cut_sends(graph, {p.op: p.strategy for p in plan.ops}, context_for(plan, cluster, graph), plan.pipeline)


def test_a_tensor_parallel_pipeline_sends_a_1_over_t_slice_with_or_without_sequence_parallelism(llama):
    """Megatron-LM's scatter/gather (Narayanan et al. 2021 §4.1): hidden states replicated over the
    tensor-parallel group cross the pipeline as each rank's slice and are all-gathered inside the node;
    under sequence parallelism they are sliced already and nothing is gathered."""
    cluster = ClusterSpec.parse("2x4xA100-80GB")
    cfg = dict(tp=4, pp=2, micro_batch=1, global_batch=4)
    plain = _cuts(llama, cluster, **cfg)
    sp = _cuts(llama, cluster, sequence_parallel=True, **cfg)
    whole = llama.seq_len * 256 * 2  # seq x hidden x bf16, one sample
    assert plain == [(whole / 4, whole, ("tp",))]
    assert sp == [(whole / 4, whole, ())]
    # one stage per rank group: nothing to scatter without tensor parallelism
    assert _cuts(llama, cluster, pp=2, dp=4, micro_batch=1, global_batch=8) == [(whole, whole, ())]


def test_the_last_pipeline_stage_waits_for_its_inputs_and_the_first_for_its_gradients(llama):
    """Sends are asynchronous, receives block: every stage of a pipeline waits for what crosses the cuts
    beside it, the first and last stage once per micro-batch, an inner stage twice. The same pipeline with
    its stages across nodes and inside one node differs by exactly those waits."""
    from autoshard.cost_models.prediction import context_for

    cfg = HandConfig(pp=4, micro_batch=1, global_batch=8)
    hidden = llama.seq_len * 256 * 2  # seq x hidden x bf16, one sample
    times, transfer = {}, {}
    for spec in ("4x1xA100-80GB", "1x4xA100-80GB"):  # one GPU per node: every send crosses the network
        cluster = ClusterSpec.parse(spec)
        plan, ev = estimate(llama, cluster, cfg)
        times[spec], transfer[spec] = ev.stage_time_s, context_for(plan, cluster, llama).p2p_s(hidden)
    extra = transfer["4x1xA100-80GB"] - transfer["1x4xA100-80GB"]
    assert extra > 0
    waits = [a - b for a, b in zip(times["4x1xA100-80GB"], times["1x4xA100-80GB"], strict=True)]
    assert waits == pytest.approx([extra, 2 * extra, 2 * extra, extra])


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 4, 8), (8, 4, 64), (4, 3, 4), (4, 2, 2)])
def test_interleaved_stages_hold_the_warmup_forwards_torchs_schedule_runs_before_their_first_backward(p, v, m):
    """The runtime's ScheduleInterleaved1F1B runs `_get_warmup_ops` chunk forwards before a rank's first
    backward and holds one more in steady state; the last rank runs (v - 1)·p of them, not 1 + (p - 1)/v
    micro-batches' worth (Korthikanti et al.'s count holds for the first stage only)."""
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    from autoshard.cost_models.evaluate import inflight_microbatches
    from autoshard.plans.plan import PipelineSpec

    pipe = PipelineSpec(degree=p, schedule="interleaved-1f1b", virtual_stages=v)
    per_round = m // max(1, m // p)
    for stage in range(p):
        chunks = min(_get_warmup_ops(stage, v, per_round, p, m) + 1, m * v)
        assert inflight_microbatches(stage, pipe, m) == pytest.approx(chunks / v)
    if m >= 2 * p:  # enough micro-batches that the warmup is not cut short
        assert inflight_microbatches(0, pipe, m) == pytest.approx(p + (p - 1) / v)


def _interleaved_makespan_in_stage_times(p: int, v: int, m: int, fwd: float, bwd: float) -> float:
    """Run torch's own ScheduleInterleaved1F1B action lists (`_calculate_single_rank_operations`) on p ranks, each
    chunk forward taking `fwd` and backward `bwd`, every action waiting for the chunk before it (forward) or
    after it (backward): the step's length in stage-times of one micro-batch (v chunks each way)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    sched = SimpleNamespace(n_local_stages=v, pp_group_size=p, _n_microbatches=m,
                            microbatches_per_round=m // max(1, m // p))
    ops = [[a for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(sched, r) if a is not None]
           for r in range(p)]
    done, free, pos, last = {}, [0.0] * p, [0] * p, p * v - 1
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(ops[r]):
                a = ops[r][pos[r]]
                s, i, forward = a.stage_index, a.microbatch_index, a.computation_type == _ComputationType.FORWARD
                dep = (("F", s - 1, i) if s > 0 else None) if forward else \
                    (("F", last, i) if s == last else ("B", s + 1, i))
                if dep is not None and dep not in done:
                    break
                free[r] = max(free[r], done.get(dep, 0.0)) + (fwd if forward else bwd)
                done[("F" if forward else "B", s, i)] = free[r]
                pos[r] += 1
                moved = True
    assert pos == [len(o) for o in ops]  # no deadlock
    return max(free) / (v * (fwd + bwd))


@pytest.mark.parametrize("p,v,m", [(2, 2, 1), (4, 2, 1), (4, 2, 3), (4, 4, 2), (8, 4, 3), (4, 2, 4), (4, 3, 4),
                                   (4, 2, 8)])
def test_the_interleaved_fill_is_what_torchs_schedule_idles_also_with_fewer_micro_batches_than_stages(p, v, m):
    """(p - 1)/v of Narayanan et al. holds once a round has p micro-batches; with fewer, a micro-batch comes back
    to a rank only after p chunk-times and the fill grows to p - m + (m - 1)/v: one micro-batch idles as much
    as under 1F1B (p - 1), which made `plan` pick a one-micro-batch interleaved pipeline as if it overlapped."""
    from autoshard.cost_models.evaluate import pipeline_fill
    from autoshard.plans.plan import PipelineSpec

    pipe = PipelineSpec(degree=p, schedule="interleaved-1f1b", virtual_stages=v)
    for fwd, bwd in ((1.0, 2.0), (1.0, 1.0)):
        assert _interleaved_makespan_in_stage_times(p, v, m, fwd, bwd) - m == pytest.approx(pipeline_fill(pipe, m))


# -- ZeRO-3 implementations -------------------------------------------------------------------------------------
def test_deepspeed_2021_zero3_waits_for_a_gather_per_parameter_at_its_measured_rate_and_again_for_recompute():
    """`zero_impl="deepspeed-2021"` (cost_models/zero_impl.py): every parameter of at least 1e5 elements is
    gathered before its forward and its backward, at ~24 GB/s (DeepSpeed issue #1174), and the step waits;
    full recompute gathers the block's parameters a third time. FSDP2 prefetches per block and hides most."""
    from autoshard.cost_models.zero_impl import DEEPSPEED_2021_GATHER_GBPS, DEEPSPEED_PERSISTENCE_NUMEL

    graph = capture_model(load_model("gpt:layers=2,hidden=1024,heads=8,seq=256,vocab=1024"))
    cluster = _kernels_only("1x8xA100-80GB")  # the FSDP2 runtime's host costs are not what this compares
    cfg = dict(dp=8, micro_batch=1, global_batch=8, zero=3)
    fsdp, _ = estimate(graph, cluster, HandConfig(**cfg))
    ds, ev = estimate(graph, cluster, HandConfig(**cfg, zero_impl="deepspeed-2021"))
    rate = DEEPSPEED_2021_GATHER_GBPS * 1e9

    def gathered_bytes(ops):
        return 2 * sum(p.numel for op in ops for p in op.params if p.owner and p.numel >= DEEPSPEED_PERSISTENCE_NUMEL)

    sync = sum(c.dp_sync_s for c in ev.op_costs.values())
    # on NVLink the implementation's rate, not NCCL, bounds the gathers (all but the smallest): forward and backward
    assert sync == pytest.approx(2 * gathered_bytes(graph.ops) / rate, rel=0.01)
    assert ds.prediction.time.exposed_comm_s >= sync  # none of it hidden
    assert ds.prediction.iteration_time_s > fsdp.prediction.iteration_time_s
    _, ev_full = estimate(graph, cluster, HandConfig(**cfg, zero_impl="deepspeed-2021", recompute="full"))
    in_blocks = gathered_bytes([op for op in graph.ops if op.layer is not None])
    assert sum(c.dp_sync_s for c in ev_full.op_costs.values()) == pytest.approx(sync + in_blocks / rate, rel=0.01)


def test_zero3_gather_of_an_unknown_implementation_is_an_error_and_fsdp2_is_nccls_time():
    from autoshard.cost_models.zero_impl import zero3_gather_s

    assert zero3_gather_s("fsdp2", 1e9, 0.01, numel=5e8) == 0.01
    assert zero3_gather_s("deepspeed-2021", 1e9, 0.01, numel=5e8) == pytest.approx(0.420 / 10.2)  # #1174's rate
    assert zero3_gather_s("deepspeed-2021", 1e4, 0.01, numel=5e3) == 0.0  # kept whole: never gathered
    with pytest.raises(ValueError, match="unknown ZeRO-3 implementation"):
        zero3_gather_s("megatron", 1e9, 0.01, numel=5e8)
