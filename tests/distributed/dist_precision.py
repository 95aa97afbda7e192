"""What each rank runs in the mixed-precision tests: a plan applied with bf16 mixed precision on gloo ranks.

gloo and CPU kernels run bf16, so the GPU default (`runtime/precision.py`) is checked here by asking for it:
per case the dtypes every matmul ran in (forward and backward), the dtype of every gradient and AdamW state
after a step, the loss against the fp32 single-process model, and the bytes of every collective one step
issues (`measure_step_comm`), which the parent compares with the cost model's bf16-mixed prediction.
"""

from __future__ import annotations

import copy
import functools

import torch
from dist_checks import _dp_mean, loss_of
from dist_models import build, example_batch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.cost_models.memory import BF16_MIXED
from autoshard.measure import measure_step_comm
from autoshard.runtime import apply_plan, build_device_mesh

__all__ = ["precision_cases"]

_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default}


class _MatmulDtypes(TorchDispatchMode):
    """The dtypes of the floating-point tensors every matmul reads (local shards of DTensors included)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _MATMULS:
            self.dtypes |= {str(a.dtype) for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
        return func(*args, **(kwargs or {}))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _one(case: dict) -> dict:
    name, plan = case["model"], case["plan"]
    model = build(name)
    ref = copy.deepcopy(model)
    x, y = example_batch(name, case["batch"])
    if plan.pipeline.degree > 1:  # one train_step: micro-batches through the stages, loss on the last
        from autoshard.runtime.pipeline import apply_pipeline_plan
        from autoshard.runtime.pipeline_train import train_step

        pm = apply_pipeline_plan(model, plan, graph=case["graph"], example_inputs=(x[:1],),
                                 loss_fn=functools.partial(loss_of, name), precision=BF16_MIXED)
        lx, ly = pm.shard_inputs((x, y))
        with _MatmulDtypes() as seen:
            loss = train_step(pm, (lx,), ly)
        step = functools.partial(train_step, pm, (lx,), ly)
    else:
        pm = apply_plan(model, plan, mesh=build_device_mesh(plan.mesh), precision=BF16_MIXED)
        lx, ly = pm.shard_inputs((x, y))
        with _MatmulDtypes() as seen:
            loss = loss_of(name, pm(lx), ly)
            loss.backward()
        step = lambda: loss_of(name, pm(lx), ly).backward()  # noqa: E731
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    opt.step()
    states = {str(v.dtype) for s in opt.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0}
    out = {"case": case["id"], "matmul_dtypes": sorted(seen.dtypes),
           "grad_dtypes": sorted({str(_local(p.grad).dtype) for p in pm.parameters() if p.grad is not None}),
           "param_dtypes": sorted({str(_local(p).dtype) for p in pm.parameters()}),
           "state_dtypes": sorted(states), "ref_loss": loss_of(name, ref(x), y).item(),
           "loss": loss.item() if plan.pipeline.degree > 1 else _dp_mean(loss, pm.mesh)}
    opt.zero_grad()
    out["comm"] = measure_step_comm(step)
    return out


def precision_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [_one(c) for c in cases]
