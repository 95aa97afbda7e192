"""Runtime pieces that need no process group: placement mapping, plan checks, the split Linear."""

from __future__ import annotations

import pytest
import torch
from dist_models import build, example_batch
from dist_plans import make_plan
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard.errors import ConfigurationError, PlanFileError
from autoshard.planner.for_runtime import RUNTIME_SPACE, runtime_space
from autoshard.plans.layouts import BATCH, FEAT, IN, OUT, PARTIAL, SEQ, MeshSpec, layout
from autoshard.runtime.placements import activation_placements, param_placements
from autoshard.runtime.specs import module_specs
from autoshard.runtime.split import SplitLinear

NAMES = ("dp", "tp")


def test_activation_layouts_map_semantic_dims_per_tensor_rank():
    lay = layout(dp=BATCH, tp=FEAT)
    assert activation_placements(lay, NAMES, torch.zeros(4, 16, 64)) == (Shard(0), Shard(2))
    assert activation_placements(lay, NAMES, torch.zeros(4, 8, 16, 8)) == (Shard(0), Shard(1))  # heads
    assert activation_placements(lay, NAMES, torch.zeros(4, 64)) == (Shard(0), Shard(1))
    assert activation_placements(layout(tp=SEQ), NAMES, torch.zeros(4, 16, 64)) == (Replicate(), Shard(1))
    assert activation_placements(layout(tp=SEQ), NAMES, torch.zeros(4, 16, dtype=torch.long)) == (Replicate(), Shard(1))
    assert activation_placements(layout(tp=PARTIAL), NAMES, torch.zeros(4, 64)) == (Replicate(), Partial())


def test_a_batch_dim_of_one_is_broadcast_not_sharded():
    assert activation_placements(layout(dp=BATCH), NAMES, torch.zeros(1, 16, 64)) == (Replicate(), Replicate())


def test_parameter_layouts_follow_each_module_types_weight_convention():
    from transformers.pytorch_utils import Conv1D

    linear, conv1d, emb = nn.Linear(8, 16), Conv1D(16, 8), nn.Embedding(32, 8)  # Conv1D(nf=out, nx=in)
    assert param_placements(layout(tp=OUT), NAMES, linear, "weight", 2) == (Replicate(), Shard(0))
    assert param_placements(layout(tp=IN), NAMES, linear, "weight", 2) == (Replicate(), Shard(1))
    assert param_placements(layout(tp=OUT), NAMES, conv1d, "weight", 2) == (Replicate(), Shard(1))
    assert param_placements(layout(tp=IN), NAMES, conv1d, "weight", 2) == (Replicate(), Shard(0))
    assert param_placements(layout(tp=IN), NAMES, emb, "weight", 2) == (Replicate(), Shard(0))  # vocab
    assert param_placements(layout(tp=OUT), NAMES, emb, "weight", 2) == (Replicate(), Shard(1))
    assert param_placements(layout(tp=OUT), NAMES, linear, "bias", 1) == (Replicate(), Shard(0))
    with pytest.raises(ValueError, match="row-parallel bias is replicated"):
        param_placements(layout(tp=IN), NAMES, linear, "bias", 1)


def test_planning_space_defaults_to_what_runs_without_pipeline_stages():
    families, schedules = runtime_space(None)
    assert families == frozenset(RUNTIME_SPACE) and "pp" not in families
    assert "looped-bfs" not in schedules  # layered accumulation runs through pipeline schedules only
    assert runtime_space("dp,zero")[0] == frozenset({"dp", "zero"})
    with pytest.raises(ConfigurationError, match="unknown families"):
        runtime_space("dp,tp4d")


def test_a_plan_without_producer_names_needs_its_graph():
    from dataclasses import replace

    from autoshard.capture import capture

    x, _ = example_batch("mlp", 2)
    graph = capture(build("mlp"), (x,))
    plan = make_plan(graph, MeshSpec.of(dp=2), "replicate", global_batch=4)
    old = replace(plan, ops=tuple(replace(p, inputs=()) for p in plan.ops))  # as older plan files are
    with pytest.raises(PlanFileError, match="producers"):
        module_specs(old, None, build("mlp"))
    assert module_specs(old, graph, build("mlp")) == module_specs(plan, None, build("mlp"))


def test_a_plan_made_for_another_model_is_rejected():
    from autoshard.capture import capture

    x, _ = example_batch("mlp", 2)
    graph = capture(build("mlp"), (x,))
    plan = make_plan(graph, MeshSpec.of(dp=2), "replicate", global_batch=4)
    with pytest.raises(PlanFileError, match="re-plan"):
        module_specs(plan, graph, build("gpt2"))


def test_split_linear_equals_the_linear_and_keeps_its_state_dict_keys():
    from transformers.pytorch_utils import Conv1D

    for layer in (nn.Linear(8, 6), Conv1D(6, 8)):
        x = torch.randn(3, 8)
        split = SplitLinear(layer, 4)
        torch.testing.assert_close(split(x), layer(x), atol=1e-6, rtol=0)
        assert list(split.state_dict()) == list(layer.state_dict())
        torch.testing.assert_close(split.state_dict()["weight"], layer.weight.detach())
        fresh = SplitLinear(type(layer)(8, 6) if isinstance(layer, nn.Linear) else Conv1D(6, 8), 4)
        fresh.load_state_dict(layer.state_dict())
        torch.testing.assert_close(fresh(x), layer(x), atol=1e-6, rtol=0)


def _plan_and_specs(name: str, family: str, **degrees):
    from autoshard.capture import capture

    x, _ = example_batch(name, 2)
    graph = capture(build(name), (x,))
    plan = make_plan(graph, MeshSpec.of(**degrees), family, global_batch=4)
    return plan, module_specs(plan, None, build(name))


def test_megatron_plans_need_no_redistribution_in_the_models_own_code():
    from autoshard.runtime.local_shards import plan_blocks_local_shards

    assert plan_blocks_local_shards(*_plan_and_specs("llama", "megatron", tp=2)) is None
    assert plan_blocks_local_shards(*_plan_and_specs("llama", "2d", dp=2, tp_r=2, tp_c=2)) is None


def test_code_adding_a_whole_input_to_a_sharded_output_keeps_the_model_on_dtensors():
    from autoshard.runtime.local_shards import plan_blocks_local_shards

    reason = plan_blocks_local_shards(*_plan_and_specs("mlp", "3d", tp_x=2, tp_y=2, tp_z=2))
    assert reason is not None and "blocks.0" in reason and "input:" in reason


def test_code_reading_partial_sums_keeps_the_model_on_dtensors():
    from dataclasses import replace

    from autoshard.runtime.local_shards import plan_blocks_local_shards

    plan, specs = _plan_and_specs("llama", "megatron", tp=2)
    add = next(p for p in plan.ops if p.op == "model.layers.0.add")
    partial = layout(tp=PARTIAL)
    bad = replace(add, strategy=replace(add.strategy, inputs=(partial, partial), output=partial))
    plan = replace(plan, ops=tuple(bad if p.op == add.op else p for p in plan.ops))
    assert "partial" in plan_blocks_local_shards(plan, specs)


def test_example_inputs_the_plans_batch_shards_do_not_divide_in_twos_are_not_checked():
    from autoshard.runtime.local_shards import uneven_example

    plan, _ = _plan_and_specs("llama", "2d", tp_r=2, tp_c=2)  # Optimus shards the batch over tp_r
    ids, _ = example_batch("llama", 4)
    assert uneven_example(plan, (ids[:4],)) is None
    assert "multiple of 2" in uneven_example(plan, (ids[:3],))
    # shards of one sample broadcast against whole-batch tensors of the model's code: not a check
    assert "at least 4" in uneven_example(plan, (ids[:2],))
    megatron, _ = _plan_and_specs("llama", "megatron", tp=2)  # the batch is whole on tp
    assert uneven_example(megatron, (ids[:1],)) is None


def test_models_with_dropout_keep_their_code_on_dtensors():
    from autoshard.runtime.local_shards import dropout_in

    assert dropout_in(build("llama")) is None  # the test models have dropout off
    model = build("llama")
    model.config.attention_dropout = 0.1  # applied by the attention code itself, not a module
    assert "attention_dropout=0.1" in dropout_in(model)
    mlp = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2))
    assert "p=0.2 in 1" in dropout_in(mlp)
