"""What a parallelized module remembers about its plan: the plan, the mesh and how its forward runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from autoshard.plans.plan import Plan

__all__ = ["RuntimeState"]


@dataclass
class RuntimeState:
    plan: Plan
    mesh: DeviceMesh
    spmd: bool = True  # False: a plan without tensor-parallel axes runs on plain tensors (apply.py)
    local: bool = False  # True: the model's own code runs on local shards, DTensors only in planned modules
    local_batch: int | None = None  # this rank's batch size in the current forward (local mode)
    why_not_local: str = "no example inputs to check it on"  # when not `local` (local_shards.py)
    cp: int = 1  # context parallel degree: the mesh's dp dim is dp x cp (runtime/context_parallel.py)
    cp_rank: int = 0

    @property
    def dp_degree(self) -> int:
        names = self.mesh.mesh_dim_names or ()
        return self.mesh.size(names.index("dp")) if "dp" in names else 1

    def input_placements(self, x: torch.Tensor) -> list[Placement]:
        """A local input slice: sharded on dp along its batch dim 0, replicated elsewhere."""
        return [Shard(0) if name == "dp" and x.dim() > 0 else Replicate() for name in self.mesh.mesh_dim_names]

    def output_placements(self, y: DTensor) -> list[Placement]:
        """Keep the dp batch shard (this rank's slice), gather or reduce everything else."""
        return [p if name == "dp" and p == Shard(0) else Replicate()
                for name, p in zip(self.mesh.mesh_dim_names, y.placements, strict=True)]
