"""The runtime: apply a plan with torch.distributed (DeviceMesh, DTensor, FSDP2) and check what it issues.

Module layout (each file says more):

    entry.py            autoparallel(): cluster + plan + process group -> parallel module
    apply.py            apply_plan(): the fixed order of parallelisms
    mesh.py             process-group init (torchrun, timeout), MeshSpec -> DeviceMesh
    placements.py       semantic layouts on named axes -> DTensor placements (the only place)
    specs.py            plan + graph -> what to do around each leaf-module call
    tensor_parallel.py  DTensor parameters and the per-module redistribution wrapper
    local_shards.py     whether the model's own code may run on local shards instead of DTensors
    norms.py            statistics-parallel LayerNorm / RMSNorm
    split.py            OSDP operator splitting
    data_parallel.py    FSDP2 per op (ZeRO 0 / 2 / 3) in SPMD mode
    dtensor_ext.py      DTensor additions: CPU attention rules, function-level implicit replication,
                        redistribution with planned gradient placements
    parallel_module.py  the returned module: local tensors in and out, shard_inputs
    checkpoint.py       save / load / export checkpoints with torch.distributed.checkpoint, across plans
    failure.py          distributed phases: a failure on one rank names that rank on every rank
"""

from autoshard.runtime.apply import apply_plan
from autoshard.runtime.checkpoint import export_state_dict, load_checkpoint, save_checkpoint
from autoshard.runtime.entry import autoparallel
from autoshard.runtime.failure import RankFailedError, distributed_phase
from autoshard.runtime.mesh import build_device_mesh, init_distributed
from autoshard.runtime.parallel_module import ParallelModule

__all__ = ["autoparallel", "apply_plan", "build_device_mesh", "init_distributed", "ParallelModule",
           "save_checkpoint", "load_checkpoint", "export_state_dict", "distributed_phase", "RankFailedError"]
