"""autoshard: pick and apply a parallel training plan for a PyTorch model on a GPU cluster."""

from autoshard.api import plan
from autoshard.hardware_profiles import ClusterSpec
from autoshard.planner.plan import Plan

__all__ = ["plan", "ClusterSpec", "Plan", "autoparallel", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "autoparallel":  # imports torch.distributed: only when asked for
        from autoshard.runtime import autoparallel

        return autoparallel
    raise AttributeError(f"module 'autoshard' has no attribute {name!r}")
