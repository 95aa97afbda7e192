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
def _graph():
    from autoshard.capture import capture

    x, _ = example_batch("llama", 2)
    return capture(build("llama"), (x,))


@functools.cache
def _plan(recipe: str, zero: int = 3):
    from dist_plans import make_plan

    plan = make_plan(_graph(), MeshSpec.of(dp=2), "replicate", global_batch=4, zero=zero)
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


def _gathered_float8_bytes(rank: int, world: int, plans) -> list[dict]:
    """Per plan: the bytes FSDP2 holds, after a forward, for each float8 Linear's gathered weight."""
    from torch.distributed.fsdp import FSDPModule

    from autoshard.runtime.apply import apply_plan
    from autoshard.runtime.mesh import build_device_mesh

    out = []
    for plan in plans:
        model = apply_plan(build("llama"), plan, mesh=build_device_mesh(plan.mesh))
        x, y = example_batch("llama", 4)
        lx, _ = model.shard_inputs((x, y))
        model(lx)
        held = {}
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for p in group.fsdp_params:
                    if p.all_gather_outputs and p.all_gather_outputs[0].dtype == torch.float8_e4m3fn:
                        held[p._param_fqn] = sum(t.untyped_storage().nbytes() for t in p.all_gather_outputs)
        out.append(held)
    return out


@pytest.mark.timeout(300)
def test_fsdp2_holds_a_float8_linears_gathered_weight_in_one_byte_per_element_as_priced():
    """Tensorwise float8 gathers each block Linear's weight in float8 and FSDP2 keeps the gathered float8 tensor
    between uses at ZeRO 0 and 2 (resharding it after the forward at ZeRO 3): the cost model's working copy
    of those weights (`OpCost.param_bytes`, priced on H100s: the CPU has no float8 GEMMs to price, and a float8
    copy is one byte per element at any training precision) is the bytes the ranks hold."""
    from autoshard.cost_models.prediction import evaluate_plan
    from autoshard.hardware_profiles.cluster import ClusterSpec

    graph = _graph()
    plans = [dataclasses.replace(_plan("tensorwise", zero=z), compile=False) for z in (0, 2, 3)]
    results = run_world(_gathered_float8_bytes, 2, plans, timeout_s=240)
    cluster = ClusterSpec.parse("1x2xH100-80GB")
    linears = {p.op: p.module for p in plans[0].ops if p.kind == "linear" and p.layer is not None}
    for r in results:
        for plan, held in zip(plans[:2], r[:2], strict=True):
            priced = evaluate_plan(plan, graph, cluster).op_costs
            assert set(held) == {f"{m}.weight" for m in linears.values()}
            for op, module in linears.items():
                assert held[f"{module}.weight"] == priced[op].param_bytes
        assert sum(r[2].values()) == 0  # ZeRO-3 resharded after the forward


def _scales_once_per_step(rank: int, world: int, plan) -> dict:
    """train_step's loss and the dynamic float8 casts its gathers ran, beside the same step run by hand."""
    from torchao.float8 import fsdp_utils

    from autoshard.runtime.apply import apply_plan
    from autoshard.runtime.mesh import build_device_mesh
    from autoshard.runtime.pipeline_train import attach_loss_fn

    def loss_fn(out, target):
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    dynamic = []
    original = fsdp_utils.hp_tensor_to_float8_dynamic

    def counted(*args, **kwargs):
        dynamic.append(1)
        return original(*args, **kwargs)

    fsdp_utils.hp_tensor_to_float8_dynamic = counted
    models = [apply_plan(build("llama"), plan, mesh=build_device_mesh(plan.mesh)) for _ in range(2)]
    x, y = example_batch("llama", 4)
    lx, ly = models[0].shard_inputs((x, y))
    by_hand = loss_fn(models[0](lx), ly)
    by_hand.backward()
    hand_casts = len(dynamic)
    attach_loss_fn(models[1], loss_fn)
    loss = models[1].train_step((lx,), ly)
    scales = [m.weight._local_tensor._precomputed_scale for m in models[1].modules()
              if type(getattr(getattr(m, "weight", None), "_local_tensor", None)).__name__
              == "WeightWithDynamicFloat8CastTensor"]
    mean = by_hand.detach().clone()
    torch.distributed.all_reduce(mean)
    return {"hand_casts": hand_casts, "step_casts": len(dynamic) - hand_casts, "weights": len(scales),
            "left_scales": sum(s is not None for s in scales), "loss": loss.item(), "hand_loss": mean.item() / world}


@pytest.mark.timeout(300)
def test_train_step_gathers_float8_weights_with_scales_computed_once_per_step_and_the_same_loss():
    """torchtitan precomputes every float8 weight's scale after the optimizer step (one all-reduce); without it
    each FSDP2 gather casts with an amax of its own and an all-reduce per weight. train_step does the former:
    none of its gathers casts dynamically, the loss is the hand-run step's, and no scale outlives the step."""
    plan = dataclasses.replace(_plan("tensorwise", zero=3), compile=False)
    for r in run_world(_scales_once_per_step, 2, plan, timeout_s=240):
        assert r["weights"] > 0 and r["hand_casts"] >= r["weights"]
        assert r["step_casts"] == 0
        assert r["left_scales"] == 0
        assert r["loss"] == pytest.approx(r["hand_loss"], rel=1e-6)
