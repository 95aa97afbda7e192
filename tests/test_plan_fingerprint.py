"""A plan applies to the graph it was made for, or to one that differs only in what the plan does not place
(parameter-free ops inside a module's own forward, which another transformers version writes differently);
anything else is refused with the ops and parameters that differ named."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from autoshard.capture import capture
from autoshard.cost_models.reprice import price_plan
from autoshard.errors import PlanFileError
from autoshard.hardware_profiles import ClusterSpec
from autoshard.planner.estimate import HandConfig, estimate
from autoshard.plans.plan import Plan
from autoshard.runtime.specs import check_fingerprint, module_specs

HIDDEN = 8


class Block(nn.Module):
    def __init__(self, *, ffn: int, scaled: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, ffn)
        self.act = nn.ReLU()  # a module call without parameters: the runtime hooks it too
        self.down = nn.Linear(ffn, HIDDEN)
        self.scaled = scaled

    def forward(self, x):  # x: (B, T, HIDDEN)
        h = self.down(self.act(self.up(self.norm(x))))
        if self.scaled:
            h = h * 0.5  # a parameter-free op in the block's own forward: no module to hook, nothing to place
        return x + h


class Net(nn.Module):
    def __init__(self, *, ffn: int = 16, scaled: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(ffn=ffn, scaled=scaled) for _ in range(2)])
        self.head = nn.Linear(HIDDEN, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def graph_of(model: nn.Module):
    return capture(model, (torch.randn(2, 6, HIDDEN),), name="Net")


@pytest.fixture(scope="module")
def made():
    """(plan, graph) of the plain Net, data parallel over 2 CPU ranks."""
    graph = graph_of(Net())
    plan, _ = estimate(graph, ClusterSpec.parse("1x2xcpu"), HandConfig(dp=2, global_batch=2))
    return plan, graph


def test_a_plan_applies_with_one_warning_to_a_graph_that_differs_only_in_a_parameter_free_op(made, caplog):
    plan, _ = made
    model = Net(scaled=True)
    scaled = graph_of(model)
    assert scaled.fingerprint() != plan.fingerprint
    with caplog.at_level("WARNING", logger="autoshard.plans.plan"):
        check_fingerprint(plan, scaled)
        specs = module_specs(plan, scaled, model)  # the runtime's own path: producers read off the graph
    warnings = [r.getMessage() for r in caplog.records if "parameter-free ops" in r.getMessage()]
    assert len(warnings) == 2  # once per check
    # capture coarsens `x + h * 0.5` into one op: the model has a mul where the plan has the residual add
    unplaced = "(2 ops only in the model, e.g. blocks.0.mul, and 2 ops only in the plan, e.g. blocks.0.add)"
    assert unplaced in warnings[0]
    assert "the plan does not place those ops, so it applies" in warnings[0]
    modules = {f"blocks.{i}.{m}" for i in range(2) for m in ("norm", "up", "act", "down")} | {"head"}
    assert set(specs) == modules


def test_the_plan_applies_silently_to_its_own_graph(made, caplog):
    plan, graph = made
    with caplog.at_level("WARNING", logger="autoshard.plans.plan"):
        check_fingerprint(plan, graph_of(Net()))
    assert not caplog.records
    assert plan.binding_fingerprint == graph.binding_fingerprint()


def test_a_parameter_of_another_shape_is_refused_naming_the_op_and_the_parameter(made):
    plan, _ = made
    wider = graph_of(Net(ffn=32))
    with pytest.raises(PlanFileError) as err:
        check_fingerprint(plan, wider)
    msg = str(err.value)
    assert "parameter blocks.0.up.weight of op blocks.0.up is (16, 8) in the plan, (32, 8) in the model" \
        in msg
    assert "and 3 more; re-plan for this model" in msg  # up's weight and bias, down's weight, in 2 blocks: 6
    assert "\n" not in msg


def test_a_module_the_plan_does_not_know_is_refused_by_name(made):
    plan, _ = made

    class WithExtra(Net):
        def __init__(self) -> None:
            super().__init__()
            self.out_norm = nn.LayerNorm(4)

        def forward(self, x):
            return self.out_norm(super().forward(x))

    with pytest.raises(PlanFileError, match=r"op out_norm \(module out_norm\) is in the model only; re-plan"):
        check_fingerprint(plan, graph_of(WithExtra()))


def test_a_plan_file_without_the_binding_fingerprint_loads_and_is_checked_strictly(made):
    plan, _ = made
    old = plan.to_json()
    del old["binding_fingerprint"], old["param_shapes"]
    loaded = Plan.from_json(old)
    assert (loaded.binding_fingerprint, loaded.param_shapes) == ("", ())
    check_fingerprint(loaded, graph_of(Net()))  # its own graph still applies
    with pytest.raises(PlanFileError, match="made by an older autoshard, which records only the whole"):
        check_fingerprint(loaded, graph_of(Net(scaled=True)))


def test_the_binding_fingerprint_and_parameter_shapes_round_trip_through_the_plan_file(made, tmp_path):
    plan, graph = made
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.binding_fingerprint == plan.binding_fingerprint == graph.binding_fingerprint()
    assert loaded.param_shapes == plan.param_shapes
    assert dict(loaded.param_shapes)["blocks.1.up.weight"] == (16, 8)
    assert loaded == plan


def test_the_binding_fingerprint_ignores_parameter_free_ops_but_not_module_calls_or_shapes():
    plain = graph_of(Net())
    assert graph_of(Net(scaled=True)).binding_fingerprint() == plain.binding_fingerprint()
    assert graph_of(Net(ffn=32)).binding_fingerprint() != plain.binding_fingerprint()
    assert [op.name for op in plain.binding_ops()][:4] == ["blocks.0.norm", "blocks.0.up", "blocks.0.act",
                                                           "blocks.0.down"]
    assert "blocks.0.add" not in {op.name for op in plain.binding_ops()}


def test_pricing_needs_the_plans_own_graph_and_names_the_ops_that_differ(made):
    plan, _ = made
    with pytest.raises(PlanFileError, match=r"e.g. blocks.0.add\) and pricing needs a strategy for each op"):
        price_plan(plan, graph_of(Net(scaled=True)), ClusterSpec.parse("1x2xcpu"))


def test_a_plan_without_a_fingerprint_is_not_checked_at_run_time(made):
    plan, _ = made
    check_fingerprint(replace(plan, fingerprint="", binding_fingerprint=""), graph_of(Net(ffn=32)))
