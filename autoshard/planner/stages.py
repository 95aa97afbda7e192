"""Partition repeated blocks into pipeline chunks balanced by cost, embeddings and head included.

Chunk j (of p·v) runs on stage j mod p. Stage 0 also runs what precedes the blocks (embeddings), the stage of
the last chunk what follows them (final norm, LM head: for GPT-3 the head alone costs about a third of a
layer). Starting from an even split, layers move one at a time between stages while that lowers the maximum
stage cost, or keeps it and lowers the sum of squared stage costs (the other stages' idle time).
"""

from __future__ import annotations

import functools

__all__ = ["balanced_stage_layers", "stage_loads"]


def _balance_key(loads: list[float]) -> tuple[float, float]:
    return (round(max(loads), 6), round(sum(x * x for x in loads), 6))


def stage_loads(counts: list[int], p: int, pre: float, block: float, post: float) -> list[float]:
    loads = [0.0] * p
    for j, c in enumerate(counts):
        loads[j % p] += c * block
    loads[0] += pre
    loads[(len(counts) - 1) % p] += post
    return loads


@functools.lru_cache(maxsize=1024)
def balanced_stage_layers(layers: int, p: int, v: int, pre: float, block: float,
                          post: float) -> tuple[tuple[int, int], ...]:
    chunks = p * v
    if layers < chunks:
        raise ValueError(f"{layers} layers cannot fill {chunks} pipeline chunks")
    counts = [layers // chunks] * chunks
    for j in range(layers % chunks):  # remainder to the middle chunks, away from embeddings and head
        counts[(chunks // 2 + j) % chunks] += 1
    while True:  # move one layer between stages while that lowers (max load, sum of squared loads)
        loads = stage_loads(counts, p, pre, block, post)
        best, best_key = None, _balance_key(loads)
        for a in range(p):
            sources = [j for j in range(a, chunks, p) if counts[j] > 1]
            if not sources:
                continue
            for b in range(p):
                if b == a:
                    continue
                trial = list(loads)
                trial[a] -= block
                trial[b] += block
                key = _balance_key(trial)
                if key < best_key:
                    src = max(sources, key=counts.__getitem__)  # keep chunks of one stage even
                    dst = min(range(b, chunks, p), key=counts.__getitem__)
                    best, best_key = (src, dst), key
        if best is None:
            break
        counts[best[0]] -= 1
        counts[best[1]] += 1
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return tuple(bounds)
