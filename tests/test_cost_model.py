"""The cost model against the closed forms of REFERENCES.md and against measurements."""

import dataclasses
import math

import pytest

from autoshard.capture import capture_model
from autoshard.cost_models.comm import (
    GroupPlacement,
    bus_factor,
    collective_time_s,
    group_placement,
    peak_busbw_gbps,
    step_overhead_s,
)
from autoshard.cost_models.compute import gemm_time_s
from autoshard.cost_models.context import PlanContext
from autoshard.cost_models.memory import BF16_MIXED, BF16_MIXED_16BIT_GRADS, model_state_bytes
from autoshard.cost_models.opcost import edge_cost, op_cost
from autoshard.hardware_profiles import ClusterSpec, load_gpu
from autoshard.models import load_model
from autoshard.planner.estimate import HandConfig, estimate
from autoshard.plans.layouts import BATCH, FEAT, IN, OUT, PARTIAL, Layout, MeshSpec, layout
from autoshard.plans.plan import OpStrategy, ParamPlacement

DGX = ClusterSpec.parse("1x8xA100-80GB")
TWO_NODES = ClusterSpec.parse("2x8xA100-80GB")


# -- collectives (REFERENCES.md §3; cost_models/comm.py) --------------------------------------------------
def test_all_reduce_on_eight_a100s_reproduces_the_measured_nccl_tests_curve():
    """At the group size it was measured on, the model gives back the published busbw at every size
    (within 1%: no ring step is cheaper than the link's per-hop latency)."""
    _, n0, points = DGX.intra.curve("all_reduce", 8)
    assert n0 == 8
    for nbytes, busbw in points:
        got = collective_time_s("all_reduce", nbytes, GroupPlacement(size=8, ranks_per_node=8), DGX)
        assert nbytes * 2 * 7 / 8 / got / 1e9 == pytest.approx(busbw, rel=0.01)  # per-hop latency floor


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
def test_a_link_without_a_curve_is_alpha_beta_with_ring_steps(collective):
    pcie = ClusterSpec.parse("1x8xA100-40GB-PCIe")
    link = pcie.intra
    assert not link.busbw_curve
    size = 1 << 26
    for n in (2, 4, 8):
        steps = 2 * (n - 1) if collective == "all_reduce" else n - 1
        want = steps * link.latency_us * 1e-6 + size * bus_factor(collective, n) / (link.busbw_gbps[collective] * 1e9)
        got = collective_time_s(collective, size, GroupPlacement(size=n, ranks_per_node=n), pcie)
        assert got == pytest.approx(want, rel=1e-12)


def test_a_ring_across_nodes_pays_every_step_and_the_nodes_network():
    """16 ranks on 2 DGX A100: a flat ring of 30 all-reduce steps, 2 of them across the network; its
    bandwidth the slower of NVSwitch and the node's 8 NICs."""
    size = 1 << 30
    group = GroupPlacement(size=16, ranks_per_node=8)
    intra, inter = TWO_NODES.intra, TWO_NODES.inter
    o_intra = step_overhead_s(intra, "all_reduce", size / 16, 8)
    o_inter = max(o_intra, step_overhead_s(inter, "all_reduce", size / 16, 2))
    bw = min(peak_busbw_gbps(intra, "all_reduce", 8), inter.busbw_gbps["all_reduce"])
    ring = 28 * o_intra + 2 * o_inter + size * 2 * 15 / 16 / (bw * 1e9)
    tree = 2 * (7 * o_intra + 1 * o_inter) + size * 2 * 15 / 16 / (bw * 1e9)
    assert collective_time_s("all_reduce", size, group, TWO_NODES) == pytest.approx(min(ring, tree), rel=1e-12)


def test_the_same_message_reaches_less_bus_bandwidth_on_a_larger_ring():
    """Per-rank chunks shrink as the ring grows: a 64 MB all-gather on 1,024 A100s is slower per byte than
    on 64 (nccl issue #1712: ring latency grows linearly with the communicator)."""
    def busbw(nodes):
        cluster = ClusterSpec.parse(f"{nodes}x8xA100-80GB")
        n = nodes * 8
        t = collective_time_s("all_gather", 64 << 20, GroupPlacement(size=n, ranks_per_node=8), cluster)
        return (64 << 20) * (n - 1) / n / t / 1e9
    assert busbw(8) > busbw(32) > busbw(128)
    assert busbw(128) < 0.5 * busbw(8)


def test_collective_time_grows_with_message_and_group_size():
    for coll in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        sizes = [collective_time_s(coll, s, GroupPlacement(size=8, ranks_per_node=8), DGX) for s in (1e3, 1e6, 1e9)]
        assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
        groups = [collective_time_s(coll, 1e9, GroupPlacement(size=n, ranks_per_node=n), DGX) for n in (2, 4, 8)]
        assert groups == sorted(groups)
    inside = collective_time_s("all_reduce", 1e9, GroupPlacement(size=8, ranks_per_node=8), TWO_NODES)
    strided = collective_time_s("all_reduce", 1e9, GroupPlacement(size=2, ranks_per_node=1), TWO_NODES)
    assert strided > inside  # one byte across InfiniBand costs more than eight over NVSwitch


def test_unknown_collective_is_an_error_not_a_guess():
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("all_broadcast", 8)


def test_group_placement_of_strided_and_contiguous_axes():
    mesh = MeshSpec.of(dp=4, tp=8)
    assert group_placement([(mesh.stride("tp"), 8)], 8) == GroupPlacement(size=8, ranks_per_node=8)
    assert group_placement([(mesh.stride("dp"), 4)], 8) == GroupPlacement(size=4, ranks_per_node=1)


# -- memory (REFERENCES.md §4) ---------------------------------------------------------------------------
@pytest.mark.parametrize("zero,gigabytes", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_model_states_match_the_zero_paper_for_7_5b_on_64_ranks(zero, gigabytes):
    """With 16-bit gradients, as DeepSpeed holds them, the ZeRO paper's figures."""
    p, g, o = model_state_bytes(7.5e9, BF16_MIXED_16BIT_GRADS, zero=zero, dp=64)
    assert (p + g + o) / 1e9 == pytest.approx(gigabytes, abs=0.06)


@pytest.mark.parametrize("zero,bytes_per_param", [(0, 18), (1, 6 + 12 / 64), (2, 2 + 16 / 64), (3, 18 / 64)])
def test_the_runtimes_fp32_gradients_cost_two_bytes_a_parameter_more_where_they_are_held(zero, bytes_per_param):
    """autoshard's runtime reduces and sums gradients in fp32 (FSDP2's reduce_dtype, runtime/precision.py): the
    full sum across micro-batches at ZeRO-0/1, the fp32 shard at ZeRO-2/3."""
    p, g, o = model_state_bytes(1.0, BF16_MIXED, zero=zero, dp=64)
    assert p + g + o == pytest.approx(bytes_per_param)


def _layer_saved_bytes(*, tp, sp, recompute, s=64, h=64, a=4, b=2):
    """Activation bytes one GPT layer keeps under Megatron's layout (materialized attention)."""
    graph = capture_model(load_model(f"gpt:layers=3,hidden={h},heads={a},seq={s},vocab=128,attn=eager"))
    cluster = ClusterSpec.parse(f"1x{tp}xA100-80GB")
    _, ev = estimate(graph, cluster, HandConfig(tp=tp, micro_batch=b, global_batch=b, recompute=recompute,
                                                sequence_parallel=sp, sequence_parallel_regather=True))
    return sum(ev.op_costs[n].saved_bytes for n in graph.blocks[0].op_names[1])


@pytest.mark.parametrize("tp,sp,recompute,formula", [
    (1, False, "none", lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h)),
    (4, False, "none", lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
    (4, True, "none", lambda s, b, h, a, t: s * b * h * (34 / t + 5 * a * s / (h * t))),
    (4, False, "selective", lambda s, b, h, a, t: s * b * h * (10 + 24 / t)),
    (4, True, "selective", lambda s, b, h, a, t: 34 * s * b * h / t),
    (4, False, "full", lambda s, b, h, a, t: 2 * s * b * h),
])
def test_layer_activations_match_korthikanti_formulas(tp, sp, recompute, formula):
    s, h, a, b = 32, 64, 4, 2
    assert _layer_saved_bytes(tp=tp, sp=sp, recompute=recompute, s=s, h=h, a=a, b=b) == pytest.approx(
        formula(s, b, h, a, tp), rel=1e-9)


# -- compute ---------------------------------------------------------------------------------------------
# Measured H100 bf16 GEMM throughput, TFLOP/s, from XLA's matmul_interpolator_data.h
# (tensorflow/tensorflow @ 372d578b, third_party/xla/xla/service/gpu/model/): (batch, m, n, k) -> TFLOP/s.
H100_MEASURED = {(1, 4096, 4096, 4096): 783.3, (1, 2048, 2048, 2048): 632.0, (1, 1024, 1024, 1024): 236.3,
                 (1, 4096, 4096, 1024): 677.4, (1, 4096, 1024, 4096): 738.5, (4, 4096, 4096, 2048): 764.6,
                 (1, 4096, 4096, 2048): 738.7, (2, 2048, 4096, 1024): 678.7, (4, 1024, 2048, 2048): 712.7}


def test_tile_and_wave_gemm_model_matches_measured_h100_throughput_within_10_percent():
    # the model GPUs without a measured grid take (A100, V100), checked on H100's measurements at large shapes;
    # XLA's table times GEMMs in bursts, at boost clock: compare with the profile's burst rates
    gpu = dataclasses.replace(load_gpu("H100-80GB"), sustained_tensor_fraction=1.0, gemm_tflops=())
    ratios = []
    for (b, m, n, k), tflops in H100_MEASURED.items():
        predicted = 2 * b * m * n * k / gemm_time_s(m, n, k, gpu, batch=b) / 1e12
        ratios.append(predicted / tflops)
        assert predicted == pytest.approx(tflops, rel=0.10), (b, m, n, k)
    assert math.exp(sum(math.log(r) for r in ratios) / len(ratios)) == pytest.approx(1.0, abs=0.05)



def test_h100_profile_prices_gemms_at_openxlas_measured_rates_at_its_grid_points():
    # default_matmul_perf_table.txtpb @ 336bb15c, key sm_90, bf16: burst TFLOP/s at (m, n, k); the profile keeps
    # them and applies the sustained fraction and the launch cost every kernel pays
    gpu = load_gpu("H100-80GB")
    for (m, n, k), tflops in {(4096, 4096, 4096): 780.19, (2048, 2048, 2048): 641.04, (4096, 1024, 256): 222.95,
                              (256, 4096, 4096): 418.45, (16384, 2048, 4096): 804.72}.items():
        expected = 2 * m * n * k / (tflops * 1e12 * gpu.sustained_tensor_fraction) + gpu.kernel_launch_us * 1e-6
        assert gemm_time_s(m, n, k, gpu) == pytest.approx(expected, rel=1e-9), (m, n, k)
    # a small inner dimension wastes most of the machine, which tile and wave quantization alone do not see
    small_k = 2 * 4096 * 4096 * 256 / gemm_time_s(4096, 4096, 256, gpu)
    large_k = 2 * 4096 * 4096 * 4096 / gemm_time_s(4096, 4096, 4096, gpu)
    assert small_k < 0.55 * large_k


# -- communication volume of the tensor-parallel schemes (REFERENCES.md §5) ---------------------------------
def _linear(n_tokens, h_in, h_out):
    from autoshard.capture.ir import Op, OpKind, ParamMeta, TensorMeta

    x = TensorMeta(shape=(1, n_tokens, h_in), dtype="bfloat16", batch_dims=(0,))
    return Op(name="lin", kind=OpKind.LINEAR, module_path="lin", module_type="Linear", layer=None, inputs=("x",),
              input_meta=(x,), output_meta=TensorMeta(shape=(1, n_tokens, h_out), dtype="bfloat16", batch_dims=(0,)),
              params=(ParamMeta(name="w", shape=(h_out, h_in), dtype="bfloat16"),), fwd_flops=2 * n_tokens * h_in * h_out,
              bwd_flops=4 * n_tokens * h_in * h_out, saved=(x,), gemm=(n_tokens, h_out, h_in))


def _elements_moved(records, mesh_degree_of) -> float:
    """Elements a device sends for (collective, bytes) records, ring algorithms, 2-byte elements."""
    total = 0.0
    for coll, nbytes, n in records:
        total += nbytes / 2 * bus_factor(coll, n)
    return total


LAYER = [(1, 3), (1, 1), (1, 4), (4, 1)]  # (h_in, h_out) of qkv, proj, fc1, fc2 in units of h


def test_2d_layer_communication_matches_optimus_volume():
    """2D on q x q: 3·(N·h_in + h_in·h_out)/q per linear, x (q-1)/q for ring collectives; per layer
    (21Nh + 36h²)/√p."""
    q, n_tok, h = 4, 256, 64
    mesh = MeshSpec.of(tp_r=q, tp_c=q)
    ctx = PlanContext(mesh=mesh, cluster=ClusterSpec.parse("2x8xA100-80GB"), micro_batch=q)
    moved = 0.0
    for a, b in LAYER:
        op = _linear(n_tok, a * h, b * h)
        st = OpStrategy(name="2d", inputs=(layout(tp_r=BATCH),), output=layout(tp_r=BATCH, tp_c=FEAT),
                        params=(ParamPlacement(name="w", compute=layout(tp_c=OUT), storage=layout(tp_r=IN, tp_c=OUT)),),
                        save_sharded_input=True)
        c = op_cost(op, st, ctx)
        recs = [(k, v, q) for k, v in c.comm]
        e = edge_cost(op.input_meta[0], layout(tp_r=BATCH, tp_c=FEAT), st.inputs[0], frozenset({"tp_c"}), ctx,
                      regather=True)  # the shard is kept and gathered again in backward
        recs += [(k, v, q) for k, v in e.comm]
        moved += _elements_moved(recs, q)
    nq = q * n_tok  # N tokens in the micro-batch, q samples of n_tok
    want = 3 * (q - 1) / q * (7 * nq * h + 12 * h * h) / q
    assert moved == pytest.approx(want, rel=1e-9)


def test_1d_layer_communication_is_two_all_reduces_per_pair():
    """Megatron: per column/row pair, one all-reduce of N·h forward and one backward: 8Nh(p-1)/p per layer."""
    p, n_tok, h = 8, 256, 64
    ctx = PlanContext(mesh=MeshSpec.of(tp=p), cluster=DGX, micro_batch=1)
    meta = _linear(n_tok, h, h).output_meta
    fwd = edge_cost(meta, layout(tp=PARTIAL), Layout(), frozenset(), ctx)  # row output -> residual stream
    bwd = edge_cost(meta, Layout(), Layout(), frozenset({"tp"}), ctx)  # residual stream -> column input
    recs = [(k, v, p) for k, v in fwd.comm + bwd.comm]
    per_pair = _elements_moved(recs, p)
    assert 2 * per_pair == pytest.approx(8 * n_tok * h * (p - 1) / p, rel=1e-9)


def test_3d_layer_communication_matches_bian_volume():
    """3D on q³: 2(q-1)/q³·(N·h_in + h_in·h_out + N·h_out) per linear (gathered X and W kept for backward)."""
    q, n_tok, h = 2, 256, 64
    mesh = MeshSpec.of(tp_x=q, tp_y=q, tp_z=q)
    ctx = PlanContext(mesh=mesh, cluster=ClusterSpec.parse("1x8xA100-80GB"), micro_batch=q * q)
    moved = 0.0
    nq = q * q * n_tok
    for a, b in LAYER:
        op = _linear(n_tok, a * h, b * h)
        st = OpStrategy(name="3d-yz", inputs=(layout(tp_x=BATCH, tp_z=FEAT),),
                        output=layout(tp_x=BATCH, tp_y=FEAT, tp_z=PARTIAL),
                        params=(ParamPlacement(name="w", compute=layout(tp_y=OUT, tp_z=IN),
                                               storage=layout(tp_x=OUT, tp_y=OUT, tp_z=IN)),))
        c = op_cost(op, st, ctx)
        recs = [(k, v, q) for k, v in c.comm]
        e_in = edge_cost(op.input_meta[0], layout(tp_x=BATCH, tp_y=BATCH, tp_z=FEAT), st.inputs[0],
                         frozenset({"tp_y"}), ctx)
        e_out = edge_cost(op.output_meta, st.output, layout(tp_x=BATCH, tp_y=FEAT, tp_z=BATCH), frozenset(), ctx)
        recs += [(k, v, q) for k, v in e_in.comm + e_out.comm]
        moved += _elements_moved(recs, q)
    want = 2 * (q - 1) / q ** 3 * (7 * nq * h + 12 * h * h + 9 * nq * h)
    assert moved == pytest.approx(want, rel=1e-9)
