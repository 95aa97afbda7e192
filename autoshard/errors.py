"""Typed errors for user mistakes.

Every error a user can cause derives from `AutoshardError`, which is a `ValueError`, so plain
`except ValueError` keeps working. Messages say what was given, what is allowed, and how to fix it;
the CLI prints them as one line on stderr and exits with code 2.
"""

from __future__ import annotations

__all__ = [
    "AutoshardError",
    "ModelSpecError",
    "ClusterSpecError",
    "CaptureError",
    "ConfigurationError",
    "InfeasiblePlanError",
    "PlanFileError",
    "RuntimeSetupError",
    "CheckpointError",
]


class AutoshardError(ValueError):
    """Base class of every error caused by user input."""


class ModelSpecError(AutoshardError):
    """An unknown zoo name, a malformed model spec string or a broken `module:factory`."""


class ClusterSpecError(AutoshardError):
    """A malformed or impossible cluster description."""


class CaptureError(AutoshardError):
    """The model could not be traced into an operator graph."""


class ConfigurationError(AutoshardError):
    """A hand-given parallel configuration that cannot run (degrees, batch sizes, divisibility)."""


class InfeasiblePlanError(AutoshardError):
    """No plan fits the memory budget; `min_memory_gib` is the smallest any plan in the space needs."""

    def __init__(self, message: str, *, min_memory_gib: float | None = None) -> None:
        super().__init__(message)
        self.min_memory_gib = min_memory_gib


class PlanFileError(AutoshardError):
    """A plan file that is missing, corrupt, of another version or made for another model."""


class RuntimeSetupError(AutoshardError):
    """The distributed environment does not match the plan (world size, backend, devices)."""


class CheckpointError(AutoshardError):
    """A checkpoint path that is missing, corrupt, of another model, or cannot be written."""
