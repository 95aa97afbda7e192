"""Activation memory per rank under the runtime's plans equals what the cost model charges, measured.

Each rank runs one forward pass of the parallelized tiny model under torch.autograd.graph.saved_tensors_hooks
(dist_memory.py); the cost model's figure is the sum of the plan's per-op saved bytes for one micro-batch
(`Evaluation.op_costs[...].saved_bytes`), the quantity it multiplies by the micro-batches in flight. The GPT-2
here runs transformers' default `gelu_new`, eight pointwise kernels whose intermediates eager autograd keeps.
Under full recompute the runtime's checkpointing keeps each block's input (selective recompute keeps its tensors
inside the checkpoint's own storage, which these hooks do not see, so it is not checked here).
"""

import functools
from dataclasses import replace

import pytest
from dist_harness import run_world
from dist_memory import saved_activation_bytes
from dist_models import build, example_batch
from dist_plans import make_plan

from autoshard.api import resolve_cluster
from autoshard.cost_models.prediction import evaluate_plan, predicted_recv_buffer_bytes
from autoshard.plans.layouts import MeshSpec

pytestmark = [pytest.mark.distributed]

BATCH = 4
# id: (model, family, mesh degrees, plan options)
CASES = {
    "llama-dp": ("llama", "replicate", {"dp": 2}, {}),
    "llama-zero3": ("llama", "replicate", {"dp": 2}, {"zero": 3}),
    "llama-1d": ("llama", "megatron", {"tp": 2}, {}),
    "llama-1d-sp": ("llama", "megatron-sp", {"tp": 2}, {}),
    # torchtitan's sequence parallelism: the norm's shard gathered once for q, k, v (gate, up) and kept gathered
    "llama-1d-sp-gather-once": ("llama", "torchtitan-sp", {"tp": 2}, {}),
    "gpt2-1d": ("gpt2", "megatron", {"tp": 2}, {}),
    "gpt2-1d-sp": ("gpt2", "megatron-sp", {"tp": 2}, {}),
    "llama-1d-full-recompute": ("llama", "megatron", {"tp": 2}, {"recompute": "full"}),
    "gpt2-dp-full-recompute": ("gpt2", "replicate", {"dp": 2}, {"recompute": "full"}),
}


@functools.cache
def _graph(model: str):
    from autoshard.capture import capture

    x, _ = example_batch(model, 2)
    return capture(build(model), (x,))


# on 4 ranks: 2D (Optimus) tensor parallelism, every activation sharded over the two axes
CASES_4 = {
    "llama-2d": ("llama", "2d", {"tp_r": 2, "tp_c": 2}, {}),
    "gpt2-2d": ("gpt2", "2d", {"tp_r": 2, "tp_c": 2}, {}),
}


@functools.cache
def _results(world: int = 2) -> dict[str, tuple[list[int], float]]:
    cases, predicted = [], {}
    for case_id, (model, family, degrees, options) in (CASES if world == 2 else CASES_4).items():
        options = dict(options)
        recompute = options.pop("recompute", "none")
        plan = replace(make_plan(_graph(model), MeshSpec.of(**degrees), family, global_batch=BATCH, **options),
                       recompute=recompute)
        ev = evaluate_plan(plan, _graph(model), resolve_cluster(f"1x{world}xcpu"))
        predicted[case_id] = sum(c.saved_bytes for c in ev.op_costs.values())
        cases.append({"id": case_id, "model": model, "plan": plan, "batch": BATCH})
    per_rank = run_world(saved_activation_bytes, world, cases, timeout_s=300)
    return {c["id"]: ([rank[i] for rank in per_rank], predicted[c["id"]]) for i, c in enumerate(cases)}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case_id", list(CASES))
def test_each_rank_keeps_the_activation_bytes_the_cost_model_charges(case_id):
    measured, predicted = _results()[case_id]
    for m in measured:
        assert predicted == pytest.approx(m, rel=0.05), (case_id, measured, predicted)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case_id", list(CASES_4))
def test_each_of_four_ranks_keeps_the_activation_bytes_the_cost_model_charges_under_2d(case_id):
    measured, predicted = _results(4)[case_id]
    for m in measured:
        assert predicted == pytest.approx(m, rel=0.05), (case_id, measured, predicted)


# pipelines on 2 ranks: (model, layers, schedule, virtual stages, micro-batches of 1 sample)
PIPELINES = {
    "llama-1f1b": ("llama", 4, "1f1b", 1, 4),
    "llama-gpipe": ("llama", 4, "gpipe", 1, 4),
    "llama-interleaved-v3": ("llama", 6, "interleaved-1f1b", 3, 4),
}


@functools.cache
def _pipeline_results() -> dict[str, tuple[list[int], list]]:
    from dist_memory import pipeline_peak_bytes
    from pipeline_helpers import batch, build_model, make_pipeline_plan

    from autoshard.capture import capture

    cases, predicted = [], {}
    for case_id, (model, layers, schedule, v, m) in PIPELINES.items():
        graph = capture(build_model(model, layers), (batch(model, 2)[0],))
        plan = make_pipeline_plan(graph, {"pp": 2}, "replicate", global_batch=m, micro_batch=1, schedule=schedule,
                                  virtual_stages=v)
        cluster = resolve_cluster("1x2xcpu")
        # the schedule's receive buffers are not autograd's (test_pipeline.py measures them): left out here
        recv = [predicted_recv_buffer_bytes(plan, graph, cluster, stage=k) for k in range(2)]
        predicted[case_id] = [replace(mem, activations_bytes=mem.activations_bytes - r)
                              for mem, r in zip(evaluate_plan(plan, graph, cluster).stage_memory, recv, strict=True)]
        cases.append({"id": case_id, "model": model, "layers": layers, "plan": plan, "graph": graph, "batch": m})
    per_rank = run_world(pipeline_peak_bytes, 2, cases, timeout_s=300)
    return {c["id"]: ([rank[i] for rank in per_rank], predicted[c["id"]]) for i, c in enumerate(cases)}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case_id", list(PIPELINES))
def test_each_pipeline_stage_holds_the_micro_batches_in_flight_the_cost_model_charges(case_id):
    """Peak bytes autograd holds on each rank during one train step (torch.distributed.pipelining's schedule):
    the first stage p + (p - 1)/v micro-batches' activations, the last stage its warmup's (interleaved with v = 3:
    5/3, where p - stage + (p - 1)/v said 4/3), with the loss's saved log-probabilities of the micro-batches in
    flight, which the cost model holds in the activations (`evaluate.held_loss_bytes`; the schedule's receive
    buffers apart). Within 10%: the tiny model's rotary tables and masks are a few % of a layer."""
    (first, last), stages = _pipeline_results()[case_id]
    assert first == pytest.approx(stages[0].activations_bytes, rel=0.10)
    assert last == pytest.approx(stages[1].activations_bytes, rel=0.10)
