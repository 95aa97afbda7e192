"""The runtime's contract on real gloo ranks: what a user gets back, what a step sends, how it fails.

All checks share one 2-rank world. Byte counts are exact: B=4 sequences of S=16 tokens, hidden H=64,
vocabulary V=128, fp32, so one (B, S, H) activation is 16384 bytes and the logits are 32768.
"""

from __future__ import annotations

import functools

import pytest
from dist_contract import contract_checks
from dist_harness import run_world
from dist_models import build, example_batch
from dist_plans import make_plan

from autoshard.plans.layouts import MeshSpec

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning")]

BATCH = 4
ACT_BYTES = BATCH * 16 * 64 * 4
LOGIT_BYTES = BATCH * 16 * 128 * 4
MLP_PARAM_BYTES = 4 * (2 * (16 * 32 + 32 + 32 * 16 + 16) + 16 * 16 + 16)  # MLP(layers=2, hidden=16, ffn=32)

_SPLIT = {"zero": 3, "split": {"transformer.h.0.mlp.c_fc": 2, "transformer.h.1.attn.c_proj": 4}}
# torchtitan's FSDP: decoder layers ZeRO-3, the ops outside them ZeRO-2
_TORCHTITAN = {"zero": 3, "zero_per_op": {"model.embed_tokens": 2, "model.norm": 2, "lm_head": 2}}
# id: (check, model, family, mesh degrees, plan options)
CHECKS = {
    "outputs-1d": ("outputs", "gpt2", "megatron", {"tp": 2}, {}),
    "outputs-split": ("outputs", "gpt2", "replicate", {"dp": 2}, _SPLIT),
    "comm-1d": ("comm", "llama", "megatron", {"tp": 2}, {}),
    "comm-1d-spmd": ("comm", "llama", "megatron", {"tp": 2}, {}),
    "comm-1d-fused-qkv": ("comm", "gpt2", "megatron", {"tp": 2}, {}),
    "comm-dp": ("comm", "mlp", "replicate", {"dp": 2}, {}),
    "comm-zero3": ("comm", "mlp", "replicate", {"dp": 2}, {"zero": 3}),
    "wrong-world": ("wrong_world", "mlp", "replicate", {"dp": 4}, {}),
    "padded-dp": ("padded", "llama", "replicate", {"dp": 2}, {}),
    "sub-meshes": ("sub_meshes", "mlp", "3d", {"dp": 1, "tp_x": 1, "tp_y": 2, "tp_z": 1}, {}),
    "padded-1d": ("padded", "llama", "megatron", {"tp": 2}, {}),
    "padded-1d-gpt2": ("padded", "gpt2", "megatron", {"tp": 2}, {}),
    "plain-torchtitan-fsdp": ("plain", "llama", "replicate", {"dp": 2}, _TORCHTITAN),
    "local-shards-1d": ("plain", "llama", "megatron", {"tp": 2}, {}),
}
_CASE_FLAGS = {"comm-1d-spmd": {"spmd": True}, "local-shards-1d": {"op_names": True}}


@functools.cache
def _graph(model: str):
    from autoshard.capture import capture

    x, _ = example_batch(model, 2)
    return capture(build(model), (x,))


@functools.cache
def _results() -> dict[str, object]:
    cases = []
    for case_id, (check, model, family, degrees, options) in CHECKS.items():
        plan = make_plan(_graph(model), MeshSpec.of(**degrees), family, global_batch=BATCH, **options)
        cases.append({"id": case_id, "check": check, "model": model, "plan": plan, "graph": _graph(model),
                      "batch": BATCH, **_CASE_FLAGS.get(case_id, {})})
    per_rank = run_world(contract_checks, 2, cases, timeout_s=300)
    return {r["id"]: [rank[i]["result"] for rank in per_rank] for i, r in enumerate(per_rank[0])}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case_id", ["outputs-1d", "outputs-split"])
def test_outputs_are_plain_local_tensors_over_the_full_vocabulary(case_id):
    for r in _results()[case_id]:
        assert r["logits_type"] == "Tensor"
        assert r["logits_shape"] == (r["local_batch"], 16, 128)
        assert r["dtensor_params"]
        assert r["state_dict_keys_kept"]


@pytest.mark.timeout(400)
def test_the_module_says_where_the_models_code_runs_and_why():
    # GPT-2 splits its fused q/k/v output by the full hidden size: not on a shard, so on DTensors
    for r in _results()["outputs-1d"]:
        assert r["execution"].startswith("DTensors throughout (SPMD mode): its forward fails on local shards")
    for r in _results()["outputs-split"]:
        assert r["execution"] == "plain tensors (no tensor-parallel axis)"


@pytest.mark.timeout(400)
def test_parameter_names_are_kept_except_under_operator_splitting():
    assert all(r["param_names_kept"] and not r["split_names"] for r in _results()["outputs-1d"])
    split = _results()["outputs-split"][0]["split_names"]
    assert split[:2] == ["transformer.h.0.mlp.c_fc.slices.0.weight", "transformer.h.0.mlp.c_fc.slices.1.weight"]
    assert len(split) == 6


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case_id", ["comm-1d", "comm-1d-spmd"])
def test_megatron_step_sends_exactly_megatrons_collectives(case_id):
    # forward: embedding + 2 per layer all-reduces (5); backward: the input gradient of each attention and MLP
    # block and of the head (5); the logits are gathered once for the caller. The same on local shards (the
    # fan-out to q, k, v takes its gradient back as one partial sum) as with every op on DTensors.
    for r in _results()[case_id]:
        assert r == {"all_gather": LOGIT_BYTES, "all_reduce": 10 * ACT_BYTES}


@pytest.mark.timeout(400)
def test_fused_qkv_is_split_by_heads_without_communication():
    # GPT-2's c_attn holds q, k and v side by side: stored part by part, split locally. Same collectives as
    # Llama's separate projections, plus the position embedding's all-reduce (1, S, H) in forward.
    for r in _results()["comm-1d-fused-qkv"]:
        assert r == {"all_gather": LOGIT_BYTES, "all_reduce": 10 * ACT_BYTES + 16 * 64 * 4}


@pytest.mark.timeout(400)
def test_data_parallel_step_all_reduces_every_gradient_once():
    for r in _results()["comm-dp"]:
        assert r == {"all_reduce": MLP_PARAM_BYTES}


@pytest.mark.timeout(400)
def test_zero3_step_gathers_parameters_in_forward_and_backward_and_reduce_scatters_gradients():
    for r in _results()["comm-zero3"]:
        assert r == {"all_gather": 2 * MLP_PARAM_BYTES, "reduce_scatter": MLP_PARAM_BYTES}


@pytest.mark.timeout(400)
def test_plan_for_another_world_size_fails_on_every_rank_with_a_runtime_setup_error():
    for message in _results()["wrong-world"]:
        assert "needs 4 ranks but this job has 2" in message


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case_id", ["padded-dp", "padded-1d", "padded-1d-gpt2"])
def test_padded_batches_match_single_process_where_tokens_are_real(case_id):
    assert max(_results()[case_id]) <= 1e-5


@pytest.mark.timeout(400)
def test_tensor_parallel_sub_mesh_flattens_the_2d_and_3d_axes():
    for r in _results()["sub-meshes"]:
        assert r == {"tp_size": 2, "tp_names": ("tp",), "dp_size": 1}


@pytest.mark.timeout(400)
def test_data_parallel_plan_runs_on_plain_tensors_with_torchtitans_fsdp_units():
    # no tensor-parallel axis: forward and backward dispatch nothing on DTensors (FSDP2 hands the modules
    # plain unsharded parameters); one unit per decoder layer gathered in forward and again in backward, the
    # ZeRO-2 embedding / norm / head held by the root and gathered once: 2 x 2 + 1 all-gathers, 2 + 1
    # reduce-scatters, as fully_shard by hand (scripts/bench_runtime_overhead.py)
    for r in _results()["plain-torchtitan-fsdp"]:
        assert r == {"dtensor_ops": 0, "calls": {"all_gather": 5, "reduce_scatter": 3}}


@pytest.mark.timeout(400)
def test_megatron_llama_runs_its_attention_norms_and_residuals_on_local_tensors():
    # torchtitan's way (local_shards.py): DTensors only inside the Linears, embedding and head; Llama's
    # attention, rotary, RMSNorm and residual adds run on this rank's shards, with Megatron's collectives
    for r in _results()["local-shards-1d"]:
        assert r["local_shards"]
        names = set(r["dtensor_op_names"])
        assert "aten.mm.default" in names
        for local_op in ("aten._scaled_dot_product_flash_attention_for_cpu.default", "aten.rsqrt.default",
                         "aten.add.Tensor", "aten.cat.default"):
            assert local_op not in names
        assert r["calls"] == {"all_gather": 1, "all_reduce": 10}
