"""autoshard: pick and apply a parallel training plan for a PyTorch model on a GPU cluster."""

__all__ = ["plan", "ClusterSpec", "Plan", "autoparallel", "save_checkpoint", "load_checkpoint", "__version__"]
from autoshard.version import __version__

_RUNTIME_NAMES = ("save_checkpoint", "load_checkpoint")
# imported on first use: `autoshard --help` and `import autoshard.cli` must not import torch (issue 17)
_LAZY_NAMES = {"plan": "autoshard.api", "autoparallel": "autoshard.api", "ClusterSpec": "autoshard.hardware_profiles",
               "Plan": "autoshard.plans.plan"}


def __getattr__(name: str):
    if name in _LAZY_NAMES:
        import importlib

        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    if name in _RUNTIME_NAMES:  # import torch.distributed: only when asked for
        from autoshard import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'autoshard' has no attribute {name!r}")
