"""Partition repeated blocks into pipeline chunks balanced by cost, embeddings and head included.

Chunk j (of p·v) runs on stage j mod p. Stage 0 also runs what precedes the blocks (embeddings), the stage of
the last chunk what follows them (final norm, LM head: for GPT-3 the head alone costs about a third of a
layer). Starting from an even split, layers move one at a time off the most loaded stage while that lowers
the maximum stage cost.
"""

from __future__ import annotations

import functools

__all__ = ["balanced_stage_layers", "stage_loads"]


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
    while True:
        loads = stage_loads(counts, p, pre, block, post)
        worst = max(range(p), key=loads.__getitem__)
        best_move, best_max = None, max(loads)
        for src in (j for j in range(chunks) if j % p == worst and counts[j] > 1):
            for dst in range(chunks):
                if dst % p == worst:
                    continue
                trial = list(counts)
                trial[src] -= 1
                trial[dst] += 1
                peak = max(stage_loads(trial, p, pre, block, post))
                if peak < best_max - 1e-9:
                    best_move, best_max = trial, peak
        if best_move is None:
            break
        counts = best_move
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return tuple(bounds)
