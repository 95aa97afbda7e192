"""Float8 block Linears applied by the runtime (torchao, an optional dependency: skipped where it is not
installed) on gloo ranks, with ZeRO-3's float8 all-gather, against the fp32 single process."""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from dist_harness import run_world
from dist_models import build, example_batch

from autoshard.plans.layouts import MeshSpec

pytest.importorskip("torchao.float8", reason="float8 plans need torchao (pip install 'autoshard[float8]')")
pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning")]

STEPS = 3
# e4m3 keeps 3 mantissa bits: each GEMM operand is rounded by up to 2^-4 relative; over a two-block model the
# loss moves far less. The bound is on the loss of each of three AdamW steps, relative to the fp32 run.
LOSS_RTOL = 0.02


@functools.cache
def _plan(recipe: str):
    from dist_plans import make_plan

    from autoshard.capture import capture

    x, _ = example_batch("llama", 2)
    graph = capture(build("llama"), (x,))
    plan = make_plan(graph, MeshSpec.of(dp=2), "replicate", global_batch=4, zero=3)
    return dataclasses.replace(plan, float8=recipe, compile=True)


def _float8_steps(rank: int, world: int, plan) -> dict:
    from torchao.float8.float8_linear import Float8Linear

    from autoshard.runtime.apply import apply_plan
    from autoshard.runtime.mesh import build_device_mesh

    model = build("llama")
    ref = copy.deepcopy(model)
    pmodel = apply_plan(model, plan, mesh=build_device_mesh(plan.mesh))
    names = sorted(n for n, m in pmodel.named_modules() if isinstance(m, Float8Linear))
    x, y = example_batch("llama", 4)
    opt, opt_ref = torch.optim.AdamW(pmodel.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        lx, ly = pmodel.shard_inputs((x, y))
        loss = torch.nn.functional.cross_entropy(pmodel(lx).logits.flatten(0, 1), ly.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = torch.nn.functional.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten())
        ref_loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
        ref_losses.append(ref_loss.item())
    return {"float8": names, "losses": losses, "ref_losses": ref_losses}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_zero3_plan_converts_the_block_linears_and_trains_within_the_stated_loss_tolerance(recipe):
    results = run_world(_float8_steps, 2, _plan(recipe), timeout_s=480)
    block_linears = {p.module for p in _plan(recipe).ops if p.kind == "linear" and p.layer is not None}
    for r in results:
        assert set(r["float8"]) == block_linears  # every block Linear, not the head
        for got, want in zip(r["losses"], r["ref_losses"], strict=True):
            assert got == pytest.approx(want, rel=LOSS_RTOL)
