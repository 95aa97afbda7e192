"""Typed errors for user mistakes.

Every error a user can cause derives from `AutoshardError`, which is a `ValueError`, so plain
`except ValueError` keeps working. Messages say what was given, what is allowed, and how to fix it;
the CLI prints them as one line on stderr and exits with code 2.

Messages name Python parameters (`global_batch must be ...`); `params` lists the ones a message names, and the
CLI rewrites those to its flags (`--global-batch must be ...`) in one place, `cli._cli_message`. The checks
shared by the Python API and the CLI's up-front validation are here too, so each message is written once.
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
    "require_positive",
]


class AutoshardError(ValueError):
    """Base class of every error caused by user input; `params`: the Python parameter names the message names."""

    def __init__(self, message: str, *, params: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.params = tuple(params)


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

    def __init__(self, message: str, *, min_memory_gib: float | None = None, params: tuple[str, ...] = ()) -> None:
        super().__init__(message, params=params)
        self.min_memory_gib = min_memory_gib


class PlanFileError(AutoshardError):
    """A plan file that is missing, corrupt, of another version or made for another model."""


class RuntimeSetupError(AutoshardError):
    """The distributed environment does not match the plan (world size, backend, devices)."""


class CheckpointError(AutoshardError):
    """A checkpoint path that is missing, corrupt, of another model, or cannot be written."""


def require_positive(param: str, value, *, integer: bool = True, unit: str = "", error=ConfigurationError) -> None:
    """Raise `error` naming `param` unless `value` is a positive integer (or, with integer=False, number)."""
    import numbers

    kind = "integer" if integer else "number"
    ok = isinstance(value, numbers.Integral if integer else numbers.Real) and not isinstance(value, bool)
    if not ok or value <= 0:
        raise error(f"{param} must be a positive {kind}{unit}, got {value!r}", params=(param,))
