"""Every strategy family, applied by the runtime on real gloo ranks, equals the single-process run.

Cases sharing a world size run in one spawned world (rank start-up and process-group set-up are paid once);
each case still has its own test, which reads the world's results. Per case and rank: the loss and every
gradient after one step, and every parameter after three AdamW steps, against a single-process copy of the
same model on the same global batch (fp32, atol 1e-5).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
from dist_checks import assert_params_within_adamw_bound, compare_cases
from dist_harness import run_world
from dist_models import build, example_batch
from dist_plans import expected_param_bytes, make_plan

from autoshard.cost_models.prediction import predicted_param_bytes, predicted_step_comm
from autoshard.hardware_profiles.cluster import ClusterSpec
from autoshard.plans.layouts import MeshSpec

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning")]

ATOL = 1e-5
BATCH = 4

# id: (world size, model, family, mesh degrees, plan options)
_MIXED_GPT2 = {"zero": 3, "zero_per_op": {"transformer.h.0.ln_1": 0, "transformer.h.0.attn.c_attn": 2,
                                          "transformer.h.1.mlp.c_fc": 0},
               "split": {"transformer.h.0.mlp.c_fc": 2, "transformer.h.1.mlp.c_proj": 4}}
_MIXED_LLAMA = {"zero": 3, "zero_per_op": {"model.layers.0.input_layernorm": 0,
                                           "model.layers.0.self_attn.q_proj": 2, "model.layers.1.mlp.up_proj": 0},
                "split": {"model.layers.0.mlp.down_proj": 2, "model.layers.1.self_attn.o_proj": 4}}
CASES: dict[str, tuple[int, str, str, dict, dict]] = {}
for _m, _mixed in (("gpt2", _MIXED_GPT2), ("llama", _MIXED_LLAMA)):
    CASES |= {
        f"{_m}-dp": (2, _m, "replicate", {"dp": 2}, {}),
        f"{_m}-zero3": (4, _m, "replicate", {"dp": 4}, {"zero": 3}),
        f"{_m}-zero2": (4, _m, "replicate", {"dp": 4}, {"zero": 2}),
        f"{_m}-mixed-zero-split": (2, _m, "replicate", {"dp": 2}, _mixed),
        f"{_m}-1d": (2, _m, "megatron", {"tp": 2}, {}),
        f"{_m}-1d-sp": (2, _m, "megatron-sp", {"tp": 2}, {}),
        f"{_m}-2d": (4, _m, "2d", {"tp_r": 2, "tp_c": 2}, {}),
        f"{_m}-dp-1d": (4, _m, "megatron", {"dp": 2, "tp": 2}, {"zero": 3}),
        f"{_m}-dp-2d": (8, _m, "2d", {"dp": 2, "tp_r": 2, "tp_c": 2}, {}),
    }
# torchtitan's sequence parallelism: a norm's shard gathered once for the column Linears reading it, kept gathered
CASES["llama-1d-sp-gather-once"] = (2, "llama", "torchtitan-sp", {"tp": 2}, {})
CASES["mlp-3d"] = (8, "mlp", "3d", {"tp_x": 2, "tp_y": 2, "tp_z": 2}, {})
CASES["llama-3d"] = (8, "llama", "3d", {"tp_x": 2, "tp_y": 2, "tp_z": 2}, {})  # 3D on a transformer
# Qwen2 is not in the zoo (RMSNorm, rotary, biased q/k/v, grouped-query attention with 2 kv heads): it goes
# through the public entry point, which loads the plan from a file and captures the graph on every rank.
CASES["qwen2-dp-1d-public-api"] = (4, "qwen2", "megatron", {"dp": 2, "tp": 2}, {"zero": 2})
# GPT-NeoX: not in the zoo either; its fused QKV is laid out per head (split after a view), parallel residual
CASES["neox-1d"] = (2, "neox", "megatron", {"tp": 2}, {})
# nanoGPT-style attention that reshapes with view(B, T, heads, -1): runs on shards but computes other values
CASES["gpt-heads-minus-one-1d"] = (2, "gpt-heads-minus-one", "megatron", {"tp": 2}, {})
# full recompute: each block's forward runs again in backward, its tensor-parallel collectives too (the 2D
# weights' gathers, the norms' statistics, the redistributions inside the block), up to the block's last op
# that keeps a tensor for backward (torch's non-reentrant checkpoint stops there). Not here: 2D under full
# recompute, whose ops also checkpoint themselves (they keep sharded inputs): its all-gathers measured 917,504
# bytes per step against 983,040 predicted (+7%; 688,128 before replays were counted), stop 38
CASES["llama-1d-full-recompute"] = (2, "llama", "megatron", {"tp": 2}, {"recompute": "full"})
# compiled blocks (Plan.compile: each block torch.compile'd by Inductor on CPU, after recompute, before FSDP2),
# against the eager single process: data parallel, ZeRO-3 with full and with selective recompute
CASES["llama-dp-compiled"] = (2, "llama", "replicate", {"dp": 2}, {"compile": True})
CASES["gpt2-zero3-compiled-full-recompute"] = (2, "gpt2", "replicate", {"dp": 2},
                                               {"zero": 3, "recompute": "full", "compile": True})
CASES["llama-zero3-compiled-selective-recompute"] = (2, "llama", "replicate", {"dp": 2},
                                                     {"zero": 3, "recompute": "selective", "compile": True})
# per-op ZeRO levels and operator splitting (OSDP) under compiled blocks: what the planner returns on GPUs
CASES["llama-mixed-zero-split-compiled"] = (2, "llama", "replicate", {"dp": 2}, {**_MIXED_LLAMA, "compile": True})
# compiled blocks on DTensors (runtime/compile.py): sequence parallelism, and FSDP2 x TP as torchtitan composes them
# (each block one FSDP unit), 2D tensor parallelism (its weights gathered inside the call, checkpointed)
CASES["llama-1d-sp-compiled"] = (2, "llama", "megatron-sp", {"tp": 2}, {"compile": True})
CASES["gpt2-dp-1d-zero3-compiled"] = (4, "gpt2", "megatron", {"dp": 2, "tp": 2}, {"zero": 3, "compile": True})
CASES["llama-2d-compiled"] = (4, "llama", "2d", {"tp_r": 2, "tp_c": 2}, {"compile": True})


@functools.cache
def _graph(model: str):
    from autoshard.capture import capture

    x, _ = example_batch(model, 2)
    return capture(build(model), (x,))


# the 8-rank world (3D, and 2D with data parallelism) runs in the long suite (`-m long`, README "Development"):
# it costs ~2.5 minutes on two cores; the 2- and 4-rank worlds cover every other family
# (Megatron's sequence parallelism is quick in gpt2-1d-sp and llama-1d-sp-compiled; llama-1d-sp runs long)
LONG = {"gpt2-dp-2d", "llama-dp-2d", "llama-3d", "mlp-3d", "llama-2d-compiled", "llama-1d-sp"}


def _params(cases):
    return [pytest.param(c, marks=pytest.mark.long) if c in LONG else c for c in cases]


def _results(case_id: str, tmp_dir: str) -> list[dict]:
    """Every rank's result of `case_id`: cases of one world size (and suite) run in one spawned world."""
    return _world_results(CASES[case_id][0], case_id in LONG, tmp_dir)[case_id]


@functools.cache
def _world_results(world: int, long: bool, tmp_dir: str) -> dict[str, dict]:
    cases = []
    for case_id, (w, model, family, degrees, options) in CASES.items():
        if w != world or (case_id in LONG) != long:
            continue
        options = dict(options)
        recompute, compiled = options.pop("recompute", "none"), options.pop("compile", False)
        plan = make_plan(_graph(model), MeshSpec.of(**degrees), family, global_batch=BATCH, **options)
        plan = dataclasses.replace(plan, recompute=recompute, compile=compiled)
        cluster = ClusterSpec.parse(f"1x{world}xcpu")
        case = {"id": case_id, "model": model, "batch": BATCH,
                "expected_param_bytes": expected_param_bytes(plan, _graph(model)),
                "predicted_param_bytes": predicted_param_bytes(plan, _graph(model), cluster),
                "predicted_comm": predicted_step_comm(plan, _graph(model), cluster)}
        if case_id.endswith("public-api"):
            case["plan_file"] = str(Path(tmp_dir, f"{case_id}.json"))
            plan.save(case["plan_file"])
        else:
            case |= {"plan": plan, "graph": _graph(model)}
        cases.append(case)
    per_rank = run_world(compare_cases, world, cases, timeout_s=480)
    for i, case in enumerate(cases):  # what the parent predicted, beside what every rank measured
        for rank in per_rank:
            rank[i] |= {k: case[k] for k in ("predicted_param_bytes", "predicted_comm")}
    return {r["case"]: [rank[i] for rank in per_rank] for i, r in enumerate(per_rank[0])}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case_id", _params(CASES))
def test_loss_gradients_and_adamw_steps_match_single_process(case_id, record_property, tmp_path_factory):
    results = _results(case_id, str(tmp_path_factory.getbasetemp()))
    worst = {k: max(r[k] for r in results) for k in ("loss_diff", "grad_diff", "param_diff")}
    for k, v in worst.items():
        record_property(k, v)
    print(f"{case_id}: loss {worst['loss_diff']:.1e} grad {worst['grad_diff']:.1e} "
          f"(at {results[0]['grad_worst']}) params after 3 AdamW steps {worst['param_diff']:.1e} "
          f"param bytes/rank {[r['param_bytes'] for r in results]}")
    assert [r["param_bytes"] for r in results] == [results[0]["expected_param_bytes"]] * len(results)
    assert all(r["compiled_graphs"] > 0 for r in results) == CASES[case_id][4].get("compile", False)
    assert worst["loss_diff"] <= ATOL
    assert worst["grad_diff"] <= ATOL, results[0]["grad_worst"]
    assert_params_within_adamw_bound(results)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case_id", _params(CASES))
def test_parameter_bytes_per_rank_equal_the_planners_prediction(case_id, tmp_path_factory):
    results = _results(case_id, str(tmp_path_factory.getbasetemp()))
    assert [r["param_bytes"] for r in results] == [results[0]["predicted_param_bytes"]] * len(results)


# the cost model prices every family's collectives exactly (3D on Llama too) but two, measured: the 3D MLP's
# all-gather and reduce-scatter 32 bytes (0.93%, 1.05%) short of what runs (one (B, H) / 8 tensor, not yet found),
# and GPT-2 dp x 1D's all-gather 3,072 bytes (0.67%) above the prediction on every rank (also before issue
# 15's changes; the unpriced gather is not yet found), compiled the same
COMM_TOLERANCE = {"mlp-3d": 0.011, "gpt2-dp-1d": 0.007, "gpt2-dp-1d-zero3-compiled": 0.007}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case_id", _params(CASES))
def test_bytes_issued_per_step_equal_the_cost_model(case_id, tmp_path_factory):
    """Every collective kind the cost model prices, on every rank: measured bytes of one forward + backward
    equal `predicted_step_comm` (within `COMM_TOLERANCE` where the model is not exact). gloo has no all-to-all: DTensor falls back
    to an all-gather there, so the two kinds are compared together."""
    results = _results(case_id, str(tmp_path_factory.getbasetemp()))

    def merged(comm: dict) -> dict:
        out = dict(comm)
        if "all_to_all" in out:
            out["all_gather"] = out.get("all_gather", 0) + out.pop("all_to_all")
        return {k: v for k, v in out.items() if v}

    for rank, r in enumerate(results):
        measured, predicted = merged(r["comm"]), merged(r["predicted_comm"])
        print(f"{case_id} rank {rank}: measured {measured} predicted {predicted}")
        assert set(measured) == set(predicted), (measured, predicted)
        for kind, want in predicted.items():
            tolerance = COMM_TOLERANCE.get(case_id, 1e-9)
            assert abs(measured[kind] - want) <= tolerance * want, (kind, measured, predicted)


# -- what 2D and 3D send: exactly the schemes the cost model prices --------------------------------------------
COMM_CASES = ("llama-2d", "mlp-3d")


def _optimus_bytes(linears, *, batch, seq, q, norms, hidden, vocab, bytes_per=4) -> dict[str, int]:
    """One step of Optimus 2D on q x q (Xu et al. 2021), as the runtime applies it. Per Linear (K in, N out):
    forward all-gathers the input over tp_c ((B/q) S K) and the weight over tp_r (K N / q); backward gathers
    both again (the checkpoint) and reduce-scatters dX over tp_c and dW over tp_r. Per norm: one statistic
    all-reduced over tp_c in forward and one in backward ((B/q) S), its weight gradient over tp_r (H/q).
    The embedding's gradient is all-reduced over tp_r (V H/q); the logits are gathered for the caller."""
    per_linear = sum((batch // q) * seq * k + k * n // q for k, n in linears) * bytes_per
    logits = ((batch // q) * seq * vocab + batch * seq * vocab) * bytes_per
    stats = norms * (2 * (batch // q) * seq + hidden // q) * bytes_per
    return {"all_gather": 2 * per_linear + logits, "reduce_scatter": per_linear,
            "all_reduce": stats + vocab * hidden // q * bytes_per}


@pytest.mark.timeout(600)
def test_optimus_2d_step_sends_exactly_the_optimus_collectives(tmp_path_factory):
    layer = [(64, 64)] * 4 + [(64, 128)] * 2 + [(128, 64)]  # q, k, v, o; gate, up; down
    expected = _optimus_bytes(layer * 2 + [(64, 128)], batch=BATCH, seq=16, q=2, norms=5, hidden=64, vocab=128)
    for rank in _results("llama-2d", str(tmp_path_factory.getbasetemp())):
        assert rank["comm"] == expected


def _bian_mlp_bytes(*, batch, hidden, ffn, blocks, q, bytes_per=4) -> dict[str, int]:
    """One step of 3D tensor parallelism on q x q x q (Bian et al. 2021; gathered tensors kept for backward, as
    Colossal-AI does) on the MLP (blocks of hidden -> ffn -> hidden, then a hidden -> hidden head), in elements:
    per Linear (K -> N) the forward all-gathers its weight over x (K N / q^2 remain, sharded on y and z), its
    input over y or z ((B/q) (K/q); not for the first block, whose input arrives replicated) and
    reduce-scatters its partial output onto the batch over the other axis ((B/q) (N/q); not the head's,
    which goes to the caller: all-reduced over z, gathered over y and x). Backward reduce-scatters dW over x
    and dX over the input's axis, all-gathers the output gradient, and all-reduces bias gradients over x."""
    linears = [(k, n, b > 0 or k == ffn, True) for b in range(blocks) for k, n in ((hidden, ffn), (ffn, hidden))]
    linears.append((hidden, hidden, True, False))  # (K, N, input gathered, output reduce-scattered)
    weights = sum(k * n // q**2 for k, n, _, _ in linears)
    inputs = sum((batch // q) * (k // q) for k, _, gathered, _ in linears if gathered)
    outputs = sum((batch // q) * (n // q) for _, n, _, scattered in linears if scattered)
    to_caller_gathers = (batch // q) * hidden + batch * hidden
    elements = {"all_gather": weights + inputs + to_caller_gathers + outputs,
                "reduce_scatter": outputs + weights + inputs,
                "all_reduce": (batch // q) * (hidden // q) + sum(n // q for _, n, _, _ in linears)}
    return {k: v * bytes_per for k, v in elements.items()}


@pytest.mark.long
@pytest.mark.timeout(600)
def test_3d_step_gathers_each_weight_once_and_reduce_scatters_outputs_and_gradients(tmp_path_factory):
    expected = _bian_mlp_bytes(batch=BATCH, hidden=16, ffn=32, blocks=2, q=2)
    for rank in _results("mlp-3d", str(tmp_path_factory.getbasetemp())):
        assert rank["comm"] == expected


# -- where the model's own code runs: local shards or DTensors (local_shards.py) ---------------------------------
# Not on local shards: GPT-2 splits its fused q/k/v projection by an explicit size (`split(self.split_size)`),
# which a shard cannot follow; under sequence parallelism Llama's attention reshapes the gathered q with the
# shape of its sequence-sharded input; the MLP adds its replicated input to a 3D-sharded output (a
# redistribution only DTensor makes); `view(B, T, heads, -1)` runs on a shard without error but halves the
# head dim, which only the check of outputs on the example inputs sees. Those run every op on DTensors (SPMD
# mode), and are equal all the same.
# llama-3d: the local-shards check runs the example inputs (batch 2), which 3D's x * y = 4 batch shards cannot
# split (the runtime says so in `why_not_local`); it runs on DTensors
# Compiled blocks keep the model's code on DTensors (local_shards.compiled_blocks): Dynamo traces it whole.
_SPMD_MODE = {"llama-1d-sp", "llama-1d-sp-gather-once", "mlp-3d", "gpt-heads-minus-one-1d", "llama-3d",
              *(c for c, spec in CASES.items() if spec[4].get("compile"))}
_TENSOR_PARALLEL = [c for c, (_, _, family, _, _) in CASES.items() if family != "replicate"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case_id", _params(_TENSOR_PARALLEL))
def test_tensor_parallel_code_runs_on_local_shards_where_it_computes_the_same(case_id, tmp_path_factory):
    results = _results(case_id, str(tmp_path_factory.getbasetemp()))
    expected = CASES[case_id][1] != "gpt2" and case_id not in _SPMD_MODE
    assert [r["local_shards"] for r in results] == [expected] * len(results), results[0]["why_not_local"]
    if CASES[case_id][4].get("compile"):
        assert "compiles its blocks" in results[0]["why_not_local"]
