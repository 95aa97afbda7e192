"""Model references that need no torch: a zoo name or spec string -> its ModelSpec and the name its graph and
plans carry (enough to find a cached graph without building the module)."""

from __future__ import annotations

import difflib
from dataclasses import replace

from autoshard.errors import ModelSpecError
from autoshard.models.spec import FAMILIES, ModelSpec, parse_spec, spec_string
from autoshard.models.zoo import ZOO

__all__ = ["is_zoo_or_spec", "resolve_spec", "spec_and_name"]


def is_zoo_or_spec(ref) -> bool:
    """A zoo name or a spec string (`family:key=value,...`), as opposed to a `module:factory` or a module."""
    if not isinstance(ref, str):
        return False
    return ":" not in ref or ref.split(":", 1)[0].strip().lower() in FAMILIES


def resolve_spec(ref: str) -> ModelSpec:
    """Zoo name or spec string -> ModelSpec."""
    key = ref.strip()
    if key.lower() in ZOO:
        return ZOO[key.lower()]
    if ":" in key and key.split(":", 1)[0].strip().lower() in FAMILIES:
        return parse_spec(key)
    close = difflib.get_close_matches(key.lower(), list(ZOO), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ModelSpecError(f"unknown model {ref!r}: {hint}run `autoshard models` for the zoo, or give a spec such as "
                         "gpt:layers=24,hidden=2048,heads=16,seq=2048 or package.module:factory")


def spec_and_name(ref: str, *, seq: int | None = None, attn: str | None = None) -> tuple[ModelSpec, str]:
    """The ModelSpec of a zoo name or spec string with `seq` and `attn` applied, and the name its graph and
    plans carry; no module is built."""
    spec = resolve_spec(ref)
    if seq is not None:
        if seq <= 0:
            raise ModelSpecError(f"seq must be a positive integer, got {seq}", params=("seq",))
        if spec.family in ("vit", "mlp"):
            raise ModelSpecError(f"{spec.name} has no sequence length; drop seq", params=("seq",))
        spec = replace(spec, seq=seq)
    name = spec.name if seq is None else f"{spec.name}@seq{seq}"
    if attn is not None and attn != spec.attn:
        spec = replace(spec, attn=attn)  # validated by ModelSpec
        name = spec_string(spec)  # a name that rebuilds this model (measure rebuilds a plan's model by name)
    return spec, name
