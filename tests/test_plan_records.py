"""A plan says what it priced: the attention kernel and the solver, kept in the plan file."""

from __future__ import annotations

import pytest
from torch import nn

from autoshard.api import estimate_config, plan
from autoshard.errors import ConfigurationError
from autoshard.plans.plan import Plan

GPT = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"


def test_plan_of_a_decoder_prices_flash_by_default_and_the_plan_file_keeps_kernel_and_solver():
    p = plan(GPT, "1x2xA100-80GB", global_batch=4)
    assert p.attention == "flash"
    assert p.solver in ("HiGHS", "CBC")
    again = Plan.from_json(p.to_json())
    assert (again.attention, again.solver) == (p.attention, p.solver)


def test_attention_sdpa_restricts_the_plan_to_the_masked_kernel_and_estimate_agrees():
    p = plan(GPT, "1x2xA100-80GB", global_batch=4, attention="sdpa")
    hand, _ = estimate_config(GPT, "1x2xA100-80GB", dp=2, global_batch=4, attention="sdpa")
    assert p.attention == hand.attention == "masked"


def test_an_attention_kernel_for_a_module_is_a_typed_error_naming_the_parameter():
    with pytest.raises(ConfigurationError, match="attention='flash' applies to zoo and spec models"):
        plan(nn.Linear(4, 4), "1x2xA100-80GB", example_inputs=(), attention="flash")


def test_a_plan_stopped_at_its_time_limit_is_saved_as_the_incumbent_not_the_optimum(monkeypatch):
    import dataclasses

    import autoshard.planner.search as search_mod

    real_solve = search_mod.solve

    def stopped_at_the_limit(problem, *, time_limit_s):
        sol = real_solve(problem, time_limit_s=time_limit_s)
        return dataclasses.replace(sol, status="time_limit") if sol.status == "optimal" else sol

    assert plan(GPT, "1x2xA100-80GB", global_batch=4).optimal is True
    monkeypatch.setattr(search_mod, "solve", stopped_at_the_limit)
    p = plan(GPT, "1x2xA100-80GB", global_batch=4)
    assert p.optimal is False
    assert Plan.from_json(p.to_json()).optimal is False
    assert p.to_json()["optimal"] is False
