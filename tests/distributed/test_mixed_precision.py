"""bf16 mixed precision, the cost model's precision on GPUs, as the runtime applies it (runtime/precision.py).

On gloo ranks, with the GPU default asked for explicitly: matmuls run in bf16, gradients and AdamW's states stay
fp32, the loss is the fp32 model's to bf16 rounding, and every collective's bytes equal what the cost model
prices for bf16 mixed precision: parameters and activations sent in bf16, gradients reduced in fp32; with FSDP
(a dp axis) casting the parameters, and without it the module runtimes.
"""

from __future__ import annotations

import functools

import pytest
from dist_harness import run_world
from dist_models import build, example_batch
from dist_plans import make_plan
from dist_precision import precision_cases
from pipeline_helpers import make_pipeline_plan

from autoshard.cost_models.prediction import predicted_step_comm
from autoshard.hardware_profiles.cluster import ClusterSpec
from autoshard.plans.layouts import MeshSpec

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning")]

BATCH = 4
# id: (world size, model, family, mesh degrees, plan options)
CASES = {
    "llama-zero3": (2, "llama", "replicate", {"dp": 2}, {"zero": 3}),  # plain tensors, FSDP2
    "gpt2-dp": (2, "gpt2", "replicate", {"dp": 2}, {}),  # ZeRO-0: FSDP2 replicated, gradients all-reduced
    "gpt2-1d": (2, "gpt2", "megatron", {"tp": 2}, {}),  # no dp axis: the module runtimes cast
    "llama-1d-sp": (2, "llama", "megatron-sp", {"tp": 2}, {}),  # sequence parallel: replicated norm weights
    "llama-dp-1d": (4, "llama", "megatron", {"dp": 2, "tp": 2}, {"zero": 3}),  # DTensors under FSDP2
    "gpt2-pp": (2, "gpt2", "replicate", {"pp": 2}, {"micro_batch": 1}),  # one-rank stages: autocast, bf16 sent
}


def _plan(case_id: str):
    w, model, family, degrees, options = CASES[case_id]
    options = dict(options)
    micro_batch = options.pop("micro_batch", None)
    if micro_batch is None:
        return make_plan(_graph(model), MeshSpec.of(**degrees), family, global_batch=BATCH, **options)
    return make_pipeline_plan(_graph(model), degrees, family, global_batch=BATCH, micro_batch=micro_batch,
                              **options)


@functools.cache
def _graph(model: str):
    from autoshard.capture import capture

    x, _ = example_batch(model, 2)
    return capture(build(model), (x,))


@functools.cache
def _world(world: int) -> dict[str, list[dict]]:
    cases = []
    for case_id, (w, model, *_) in CASES.items():
        if w == world:
            cases.append({"id": case_id, "model": model, "batch": BATCH, "plan": _plan(case_id),
                          "graph": _graph(model)})
    per_rank = run_world(precision_cases, world, cases, timeout_s=480)
    return {c["id"]: [rank[i] for rank in per_rank] for i, c in enumerate(cases)}


def _results(case_id: str) -> list[dict]:
    return _world(CASES[case_id][0])[case_id]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case_id", list(CASES))
def test_matmuls_run_in_bf16_while_gradients_and_adamw_states_stay_fp32(case_id):
    for r in _results(case_id):
        assert r["matmul_dtypes"] == ["torch.bfloat16"], r["matmul_dtypes"]
        assert r["param_dtypes"] == ["torch.float32"]
        assert r["grad_dtypes"] == ["torch.float32"]
        assert r["state_dtypes"] == ["torch.float32"]
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=2e-2)  # bf16 keeps 8 bits of mantissa


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case_id", list(CASES))
def test_parameters_gather_in_bf16_and_gradients_reduce_in_fp32_as_the_cost_model_prices(case_id):
    w, model = CASES[case_id][:2]
    predicted = predicted_step_comm(_plan(case_id), _graph(model), ClusterSpec.parse(f"1x{w}xA100-80GB"))  # bf16
    pipelined = "pp" in CASES[case_id][3]
    for rank, r in enumerate(_results(case_id)):
        measured = {k: v for k, v in r["comm"].items() if v}
        if pipelined:  # what the stages send each other; the tied embedding's sync is test_pipeline.py's
            measured = {k: v for k, v in measured.items() if k == "p2p"}
        print(f"{case_id} rank {rank}: measured {measured} predicted {predicted}")
        assert set(measured) == {k for k, v in predicted.items() if v}
        for kind, want in predicted.items():
            assert measured[kind] == pytest.approx(want, rel=1e-9), (kind, measured, predicted)
