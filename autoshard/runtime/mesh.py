"""Process groups and device meshes: a plan's `MeshSpec` -> a `DeviceMesh` with the same named dims.

The mesh is built with `init_device_mesh` over the axes inside one pipeline stage (`dp`, `tp` / `tp_r, tp_c` /
`tp_x, tp_y, tp_z`), outermost first, so ranks are laid out row-major exactly as `MeshSpec.stride` says and
the tensor-parallel groups are the contiguous ones (inside a node, as in Megatron-LM). Sub-meshes come from
indexing by name: `mesh["tp"]`, `mesh["dp"]`, `mesh[("tp_r", "tp_c")]`.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoshard.errors import RuntimeSetupError
from autoshard.plans.layouts import MeshSpec

__all__ = ["init_distributed", "build_device_mesh", "backend_for", "DEFAULT_TIMEOUT_S", "tp_mesh_names",
           "tensor_parallel_mesh", "replicate_mesh", "expert_parallel_meshes"]

log = logging.getLogger(__name__)

# Long enough for a first NCCL communicator on a large job, short enough that a dead rank ends the job
# instead of hanging it (issue 7). Tests pass their own, much shorter, timeout.
DEFAULT_TIMEOUT_S = 600.0
_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
# One DeviceMesh per (device type, axes, degrees) and process group: DTensor's sharding-propagation cache
# hands out specs holding the first mesh object of an equal value, and FSDP2's SPMD mode insists that the
# parameters' mesh *is* the mesh it is given, so a second, equal mesh in the same process would be rejected.
_MESHES: dict[tuple, tuple[DeviceMesh, object]] = {}


def backend_for(device_type: str) -> str:
    if device_type not in _BACKENDS:
        raise RuntimeSetupError(f"unsupported device type {device_type!r}; autoshard runs on "
                                f"{', '.join(_BACKENDS)} (gloo on CPU, NCCL on CUDA)")
    return _BACKENDS[device_type]


def init_distributed(*, device_type: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the default process group, initializing it from the torchrun environment if needed.

    An existing group is kept, but its backend must suit `device_type` (gloo for CPU ranks, NCCL for GPUs).
    """
    backend = backend_for(device_type)
    if dist.is_initialized():
        have = dist.get_backend()
        if backend not in str(have):
            raise RuntimeSetupError(f"the process group uses backend {have!r} but the cluster's devices are "
                                    f"{device_type}; initialize it with {backend!r} or use a matching cluster")
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeSetupError(f"no process group and no torchrun environment ({', '.join(missing)} unset); "
                                "launch with `torchrun --nproc-per-node N script.py` or call "
                                "torch.distributed.init_process_group first")
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeSetupError("the cluster has GPUs but CUDA is not available on this machine; use a "
                                    "`1xNxcpu` cluster to run on CPU ranks")
        if not any(os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
            # what the planner's memory model assumes (cost_models/memory.py ALLOCATOR_FRAGMENTATION)
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    log.info("rank %d/%d joined the %s process group", dist.get_rank(), dist.get_world_size(), backend)


def global_rank() -> int:
    """This process's rank in the default process group."""
    return dist.get_rank()


def shutdown_distributed() -> None:
    """Destroy the default process group (end of a CLI command run under torchrun)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def build_device_mesh(spec: MeshSpec, *, device_type: str = "cpu", unit_dp: bool = False) -> DeviceMesh:
    """The `DeviceMesh` of `spec` over every rank of the default process group. `unit_dp`: with a data-parallel
    dim of one rank in front when `spec` has none, so that FSDP2 can wrap the modules to cast their parameters
    (mixed precision, runtime/precision.py); it issues no collective on a one-rank group."""
    if spec.degree("pp") > 1:
        raise RuntimeSetupError(f"mesh {spec} has pipeline degree {spec.degree('pp')}; the runtime applies "
                                "plans without pipeline parallelism only (pp=1) for now")
    if spec.degree("cp") > 1:  # the data-parallel wrappers run on dp x cp (runtime/context_parallel.py)
        check_context_parallel_mesh(spec)
        spec = spec.folded_cp()
    names = spec.spmd_axes
    shape = tuple(spec.degree(a) for a in names)
    size = spec.size
    world = dist.get_world_size() if dist.is_initialized() else 1
    if size != world:
        factors = " x ".join(f"{a}={spec.degree(a)}" for a in names)
        raise RuntimeSetupError(f"the plan's mesh {factors} needs {size} ranks but this job has {world}; "
                                f"launch {size} ranks (torchrun --nproc-per-node {size}) or re-plan for {world}")
    if not names:  # a one-rank plan with no axes at all
        names, shape = ("dp",), (1,)
    elif unit_dp and "dp" not in names:
        names, shape = ("dp", *names), (1, *shape)
    key = (device_type, names, shape)
    cached = _MESHES.get(key)
    if cached is not None and cached[1] is dist.group.WORLD:
        return cached[0]
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    _MESHES[key] = (mesh, dist.group.WORLD)
    return mesh


def check_context_parallel_mesh(spec: MeshSpec) -> None:
    if spec.degree("pp") > 1:
        raise RuntimeSetupError(f"mesh {spec}: the runtime runs context parallelism without pipeline stages; "
                                "re-plan without cp or without pp")


def context_parallel_group(spec: MeshSpec, *, device_type: str = "cpu"):
    """(process group, this rank's index in it) of this rank's cp group on a mesh with a cp axis: the ranks
    at its tensor-parallel position in one dp replica, cp just inside dp and outside the tensor-parallel
    axes (plans/layouts.py). Call on every rank."""
    check_context_parallel_mesh(spec)
    shape = (spec.degree("dp"), spec.degree("cp"), spec.tp_degree)
    names = ("dp", "cp", "cp_tp")
    key = (device_type, names, shape)
    cached = _MESHES.get(key)
    if cached is None or cached[1] is not dist.group.WORLD:
        cached = _MESHES[key] = (init_device_mesh(device_type, shape, mesh_dim_names=names), dist.group.WORLD)
    mesh = cached[0]
    return mesh.get_group("cp"), mesh.get_local_rank("cp")


def expert_parallel_meshes(spec: MeshSpec, ep: int, *, device_type: str = "cpu"):
    """(ep process group, this rank's index in it, (shard mesh, replicate mesh) of the ranks holding the same
    experts, the (edp, ep) mesh) for expert parallelism over ep consecutive dp ranks
    (cost_models/expert_parallel.py): the dp ranks as an (edp, ep, edp_shard) mesh, edp = dp / ep, and with
    tensor-parallel axes one such mesh per tensor-parallel position (the experts run replicated on those axes:
    the ep group of a rank is the ranks at its tensor-parallel position in ep consecutive dp replicas). The
    expert weights' FSDP2 runs on `mesh["edp"]` (ZeRO 1-3) or on the HSDP mesh (edp replicated, a shard dim
    of one rank: ZeRO-0); checkpoints describe all experts on the (edp, ep) mesh. ep=1: the same meshes with
    an ep group of one rank. Call on every rank."""
    if spec.degree("pp") > 1 or spec.degree("cp") > 1:
        raise RuntimeSetupError(f"mesh {spec}: the runtime runs mixture-of-experts layers without pipeline and "
                                "context-parallel axes; re-plan without pp / cp")
    dp = spec.degree("dp")
    if ep < 1 or dp % ep:
        raise RuntimeSetupError(f"ep={ep} does not divide the plan's dp degree {dp}; re-plan")
    tp = spec.tp_degree
    shape = (dp // ep, ep, 1, tp)
    names = ("edp", "ep", "edp_shard", "ep_tp")
    key = (device_type, names, shape)
    cached = _MESHES.get(key)
    if cached is None or cached[1] is not dist.group.WORLD:
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        cached = _MESHES[key] = (mesh, dist.group.WORLD)
    mesh = cached[0]
    return (mesh.get_group("ep"), mesh.get_local_rank("ep"), (mesh["edp"], mesh[("edp", "edp_shard")]),
            mesh[("edp", "ep")])


def tp_mesh_names(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(n for n in (mesh.mesh_dim_names or ()) if n.startswith("tp"))


def tensor_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The tensor-parallel sub-mesh as one dim named "tp": `mesh["tp"]`, or the 2D / 3D axes flattened (the
    group a 1D operator spans on a 2D / 3D mesh). None without tensor-parallel axes."""
    names = tp_mesh_names(mesh)
    if not names:
        return None
    if names == ("tp",):
        return mesh["tp"]
    return mesh[names]._flatten("tp")


def replicate_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """`mesh`'s dp ranks as an HSDP mesh (dp replicated, a shard dim of one rank): what FSDP2 on plain tensors
    needs for parameters kept whole on every dp rank (ZeRO-0), with their gradients all-reduced."""
    if mesh.mesh_dim_names != ("dp",):
        raise ValueError(f"replicate_mesh takes a mesh with the single dim 'dp', got {mesh.mesh_dim_names}")
    key = (mesh.device_type, ("dp", "dp_shard"), (mesh.size(), 1))
    cached = _MESHES.get(key)
    if cached is not None and cached[1] is dist.group.WORLD:
        return cached[0]
    hsdp = init_device_mesh(mesh.device_type, (mesh.size(), 1), mesh_dim_names=("dp", "dp_shard"))
    _MESHES[key] = (hsdp, dist.group.WORLD)
    return hsdp
