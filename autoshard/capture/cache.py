"""Per-graph memo tables: a graph is captured once and priced thousands of times by the search."""

from __future__ import annotations

import weakref

__all__ = ["graph_cache"]

_CACHES: dict[int, tuple[weakref.ref, dict]] = {}


def graph_cache(graph) -> dict:
    """A dict that lives as long as `graph` does (keyed by identity: hashing a graph walks every op)."""
    key = id(graph)
    hit = _CACHES.get(key)
    if hit is not None and hit[0]() is graph:
        return hit[1]
    table: dict = {}
    _CACHES[key] = (weakref.ref(graph, lambda _ref, k=key: _CACHES.pop(k, None)), table)
    return table
