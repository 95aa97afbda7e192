"""The model zoo: named configurations and spec strings, built on the meta device."""

from autoshard.models.build import LoadedModel, build_module, load_model, resolve_spec
from autoshard.models.spec import ModelSpec, parse_spec
from autoshard.models.zoo import SOURCES, ZOO

__all__ = ["ZOO", "SOURCES", "ModelSpec", "LoadedModel", "load_model", "build_module", "resolve_spec", "parse_spec"]
