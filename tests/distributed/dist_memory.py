"""What each rank runs in the activation-memory tests: the bytes autograd keeps for backward in one forward
pass of the parallelized model, on this rank, each storage once (DTensors by their local shard), parameters
excluded (their local shards, views of them and FSDP's unsharded copies)."""

from __future__ import annotations

import torch
from dist_models import build, example_batch
from torch.distributed.tensor import DTensor

from autoshard.runtime import apply_plan, build_device_mesh

__all__ = ["saved_activation_bytes", "pipeline_peak_bytes"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _param_storages(model) -> set[int]:
    return {_local(p).untyped_storage().data_ptr() for p in model.parameters()}


def _is_param(t: torch.Tensor, params: set[int]) -> bool:
    """A parameter, a view of one (linear saves weight.t()) or FSDP's unsharded copy of one."""
    local = _local(t)
    return any(isinstance(x, torch.nn.Parameter) for x in (t, local, t._base, local._base)) \
        or local.untyped_storage().data_ptr() in params


def _one(case: dict) -> int:
    model = build(case["model"])
    x, _ = example_batch(case["model"], case["batch"])
    example = None if case.get("spmd") else (x[:2],)
    pmodel = apply_plan(model, case["plan"], mesh=build_device_mesh(case["plan"].mesh), example_inputs=example)
    params = _param_storages(pmodel)
    (lx,) = pmodel.shard_inputs((x,))
    storages: dict[int, int] = {}

    def pack(t):
        if not _is_param(t, params):
            s = _local(t).untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = pmodel(lx)
    del out
    return sum(storages.values())


def saved_activation_bytes(rank: int, world: int, cases: list[dict]) -> list[int]:
    return [_one(c) for c in cases]


class _Held:
    """What autograd holds for one saved tensor: counts its storage live until autograd lets go of it."""

    def __init__(self, t: torch.Tensor, live: dict, peak: list):
        self.t, self.live, self.peak = t, live, peak
        s = _local(t).untyped_storage()
        self.key = s.data_ptr()
        count, nbytes = live.get(self.key, (0, 0))
        if count == 0:  # a storage freed earlier may have left its address to this one, of another size
            nbytes = s.nbytes()
        live[self.key] = (count + 1, nbytes)
        peak[0] = max(peak[0], sum(n for c, n in live.values() if c > 0))

    def __del__(self):
        count, nbytes = self.live[self.key]
        self.live[self.key] = (count - 1, nbytes)


def _peak_pipeline(case: dict) -> int:
    """Peak bytes autograd holds for backward on this rank during one pipelined train step."""
    from pipeline_helpers import _parallelize, batch, build_model

    from autoshard.runtime.pipeline_train import train_step

    model = build_model(case["model"], case["layers"])
    x, y = batch(case["model"], case["batch"])
    pm = _parallelize(model, case, x)
    params = _param_storages(pm)
    lx, ly = pm.shard_inputs((x, y))
    live: dict = {}
    peak = [0]

    def pack(t):
        return t if _is_param(t, params) else _Held(t, live, peak)

    def unpack(h):
        return h.t if isinstance(h, _Held) else h

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        train_step(pm, (lx,), ly)
    return peak[0]


def pipeline_peak_bytes(rank: int, world: int, cases: list[dict]) -> list[int]:
    return [_peak_pipeline(c) for c in cases]
