"""Checkpoints that survive a change of plan: torch.distributed.checkpoint (DCP) under every plan (issue 7).

A parallel module keeps its parameters' names (parallel_module.py); `get_state_dict` gives the model's and
the optimizer's state keyed by those names, as DTensors holding this rank's shards. DCP writes each shard
once with its global offsets and, on load, reads into whatever shards the loading plan's DTensors ask for,
so a checkpoint saved under one plan and world size loads under another, bit for bit. Tensors stored part by
part (`_StridedShard`: a fused QKV weight under tensor parallelism) are not one block per rank, which DCP
needs; they are redistributed to plain shards of the same dims around DCP (`_swap_strided`).

On disk, a checkpoint at `path` is a symbolic link to a sibling directory:

    path                   -> path.ckpt-<id>  (relative link; replaced by rename(2), which is atomic)
    path.ckpt-<id>/        a complete DCP checkpoint: .metadata, one .distcp file per rank, autoshard.json
    path.tmp-<id>/         a save in progress, or one that crashed: never at `path`, removed by the next save

A save writes `path.tmp-<id>` (rank 0 creates it, every rank writes its shards, rank 0 adds autoshard.json
with the plan and the world size), renames it to `path.ckpt-<id>` once every rank is done, and only then
swings the link. At every instant `path` holds the previous complete checkpoint or the new one; a crash at
any point leaves the previous one loadable. A directory (not a link) at `path`, e.g. a copy with `cp -rL`,
loads but is not overwritten. A load while another job saves to the same path is not supported.

Not covered: parameter names that depend on the plan (OSDP operator splitting renames a Linear's weight to
`slices.s.weight`, so its optimizer state does not carry over to a plan without the same split).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import empty as dtensor_empty
from torch.distributed.tensor.placement_types import _StridedShard

from autoshard.errors import CheckpointError
from autoshard.runtime.failure import distributed_phase

__all__ = ["save_checkpoint", "load_checkpoint", "export_state_dict", "METADATA_FILE"]

log = logging.getLogger(__name__)

METADATA_FILE = "autoshard.json"
_FORMAT = "autoshard-checkpoint"
_FORMAT_VERSION = 1


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> None:
    """Save `model`'s and `optimizer`'s state (this rank's shards) to the checkpoint `path`; call on every rank.

    `path` is a new path or an earlier checkpoint, on a filesystem every rank sees; it is replaced atomically
    (module docstring). `optimizer` may be None (model state only)."""
    with distributed_phase("save_checkpoint"):
        target = _target(path)
        _check_replaceable(target)
        rank = _rank()
        save_id = _shared_id()
        staging = _sibling(target, "tmp", save_id)
        if rank == 0:
            staging.mkdir()
        _barrier()
        state = _state_of(model, optimizer)
        swapped = _swap_strided(state, _to_plain_shards) + _swap_experts(state, _expert_meshes(model), _all_experts)
        try:
            with _single_process_is_fine():
                dcp.save(state, checkpoint_id=staging)
        except CheckpointException as exc:
            raise CheckpointError(f"saving checkpoint {target} failed {_failed_ranks(exc)}; the previous "
                                  f"checkpoint at {target}, if any, is intact") from exc
        finally:  # the optimizer's state dict shares its per-parameter dicts with the optimizer: put them back
            for container, key, original in swapped:
                container[key] = original
        if rank == 0:
            _write_metadata(staging, model, optimizer)
        _barrier()  # every rank's shards and the metadata are on disk
        if rank == 0:
            _publish(target, save_id)
            log.info("saved checkpoint %s (%s)", target, _origin(_read_metadata(target, target)))
        _barrier()


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> None:
    """Load the checkpoint `path` into `model` and `optimizer` (None: model state only), resharding it for
    this plan and world size; call on every rank. Raises `CheckpointError` for a missing or corrupt
    checkpoint, or one of another model."""
    with distributed_phase("load_checkpoint"):
        target = _target(path)
        source = _resolve(target)
        metadata = _read_metadata(source, target)
        if optimizer is not None and metadata.get("optimizer") is None:
            raise CheckpointError(f"checkpoint {target} holds no optimizer state (it was saved with "
                                  "optimizer=None); load it with optimizer=None")
        if _rank() == 0:
            log.info("loading checkpoint %s, %s", target, _origin(metadata))
        state = _state_of(model, optimizer)
        swapped = _swap_strided(state, _empty_plain_shards)  # DCP reads plain shards; redistributed below
        experts = _swap_experts(state, _expert_meshes(model), _empty_all_experts)
        try:
            with _single_process_is_fine():
                dcp.load(state, checkpoint_id=source)
        except CheckpointException as exc:
            raise CheckpointError(f"checkpoint {target} could not be loaded: it failed {_failed_ranks(exc)}; "
                                  "it is corrupt or of another model (parameter names and shapes must match): "
                                  "load a checkpoint saved from this model") from exc
        for container, key, original in swapped:
            container[key] = container[key].redistribute(original.device_mesh, original.placements)
        for container, key, original in experts:
            container[key] = _rank_experts(container[key], original)
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def export_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model's full state dict from the checkpoint `path`, as `model.state_dict()` of the unparallelized
    model gives it (load it with `model.load_state_dict`). Runs in this process alone: no process group."""
    target = _target(path)
    source = _resolve(target)
    _read_metadata(source, target)
    state: dict = {}
    try:
        # what format_utils.dcp_to_torch_save does, for the model's keys only (dcp.load fills given keys only)
        _load_state_dict(state, storage_reader=FileSystemReader(source),
                         planner=_EmptyStateDictLoadPlanner(keys={"model"}), no_dist=True)
    except CheckpointException as exc:
        raise CheckpointError(f"checkpoint {target} could not be read ({_failed_ranks(exc)}); it is corrupt: "
                              "export an intact checkpoint") from exc
    return state["model"]


def _state_of(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """{"model": ..., "optim": ...}: model and optimizer state keyed by parameter name, as DTensor shards.
    An optimizer that has not stepped yet gets its state created (a step with zero gradients and lr 0)."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _is_strided(t: DTensor) -> bool:
    return any(isinstance(p, _StridedShard) for p in t.placements)


def _plain_placements(t: DTensor) -> tuple[Placement, ...]:
    return tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in t.placements)


def _to_plain_shards(t: DTensor) -> DTensor:
    return t.redistribute(t.device_mesh, _plain_placements(t))


def _empty_plain_shards(t: DTensor) -> DTensor:
    return dtensor_empty(*t.shape, dtype=t.dtype, device_mesh=t.device_mesh, placements=_plain_placements(t))


def _swap_strided(state, swap: Callable[[DTensor], DTensor]) -> list[tuple[dict | list, object, DTensor]]:
    """Replace, in place, every DTensor of `state` stored part by part (`_StridedShard`: a fused projection's
    weight holds q_r, k_r, v_r, or FSDP2 over tensor parallelism on one dim) by `swap(it)`; returns
    (container, key, original) of each. DCP describes a rank's shard as one block at one offset, which a
    strided shard is not (its save fails with "overlapping chunks", its load would read the wrong rows), so
    checkpoints hold such tensors as plain `Shard`s of the same dims (one redistribution each way)."""
    swapped = []
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    for key, value in list(items):
        if isinstance(value, DTensor) and _is_strided(value):
            state[key] = swap(value)
            swapped.append((state, key, value))
        else:
            swapped += _swap_strided(value, swap)
    return swapped


def _expert_meshes(model: nn.Module) -> dict[str, object]:
    """Name of every parameter an expert-parallel experts module holds for its ep rank -> the (edp, ep) mesh
    (runtime/expert_parallel.py)."""
    out = {}
    for path, module in model.named_modules():
        mesh = getattr(module, "_autoshard_ep_mesh", None)
        if mesh is not None:
            out.update({f"{path}.{name}": mesh for name, _ in module.named_parameters(recurse=False)})
    return out


def _all_experts(t: torch.Tensor, mesh) -> DTensor:
    """This ep rank's experts (all of them across its data-parallel shards) as its block of every rank's, on the
    (edp, ep) mesh: what DCP saves, each expert once, at its global offset."""
    block = t.full_tensor() if isinstance(t, DTensor) else t
    block = block.contiguous()
    shape = torch.Size((block.shape[0] * mesh.size(1), *block.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(block, mesh, (Replicate(), Shard(0)), run_check=False, shape=shape, stride=stride)


def _empty_all_experts(t: torch.Tensor, mesh) -> DTensor:
    like = _all_experts(t, mesh)
    return dtensor_empty(*like.shape, dtype=like.dtype, device_mesh=mesh, placements=like.placements)


def _rank_experts(loaded: DTensor, original: torch.Tensor) -> torch.Tensor:
    """Back from `_all_experts`: this ep rank's block, laid out as the parameter (or its state) was."""
    block = loaded.to_local()
    if isinstance(original, DTensor):
        return distribute_tensor(block, original.device_mesh, original.placements, src_data_rank=None)
    return block


def _swap_experts(state: dict, meshes: dict[str, object], swap) -> list[tuple[dict, str, torch.Tensor]]:
    """Replace, in place, each expert-parallel parameter in `state` (by name) and its optimizer state (exp_avg,
    ...; not the 0-d step) by `swap(tensor, mesh)`; returns (container, key, original) of each. As they stand, a
    rank's experts are its ep block of every expert: every ep rank would write another tensor under one name at
    the same offsets."""
    if not meshes:
        return []
    model = state["model"]
    tables = [(model, {k: meshes[k] for k in model if k in meshes})]
    for name, per_param in state.get("optim", {}).get("state", {}).items():
        if name in meshes:
            tables.append((per_param, dict.fromkeys(per_param, meshes[name])))
    swapped = []
    for container, mesh_of in tables:
        for key, mesh in mesh_of.items():
            value = container[key]
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                container[key] = swap(value, mesh)
                swapped.append((container, key, value))
    return swapped


@contextlib.contextmanager
def _single_process_is_fine() -> Iterator[None]:
    """No warning that DCP works in this process alone without a process group: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _shared_id() -> str:
    """A fresh id, the same on every rank (rank 0's)."""
    box = [uuid.uuid4().hex[:12]]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _target(path: str | os.PathLike) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise CheckpointError(f"a checkpoint path must be a non-empty str or os.PathLike, got {path!r}")
    return Path(os.path.abspath(os.fspath(path)))


def _check_replaceable(target: Path) -> None:
    """`target` is free, or a link save_checkpoint made; its directory exists."""
    if not target.parent.is_dir():
        raise CheckpointError(f"cannot save checkpoint {target}: directory {target.parent} does not exist; "
                              "create it first")
    if target.exists() and not target.is_symlink():
        raise CheckpointError(f"cannot save checkpoint {target}: it exists and is not a checkpoint link made by "
                              "save_checkpoint; save to another path or move it away")


def _resolve(target: Path) -> Path:
    """The directory holding the checkpoint `target` (the link's target, resolved once)."""
    if not target.exists():
        parent_ok = target.parent.is_dir()
        leftovers = sorted(p.name for p in target.parent.glob(f"{glob.escape(target.name)}.tmp-*")) if parent_ok else []
        hint = f" ({', '.join(leftovers)} are incomplete saves, not checkpoints)" if leftovers else ""
        raise CheckpointError(f"checkpoint {target} does not exist{hint}; pass the path given to save_checkpoint")
    return target.resolve()


def _write_metadata(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    plan = getattr(model, "plan", None)
    world = dist.get_world_size() if dist.is_initialized() else 1
    data = {"format": _FORMAT, "version": _FORMAT_VERSION, "world_size": world,
            "model_class": type(model).__name__.removeprefix("AutoShard"),
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "plan": plan.to_json() if plan is not None else None, "torch": torch.__version__}
    with open(directory / METADATA_FILE, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _read_metadata(directory: Path, shown: Path) -> dict:
    """autoshard.json of the complete checkpoint in `directory` (`shown` in messages, the path the user gave);
    `CheckpointError` when it or DCP's .metadata is missing or unreadable."""
    meta_path = directory / METADATA_FILE
    if not (directory / ".metadata").is_file() or not meta_path.is_file():
        raise CheckpointError(f"{shown} is not a complete autoshard checkpoint (no .metadata or "
                              f"{METADATA_FILE}); pass a path given to save_checkpoint")
    try:
        data = json.loads(meta_path.read_text())
        if data.get("format") != _FORMAT:
            raise ValueError(f"format {data.get('format')!r}")
    except (ValueError, UnicodeDecodeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {shown} is corrupt ({meta_path.name}: {exc}); save it "
                              "again or use another checkpoint") from exc
    if data.get("version") != _FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {shown} has format version {data.get('version')}, this autoshard "
                              f"reads version {_FORMAT_VERSION}; load it with the autoshard that saved it")
    return data


def _origin(metadata: dict) -> str:
    """'saved under the plan for GPT2LMHeadModel on mesh tp=4 on 4 ranks' (for the log)."""
    plan = metadata.get("plan") or {}
    mesh = " x ".join(f"{axis}={degree}" for axis, degree in plan.get("mesh") or ()) or "?"
    where = f"the plan for {plan.get('model', '?')} on mesh {mesh}" if plan else "no plan"
    return f"saved under {where} on {metadata.get('world_size', '?')} ranks"


def _sibling(target: Path, kind: str, save_id: str) -> Path:
    """`path.tmp-<id>` (a save in progress), `path.ckpt-<id>` (a complete checkpoint), `path.link-<id>`."""
    return target.with_name(f"{target.name}.{kind}-{save_id}")


def _publish(target: Path, save_id: str) -> None:
    """Rank 0: make the complete checkpoint of save `save_id` the one at `target` (module docstring), then
    remove the checkpoint it replaces and what crashed saves left behind."""
    complete, link = _sibling(target, "ckpt", save_id), _sibling(target, "link", save_id)
    os.replace(_sibling(target, "tmp", save_id), complete)
    os.symlink(complete.name, link)
    os.replace(link, target)  # the atomic step: `target` names the old checkpoint, then the new one
    _fsync_dir(target.parent)
    ours = re.compile(re.escape(target.name) + r"\.(ckpt|tmp|link)-[0-9a-f]{12}")
    for stale in target.parent.iterdir():
        if stale != complete and ours.fullmatch(stale.name):
            if stale.is_symlink() or stale.is_file():
                stale.unlink(missing_ok=True)
            else:
                shutil.rmtree(stale, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _failed_ranks(exc: CheckpointException) -> str:
    """'on rank 1 (ValueError: ...)' from DCP's per-rank failures."""
    parts = []
    for rank, failure in sorted(exc.failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure
        text = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        parts.append(f"rank {rank} ({type(error).__name__}: {text})")
    return "on " + ", ".join(parts) if parts else "(no rank reported why)"
