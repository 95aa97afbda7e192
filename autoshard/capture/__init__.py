"""torch.export -> OpGraph: the planner's view of a model.

The graph types (`ir`) import without torch; `capture`, `capture_model` and `capture_ref` (`trace`) load torch
on first use, so that a command whose graph comes from the on-disk cache (`disk_cache`) never imports it.
"""

from __future__ import annotations

from autoshard.capture.ir import BlockGroup, Op, OpGraph, OpKind, ParamMeta, TensorMeta

__all__ = ["capture", "capture_model", "capture_ref", "OpGraph", "Op", "OpKind", "TensorMeta", "ParamMeta", "BlockGroup"]

_TRACE = ("capture", "capture_model", "capture_ref")


def __getattr__(name: str):
    if name in _TRACE:
        from autoshard.capture import trace

        return getattr(trace, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
