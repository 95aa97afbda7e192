"""The model zoo: named configurations and spec strings, built on the meta device.

Specs, the zoo and name resolution import without torch; `load_model`, `build_module` and `LoadedModel`
(`build`) load it on first use.
"""

from __future__ import annotations

from autoshard.models.names import resolve_spec
from autoshard.models.spec import ModelSpec, parse_spec
from autoshard.models.zoo import SOURCES, ZOO

__all__ = ["ZOO", "SOURCES", "ModelSpec", "LoadedModel", "load_model", "build_module", "resolve_spec", "parse_spec"]

_BUILD = ("LoadedModel", "load_model", "build_module")


def __getattr__(name: str):
    if name in _BUILD:
        from autoshard.models import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
