"""What each rank runs in the family tests: the parallel model against a single-process copy of itself.

For every case: build the model (same seed on every rank), keep a deep copy as the single-process reference,
apply the plan, run the same global batch through both (the parallel one gets this rank's slice), and
compare the loss, every gradient, and every parameter after three AdamW steps. Gradients and parameters are
gathered with `full_tensor()` (all ranks iterate parameters in the same order, so the collectives match).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from adamw_bound import ATOL, AdamWBound
from dist_models import build, example_batch
from torch import nn
from torch.distributed.tensor import DTensor

from autoshard import autoparallel
from autoshard.measure import local_param_bytes, measure_step_comm
from autoshard.runtime import apply_plan, build_device_mesh
from autoshard.runtime.split import SplitLinear

__all__ = ["compare_cases", "loss_of", "full_named", "all_experts", "results_by_case", "assert_matches_one_process",
           "assert_params_within_adamw_bound"]

STEPS = 3
LR = 1e-3
# Adam moves a parameter by lr * m / (sqrt(v) + eps): a gradient near zero (a key bias has an analytically
# zero one) turns a 1e-9 rounding difference into lr * 0.03 = 3e-5 with the default eps=1e-8. eps=1e-6 keeps
# that amplification below the 1e-5 tolerance; gradients themselves are compared before any step.
EPS = 1e-6


def loss_of(name: str, out, target: torch.Tensor) -> torch.Tensor:
    if name == "mlp":
        return F.mse_loss(out, target)
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_named(pmodel: nn.Module, names: list[str], *, grads: bool) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters or gradients under their original names (split Linears re-joined)."""
    out = {}
    for name in names:
        path, _, local = name.rpartition(".")
        module = pmodel.get_submodule(path)
        if isinstance(module, SplitLinear) and local == "weight":
            parts = [_full(s.weight.grad if grads else s.weight) for s in module.slices]
            out[name] = torch.cat(parts, dim=module.in_dim)
        else:
            p = module._parameters[local]
            out[name] = all_experts(module, _full(p.grad if grads else p))
    return out


def all_experts(module: nn.Module, t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` (a parameter of `module`, its gradient or optimizer state) with every rank's experts when `module`
    is an expert-parallel experts module (gathered over the ep group); else `t`."""
    ep = getattr(module, "_autoshard_ep", None)
    if ep is None or ep[1] == 1 or t is None or t.dim() == 0:
        return t
    parts = [torch.empty_like(t) for _ in range(ep[1])]
    dist.all_gather(parts, t.contiguous(), group=ep[0])
    return torch.cat(parts)


def _max_diff(got: dict, want: dict) -> tuple[float, str]:
    worst, where = 0.0, ""
    for name, w in want.items():
        g = got[name]
        d = float("inf") if g is None or g.shape != w.shape else (g.detach() - w.detach()).abs().max().item()
        if d > worst:
            worst, where = d, name
    return worst, where


def _dp_mean(x: torch.Tensor, mesh) -> float:
    names = mesh.mesh_dim_names
    if "dp" not in names:
        return x.item()
    t = x.detach().clone()
    dist.all_reduce(t, group=mesh.get_group("dp"))
    return t.item() / mesh.size(names.index("dp"))


def _parallelize(model: nn.Module, case: dict, x: torch.Tensor) -> nn.Module:
    """Through `apply_plan` with the parent's plan, or through the public entry point: with a plan file
    (case["plan_file"]: rank 0 checks the model's fingerprint) or planning on rank 0 (case["autoplan"]: the
    planner's arguments, e.g. space and memory_cap)."""
    world = dist.get_world_size()
    if "plan_file" in case:
        return autoparallel(model, f"1x{world}xcpu", example_inputs=(x[:2],), global_batch=case["batch"],
                            plan=case["plan_file"])
    if "autoplan" in case:
        return autoparallel(model, f"1x{world}xcpu", example_inputs=(x[:2],), global_batch=case["batch"],
                            **case["autoplan"])
    # the whole batch: 2D's batch shards of 2 can be checked on local shards (uneven_example)
    return apply_plan(model, case["plan"], mesh=build_device_mesh(case["plan"].mesh), example_inputs=(x,))


def _one_case(case: dict) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # an earlier case's graphs would serve this one's blocks: count this case's own
    graphs_before = counters["stats"]["unique_graphs"]
    name, batch = case["model"], case["batch"]
    model = build(name)
    ref = copy.deepcopy(model)
    names = [n for n, _ in ref.named_parameters()]
    x, y = example_batch(name, batch)
    pmodel = _parallelize(model, case, x)
    mesh = pmodel.mesh
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=LR, eps=EPS)
    bound = AdamWBound(opt_ref, dict(ref.named_parameters()), atol=ATOL)
    result: dict = {"case": case["id"], "param_bytes": local_param_bytes(pmodel), "plan": pmodel.plan.to_json(),
                    "local_shards": pmodel._autoshard.local, "why_not_local": pmodel._autoshard.why_not_local,
                    "expected_param_bytes": case.get("expected_param_bytes")}
    for step in range(case.get("steps", STEPS)):
        ref_loss = loss_of(name, ref(x), y)
        ref_loss.backward()
        lx, ly = pmodel.shard_inputs((x, y))
        loss = loss_of(name, pmodel(lx), ly)
        loss.backward()
        if step == 0:
            result["loss_diff"] = abs(_dp_mean(loss, mesh) - ref_loss.item())
            ref_grads = {n: p.grad for n, p in ref.named_parameters()}
            result["grad_diff"], result["grad_worst"] = _max_diff(full_named(pmodel, names, grads=True), ref_grads)
        opt_ref.step()
        bound.after_step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    got = full_named(pmodel, names, grads=False)
    result["param_diff"], result["param_worst"] = _max_diff(got, ref_params)
    result["param_excess"], result["param_excess_at"] = bound.excess(got, ref_params)
    lx, ly = pmodel.shard_inputs((x, y))
    result["comm"] = measure_step_comm(lambda: loss_of(name, pmodel(lx), ly).backward())
    result["compiled_graphs"] = counters["stats"]["unique_graphs"] - graphs_before  # Dynamo's, this case's
    return result


def compare_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Run every case on this rank (all ranks run the same cases in the same order)."""
    return [_one_case(c) for c in cases]



def fail_on_rank(rank: int, world: int, failing: int) -> int:
    """Every rank joins a barrier; then `failing` raises (the harness's own failure reporting is under test)."""
    dist.barrier()
    if rank == failing:
        raise ValueError(f"simulated failure of rank {rank}")
    return rank


def results_by_case(world: int, cases: list[dict], keep: tuple[str, ...] = ("predicted_param_bytes", "predicted_comm"),
                    *, timeout_s: float = 480) -> dict[str, list[dict]]:
    """Run `cases` on `world` gloo ranks (`compare_cases`); per case id, every rank's result, with the case's
    `keep` entries (the parent's predictions) added."""
    from dist_harness import run_world

    per_rank = run_world(compare_cases, world, cases, timeout_s=timeout_s)
    for i, case in enumerate(cases):
        for rank in per_rank:
            rank[i] |= {k: case[k] for k in keep}
    return {r["case"]: [rank[i] for rank in per_rank] for i, r in enumerate(per_rank[0])}


def assert_matches_one_process(case_id: str, results: list[dict], atol: float) -> None:
    """Loss and every gradient after one step within `atol` of the single-process run, on every rank, and every
    parameter after three AdamW steps within the bound AdamW allows for gradients that agree that closely
    (adamw_bound.py)."""
    worst = {k: max(r[k] for r in results) for k in ("loss_diff", "grad_diff", "param_diff")}
    print(f"{case_id}: loss {worst['loss_diff']:.1e} grad {worst['grad_diff']:.1e} "
          f"params after 3 AdamW steps {worst['param_diff']:.1e}")
    assert worst["loss_diff"] <= atol
    assert worst["grad_diff"] <= atol, results[0]["grad_worst"]
    assert_params_within_adamw_bound(results)


def assert_params_within_adamw_bound(results: list[dict]) -> None:
    """Every rank's parameters after the AdamW steps within `AdamWBound` of the single-process run's."""
    worst = max(results, key=lambda r: r["param_excess"])
    assert worst["param_excess"] <= 0, (f"{worst['param_excess_at']} exceeds its AdamW bound by "
                                        f"{worst['param_excess']:.2e}")
