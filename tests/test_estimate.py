import itertools
import json
import subprocess
import sys

import pytest

from autoshard.api import estimate_config
from autoshard.capture import capture_model
from autoshard.capture.ir import OpKind
from autoshard.cost_models.bounds import block_costs
from autoshard.cost_models.template import stage_of
from autoshard.errors import ConfigurationError
from autoshard.models import load_model
from autoshard.planner.estimate import HandConfig
from autoshard.planner.stages import stage_loads

KEYS = {"iteration_time_s", "tokens_per_s", "model_tflops_per_gpu", "mfu", "memory_gib", "breakdown_s"}


def run(*args):
    return subprocess.run([sys.executable, "-m", "autoshard.cli", *args], capture_output=True, text=True, timeout=300)


def test_estimate_json_has_the_documented_keys():
    out = run("estimate", "gpt:layers=4,hidden=256,heads=8,seq=512,vocab=1024", "--cluster", "1x8xA100-80GB",
              "--tp", "2", "--dp", "4", "--micro-batch", "2", "--global-batch", "64", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data.keys() >= KEYS
    assert set(data["memory_gib"]) == {"params", "grads", "optimizer", "activations", "transient", "other", "total"}
    assert {"compute", "exposed_comm", "bubble"} <= data["breakdown_s"].keys()
    assert data["tokens_per_s"] == pytest.approx(64 * 512 / data["iteration_time_s"])


def test_degrees_that_do_not_multiply_to_the_gpu_count_are_one_line_errors():
    out = run("estimate", "gpt2", "--cluster", "1x8xA100-80GB", "--global-batch", "8", "--tp", "3", "--dp", "1")
    assert out.returncode == 2 and "tp x pp x dp = 3 x 1 x 1 = 3" in out.stderr and out.stderr.count("\n") == 1


def test_tp_that_does_not_divide_the_heads_is_a_one_line_error():
    out = run("estimate", "gpt:layers=4,hidden=48,heads=6,seq=64,vocab=128", "--cluster", "1x8xA100-80GB",
              "--tp", "8", "--global-batch", "8")
    assert out.returncode == 2 and "does not divide the 6 attention heads" in out.stderr
    assert out.stderr.count("\n") == 1


def test_configuration_that_does_not_fit_reports_the_memory_it_needs():
    with pytest.raises(ConfigurationError, match=r"needs [0-9.]+ GiB per GPU but A100-80GB has 80 GiB"):
        estimate_config("gpt3-175b", "1x8xA100-80GB", tp=8, global_batch=8)


def test_a_tensor_parallel_run_whose_loss_does_not_fit_is_told_to_compute_it_on_the_vocabulary_shards():
    """Llama's 128K vocabulary at 8 x 8K tokens: the loss's fp32 buffers on the whole vocabulary (94 GiB) do not
    fit where torchtitan's loss_parallel (each rank its shard) does."""
    model = "llama:layers=2,hidden=1024,heads=8,kv_heads=8,ffn=2048,seq=8192,vocab=128256"
    kw = dict(tp=2, dp=1, micro_batch=8, global_batch=8, sequence_parallel=True)
    with pytest.raises(ConfigurationError) as err:
        estimate_config(model, "1x2xH100-80GB", **kw)
    assert "add loss_parallel (the loss holds 94 GiB" in str(err.value) and "loss_parallel" in err.value.params
    plan, _ = estimate_config(model, "1x2xH100-80GB", loss_parallel=True, **kw)
    assert plan.prediction.memory.total_bytes <= 80 * 2**30


def test_a_configuration_that_does_not_fit_names_only_the_fixes_that_apply_sequence_parallel_first():
    with pytest.raises(ConfigurationError) as err:  # tp 8 without sequence parallelism, recompute none
        estimate_config("gpt3-175b", "1x8xA100-80GB", tp=8, global_batch=8)
    assert str(err.value).split("; ", 1)[1].startswith("add sequence_parallel, use recompute='full'")
    assert "sequence_parallel" in err.value.params
    with pytest.raises(ConfigurationError) as err:  # already sequence-parallel and fully recomputed
        estimate_config("gpt3-175b", "1x8xA100-80GB", tp=8, global_batch=8, sequence_parallel=True, recompute="full")
    fixes = str(err.value).split("; ", 1)[1]
    assert "sequence_parallel" not in fixes and "recompute" not in fixes and fixes.endswith("raise tp/pp")
    out = run("estimate", "gpt3-175b", "--cluster", "1x8xA100-80GB", "--tp", "8", "--global-batch", "8")
    assert out.returncode == 2 and "add --sequence-parallel, use --recompute 'full'" in out.stderr


def test_indivisible_global_batch_is_rejected():
    with pytest.raises(ConfigurationError, match="not a multiple of dp x micro-batch"):
        estimate_config("gpt2", "1x8xA100-80GB", dp=8, micro_batch=2, global_batch=20)


def test_interleaved_and_layered_schedules_beat_1f1b_for_gpt3_on_64_a100():
    """Issue 6: GPT-3 175B, TP 8, PP 8, global batch 16, three chunks per rank."""
    def t(schedule):
        plan, _ = estimate_config("gpt3-175b", "8x8xA100-80GB", tp=8, pp=8, dp=1, global_batch=16,
                                  virtual_stages=3, schedule=schedule, recompute="full", check_memory=False)
        return plan.prediction.iteration_time_s

    one = t("1f1b")
    assert t("interleaved-1f1b") < one and t("looped-bfs") < one and t("gpipe") == pytest.approx(one)


def test_attention_auto_prices_the_fused_flash_kernel_and_eager_materializes_the_scores():
    """PyTorch's SDPA runs a flash kernel for these shapes on GPU and CPU alike; eager attention (Megatron
    2021's kernels) writes the s x s scores and their softmax."""
    ref = "gpt:layers=4,hidden=256,heads=8,seq=512,vocab=1024"
    auto, _ = estimate_config(ref, "1x8xA100-80GB", dp=8, global_batch=8)
    assert any(p.kind == "attention" for p in auto.ops) and not any(p.kind == "softmax" for p in auto.ops)
    eager, _ = estimate_config(ref, "1x8xA100-80GB", dp=8, global_batch=8, attention="eager")
    assert any(p.kind == "softmax" for p in eager.ops)
    assert eager.prediction.memory.activations_bytes > auto.prediction.memory.activations_bytes


@pytest.mark.long
def test_layers_that_do_not_divide_into_the_stages_are_balanced_by_cost():
    """13 layers on 4 pipeline stages: neither Megatron's even split nor one with the embedding and the head in a
    layer's place each (15 places) can; a balanced one can: the split's slowest stage is as fast as the best of
    every possible split."""
    ref = "gpt:layers=13,hidden=256,heads=8,seq=512,vocab=32768"
    out = run("estimate", ref, "--cluster", "1x8xA100-80GB",
              "--pp", "4", "--dp", "2", "--global-batch", "16", "--json")
    assert out.returncode == 0, out.stderr
    per_chunk = json.loads(out.stdout)["pipeline"]["layers_per_chunk"]
    assert sum(per_chunk) == 13 and len(per_chunk) == 4
    assert per_chunk[-1] < max(per_chunk)  # the stage with the 32k-vocabulary head gets fewer layers
    costs = block_costs(capture_model(load_model(ref)))
    splits = [c for c in itertools.product(range(1, 12), repeat=4) if sum(c) == 13]
    assert max(stage_loads(per_chunk, 4, *costs)) == pytest.approx(
        min(max(stage_loads(list(c), 4, *costs)) for c in splits))
    even, _ = estimate_config("gpt:layers=16,hidden=256,heads=8,seq=512,vocab=1024", "1x8xA100-80GB", pp=4,
                              dp=2, global_batch=16)
    assert [b - a for a, b in even.pipeline.stage_layers] == [4, 4, 4, 4]  # a small head: Megatron's split


def test_the_embedding_and_the_head_take_a_layers_place_where_the_layers_plus_two_divide_into_the_chunks():
    """BLOOM-176B ran 70 layers on 12 stages as 5, 6, ..., 6, 5 (`--pp-partition-method
    'type:transformer|embedding'`); Llama 3 405B's 126 layers fill 16 x 8 chunks with the embedding alone in the
    first chunk and the head alone in the last (Llama 3 paper §3.3.2)."""
    ref = "gpt:layers={},hidden=256,heads=8,seq=512,vocab=1024"
    bloom_like, _ = estimate_config(ref.format(10), "1x8xA100-80GB", pp=4, dp=2, global_batch=16)
    assert [b - a for a, b in bloom_like.pipeline.stage_layers] == [2, 3, 3, 2]
    graph = capture_model(load_model(ref.format(6)))
    plan, _ = estimate_config(ref.format(6), "1x8xA100-80GB", pp=2, dp=4, global_batch=16,
                              schedule="interleaved-1f1b", virtual_stages=4)
    assert [b - a for a, b in plan.pipeline.stage_layers] == [0, 1, 1, 1, 1, 1, 1, 0]
    chunk = stage_of(graph, plan.pipeline)
    first = {op.name for op in graph.ops if chunk[op.name] == 0}
    last = {op.name for op in graph.ops if chunk[op.name] == 7}
    assert first and all(graph.op(n).layer is None and graph.op(n).kind is not OpKind.LINEAR for n in first)
    assert any(graph.op(n).kind is OpKind.LINEAR for n in last) and all(graph.op(n).layer is None for n in last)


def test_more_pipeline_chunks_than_layers_is_a_one_line_error():
    out = run("estimate", "gpt:layers=4,hidden=256,heads=8,seq=512,vocab=1024", "--cluster", "1x8xA100-80GB",
              "--pp", "8", "--global-batch", "8")
    assert out.returncode == 2 and "4 layers cannot fill 8 pipeline chunks" in out.stderr
    assert out.stderr.count("\n") == 1


def test_backward_tp_overlap_hides_input_gradient_collectives_and_all_also_the_forward_ones():
    """`--tp-comm-overlap backward` (Megatron-LM's asynchronous tensor-parallel communication) hides what
    runs beside the weight-gradient GEMMs, never more than the backward collectives; `--tp-comm-overlap`
    alone means "all" (Megatron-Core's, torchtitan's async TP), which runs with sequence parallelism and hides
    part of its all-gathers and reduce-scatters; an unknown mode is a one-line exit-2 error."""
    model = "gpt:layers=4,hidden=2048,heads=16,seq=2048,vocab=1024"
    kw = dict(tp=8, micro_batch=2, global_batch=2)

    def predict(mode, **extra):
        return estimate_config(model, "1x8xA100-80GB", tp_comm_overlap=mode, **kw, **extra)[0].prediction

    plain, backward = predict(""), predict("backward")
    sp, overlapped, flag = predict("", sequence_parallel=True), predict("all"), predict(True)
    comm = {name: p.time.exposed_comm_s for name, p in
            dict(plain=plain, backward=backward, sp=sp, all=overlapped, flag=flag).items()}
    assert comm["plain"] > comm["backward"]
    # Megatron 1D without sequence parallelism: half of the all-reduces are in backward
    assert comm["plain"] - comm["backward"] < comm["plain"] / 2
    assert backward.time.compute_s == pytest.approx(plain.time.compute_s, rel=1e-12)
    assert comm["sp"] > comm["all"] == comm["flag"]
    assert overlapped.time.compute_s == pytest.approx(sp.time.compute_s, rel=1e-12)
    args = ("estimate", model, "--cluster", "1x8xA100-80GB", "--tp", "8", "--micro-batch", "2", "--global-batch",
            "2", "--json")
    flag, backward = run(*args, "--tp-comm-overlap"), run(*args, "--tp-comm-overlap", "backward")
    assert flag.returncode == 0 and backward.returncode == 0, flag.stderr + backward.stderr
    flag, backward = json.loads(flag.stdout), json.loads(backward.stdout)
    assert flag["iteration_time_s"] < backward["iteration_time_s"]
    assert (flag["tp_comm_overlap"], backward["tp_comm_overlap"]) == ("all", "backward")
    assert (flag["sequence_parallel"], backward["sequence_parallel"]) == (True, False)
    bad = run(*args, "--tp-comm-overlap", "forward")
    assert bad.returncode == 2 and "--tp-comm-overlap" in bad.stderr


def test_overlapping_every_tp_collective_without_sequence_parallelism_is_refused():
    """Megatron-LM refuses --tp-comm-overlap without --sequence-parallel and torch's async TP fuses only
    sequence parallelism's all-gathers and reduce-scatters with their GEMMs: asking for "all" with sequence
    parallelism off is a typed error naming both options, not an all-reduce priced as hidden."""
    with pytest.raises(ConfigurationError, match="sequence_parallel") as err:
        HandConfig(tp=8, tp_comm_overlap="all", sequence_parallel=False)
    assert set(err.value.params) == {"tp_comm_overlap", "sequence_parallel"}
    assert HandConfig(tp=8, tp_comm_overlap="backward").sequence_parallel is False
    assert HandConfig(tp=1, tp_comm_overlap="all").sequence_parallel is False  # nothing to shard over


def test_fused_loss_fits_a_large_vocabulary_that_eager_cross_entropy_does_not():
    """`--fused-loss` (flash-attn's CrossEntropyLoss, llm-foundry's default): 4 bytes per logit at the start of
    backward instead of eager's 12, so 4 x 8192 tokens over a 131,072-token vocabulary (4.3e9 logits, 48 GiB
    eager) fit a 40 GB GPU only fused; the JSON says which loss was priced."""
    args = ("estimate", "gpt:layers=2,hidden=256,heads=4,seq=8192,vocab=131072", "--cluster", "1x1xA100-40GB",
            "--micro-batch", "4", "--global-batch", "4", "--json")
    eager, fused = run(*args), run(*args, "--fused-loss")
    assert eager.returncode == 2 and "needs" in eager.stderr and eager.stdout == ""
    assert fused.returncode == 0, fused.stderr
    out = json.loads(fused.stdout)
    assert out["fused_loss"] is True and out["memory_gib"]["transient"] < 20


def test_loss_parallel_keeps_the_logits_vocabulary_sharded_under_tensor_parallelism():
    """`--loss-parallel` (Megatron-LM's vocab_parallel_cross_entropy, torchtitan's loss_parallel): at tp 8 the
    loss's fp32 buffers are an eighth and the head's logits are never gathered; without TP nothing changes."""
    spec = "gpt:layers=2,hidden=256,heads=8,seq=4096,vocab=65536"
    tp8 = ("estimate", spec, "--cluster", "1x8xA100-80GB", "--tp", "8", "--micro-batch", "2", "--global-batch", "2",
           "--json")
    whole, sharded = json.loads(run(*tp8).stdout), json.loads(run(*tp8, "--loss-parallel").stdout)
    logits_gib = 2 * 4096 * 65536 * 12 / 2**30  # eager cross-entropy: three fp32 copies
    assert whole["memory_gib"]["transient"] - sharded["memory_gib"]["transient"] == pytest.approx(
        logits_gib * 7 / 8, rel=0.02)
    assert sharded["loss_parallel"] is True and sharded["iteration_time_s"] < whole["iteration_time_s"]
    dp8 = ("estimate", spec, "--cluster", "1x8xA100-80GB", "--dp", "8", "--global-batch", "8", "--json")
    assert json.loads(run(*dp8).stdout)["iteration_time_s"] == json.loads(
        run(*dp8, "--loss-parallel").stdout)["iteration_time_s"]


def test_zero_impl_without_zero3_is_a_one_line_error_naming_the_fix():
    out = run("estimate", "gpt:layers=2,hidden=256,heads=4,seq=128,vocab=512", "--cluster", "1x8xA100-80GB",
              "--dp", "8", "--global-batch", "8", "--zero-impl", "deepspeed-2021")
    assert out.returncode == 2 and "--zero 3" in out.stderr and out.stderr.count("\n") == 1


def test_estimate_writes_no_plan_file_priced_for_another_engine(tmp_path):
    """`measure` compares a run of autoshard's runtime with the plan file's prediction, so `-o` refuses the
    options that price another engine (one line, exit 2, nothing written)."""
    target = tmp_path / "plan.json"
    out = run("estimate", "gpt:layers=2,hidden=256,heads=4,seq=128,vocab=512", "--cluster", "1x8xA100-80GB",
              "--tp", "2", "--dp", "4", "--global-batch", "4", "--tp-comm-overlap", "backward", "-o", str(target))
    assert out.returncode == 2 and "--tp-comm-overlap" in out.stderr and out.stderr.count("\n") == 1
    assert not target.exists()
    out = run("estimate", "gpt:layers=2,hidden=256,heads=4,seq=128,vocab=512", "--cluster", "1x8xA100-80GB",
              "--tp", "2", "--dp", "4", "--global-batch", "4", "--loss-parallel", "-o", str(target))
    assert out.returncode == 2 and "--loss-parallel" in out.stderr and not target.exists()
    out = run("estimate", "gpt:layers=2,hidden=256,heads=4,seq=128,vocab=512", "--cluster", "1x8xH100-80GB",
              "--tp", "2", "--dp", "4", "--global-batch", "4", "--float8", "tensorwise", "-o", str(target))
    assert out.returncode == 2 and "--float8 with --tp" in out.stderr and not target.exists()


def test_a_configuration_that_does_not_fit_is_told_the_usable_memory_to_the_hundredth():
    """An H100 80GB has 79.65 GiB usable (nvidia-smi memory.total): a 79.9 GiB need must not read "has 80 GiB"."""
    from autoshard.hardware_profiles import ClusterSpec

    assert ClusterSpec.parse("1x8xH100-80GB").device_memory_text == "79.65 GiB"
    assert ClusterSpec.parse("1x8xA100-80GB").device_memory_text == "80 GiB"
