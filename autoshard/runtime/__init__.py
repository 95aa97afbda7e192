"""The runtime: apply a plan with torch.distributed (DeviceMesh, DTensor, FSDP2) and check what it issues."""

from autoshard.runtime.apply import apply_plan
from autoshard.runtime.memory import local_param_bytes
from autoshard.runtime.mesh import build_device_mesh, init_distributed

__all__ = ["apply_plan", "build_device_mesh", "init_distributed", "local_param_bytes"]
