"""autoshard: pick and apply a parallel training plan for a PyTorch model on a GPU cluster."""

from autoshard.api import plan
from autoshard.hardware_profiles import ClusterSpec
from autoshard.planner.plan import Plan

__all__ = ["plan", "ClusterSpec", "Plan", "autoparallel", "save_checkpoint", "load_checkpoint", "__version__"]
__version__ = "0.1.0"


_RUNTIME_NAMES = ("autoparallel", "save_checkpoint", "load_checkpoint")


def __getattr__(name: str):
    if name in _RUNTIME_NAMES:  # import torch.distributed: only when asked for
        from autoshard import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'autoshard' has no attribute {name!r}")
