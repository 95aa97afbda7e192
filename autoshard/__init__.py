"""autoshard: pick and apply a parallel training plan for a PyTorch model on a GPU cluster."""

__all__ = ["__version__"]
__version__ = "0.1.0"
