"""What each rank runs in the contract tests: outputs, names, collectives and errors of the runtime."""

from __future__ import annotations

import copy

import torch
from dist_checks import loss_of
from dist_models import build, example_batch
from torch.distributed.tensor import DTensor

from autoshard.errors import RuntimeSetupError
from autoshard.measure import measure_step_comm
from autoshard.runtime import apply_plan, build_device_mesh
from autoshard.runtime.mesh import tensor_parallel_mesh

__all__ = ["contract_checks", "CONTRACT_CHECKS"]


def _apply(case: dict):
    """The plan applied with example inputs, as `autoparallel` does (the model's code may then run on local
    shards), or without (`case["spmd"]`: every op on DTensors)."""
    model = build(case["model"])
    example = None if case.get("spmd") else (example_batch(case["model"], 2)[0],)
    return model, apply_plan(model, case["plan"], mesh=build_device_mesh(case["plan"].mesh), example_inputs=example)


def _step(pmodel, name: str, batch: int):
    x, y = example_batch(name, batch)
    lx, ly = pmodel.shard_inputs((x, y))

    def step():
        loss_of(name, pmodel(lx), ly).backward()

    return step


def _outputs_and_names(case: dict) -> dict:
    """Local plain logits over the full vocabulary for this rank's slice; original FQNs and state_dict keys."""
    names = [n for n, _ in build(case["model"]).named_parameters()]
    keys = list(build(case["model"]).state_dict())
    _, pmodel = _apply(case)
    x, _ = example_batch(case["model"], case["batch"])
    (lx,) = pmodel.shard_inputs((x,))
    logits = pmodel(lx).logits
    return {"logits_type": type(logits).__name__, "logits_shape": tuple(logits.shape),
            "local_batch": lx.shape[0], "dtensor_params": all(isinstance(p, DTensor) for p in pmodel.parameters()),
            "state_dict_keys_kept": list(pmodel.state_dict()) == keys,
            "param_names_kept": [n for n, _ in pmodel.named_parameters()] == names,
            "split_names": [n for n, _ in pmodel.named_parameters() if ".slices." in n],
            "execution": pmodel.execution}


def _comm(case: dict) -> dict:
    """{collective: bytes} of one forward+backward after a warm-up step (FSDP initializes lazily)."""
    _, pmodel = _apply(case)
    step = _step(pmodel, case["model"], case["batch"])
    step()
    pmodel.zero_grad()
    return measure_step_comm(step)


def _plain(case: dict) -> dict:
    """Ops dispatched on DTensors and collectives issued (by count) in one forward+backward after warm-up."""
    from autoshard.measure import CollectiveRecorder

    class Recorder(CollectiveRecorder):
        dtensor_ops = 0
        dtensor_op_names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                self.dtensor_ops += 1
                self.dtensor_op_names.add(str(func))
            return super().__torch_dispatch__(func, types, args, kwargs)

    _, pmodel = _apply(case)
    step = _step(pmodel, case["model"], case["batch"])
    step()
    pmodel.zero_grad()
    with Recorder() as rec:
        step()
    counts: dict[str, int] = {}
    for call in rec.calls:
        counts[call.kind] = counts.get(call.kind, 0) + 1
    if case.get("op_names"):
        return {"local_shards": pmodel._autoshard.local, "dtensor_op_names": sorted(rec.dtensor_op_names),
                "calls": counts}
    return {"dtensor_ops": rec.dtensor_ops, "calls": counts}


def _padded(case: dict) -> float:
    """Largest logit difference to the single-process model at the non-padded positions of a batch with
    left- and right-padded sequences: the model builds a (B, 1, S, S) mask, which must be sharded like the
    attention's batch / heads."""
    model = build(case["model"])
    ref = copy.deepcopy(model)
    ids, _ = example_batch(case["model"], case["batch"])
    pmodel = apply_plan(model, case["plan"], mesh=build_device_mesh(case["plan"].mesh), example_inputs=(ids[:2],))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    mask[2, 11:] = 0  # right padding
    want = ref(ids, attention_mask=mask).logits
    local_ids, local_mask, local_want = pmodel.shard_inputs((ids, mask, want))
    got = pmodel(local_ids, attention_mask=local_mask).logits
    keep = local_mask.bool()
    return (got - local_want)[keep].abs().max().item()


def _sub_meshes(case: dict) -> dict:
    mesh = build_device_mesh(case["plan"].mesh)
    tp = tensor_parallel_mesh(mesh)
    return {"tp_size": tp.size(), "tp_names": tp.mesh_dim_names, "dp_size": mesh["dp"].size()}


def _wrong_world(case: dict) -> str:
    try:
        build_device_mesh(case["plan"].mesh)
    except RuntimeSetupError as exc:
        return str(exc)
    return "no error"


CONTRACT_CHECKS = {"outputs": _outputs_and_names, "comm": _comm, "wrong_world": _wrong_world, "padded": _padded,
                   "sub_meshes": _sub_meshes, "plain": _plain}


def contract_checks(rank: int, world: int, cases: list[dict]) -> list[dict]:
    torch.manual_seed(0)
    return [{"id": c["id"], "result": CONTRACT_CHECKS[c["check"]](c)} for c in cases]
