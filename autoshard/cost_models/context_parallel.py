"""Context parallelism (CP): the tokens of every sequence cut over the ranks of a cp group.

Layout. A rank holds two of the 2·cp equal chunks of each sequence, chunk r and chunk 2·cp − 1 − r (head-tail
load balancing: torch's `context_parallel` `_HeadTailLoadBalancer`, Megatron-Core's CP, Llama 3's CP), so that
under a causal mask every rank attends over the same number of (query, key) pairs:
chunk r sees (r + 1)·c keys and chunk 2·cp − 1 − r sees (2·cp − r)·c, (2·cp + 1)·c in all on every rank.

Outside attention a cp rank is a data-parallel rank over its tokens: same parameters, gradients summed over
dp x cp (torchtitan shards FSDP over dp x cp). Attention needs the keys and values of every earlier token,
and two ways of getting them are priced:

- `allgather` (Llama 3, Dubey et al. 2024 §3.3.2, and torch's CP for flex attention, `flex_cp_allgather`):
  all-gather K and V over the cp group before attention, reduce-scatter their gradients after its backward.
  Nothing overlaps it; this is what autoshard's runtime runs (runtime/context_parallel.py). With grouped-query
  attention K and V are small beside Q, which is why Llama 3 chose it.
- `ring` (Liu et al. 2023, Ring Attention; torch's `context_parallel` for SDPA; Megatron-Core's CP): cp − 1
  steps, each passing one rank's K/V chunk to the next rank while the attention block of the chunk in hand
  computes; the backward passes K/V and the accumulated dK/dV, twice the bytes, beside the backward blocks.
  `estimate` prices it for other engines; the runtime does not run it, so plans never choose it.

Per attention layer and micro-batch, with kv = the bytes of one rank's K and V (its tokens, its heads):
    allgather:  forward all-gather of cp·kv, backward reduce-scatter of cp·kv, both waited for
    ring:       forward (cp − 1) x max(0, p2p(kv) − block_fwd), backward (cp − 1) x max(0, p2p(2·kv) − block_bwd),
                block = the attention kernel's time / cp, overlapped with the GPU's `overlap_slowdown`
Attention's kernel works on the rank's queries against every key: cp times the work of the rank-local graph
(captured at seq / cp tokens), and it keeps the gathered K and V for backward (cp·kv, not kv).
"""

from __future__ import annotations

from autoshard.cost_models.overlap import exposed_beside_s

__all__ = ["CP_ATTENTION", "head_tail_chunks", "gathered_kv_bytes", "ring_exposed_s"]

CP_ATTENTION = ("allgather", "ring")


def head_tail_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2·cp per sequence) that cp rank `rank` holds."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} outside 0..{cp - 1}")
    return rank, 2 * cp - 1 - rank


def gathered_kv_bytes(local_kv_bytes: float, cp: int) -> float:
    """Bytes of K and V over the whole sequence, from one rank's `local_kv_bytes`: what the all-gather
    produces (the nccl-tests size of the collective) and what attention keeps for its backward."""
    return local_kv_bytes * cp


def ring_exposed_s(step_comm_s: float, block_compute_s: float, cp: int, *, slowdown: float) -> float:
    """Seconds a ring pass adds to attention: cp − 1 transfers, each beside one block's compute."""
    if cp <= 1:
        return 0.0
    return (cp - 1) * exposed_beside_s(block_compute_s, step_comm_s, slowdown=slowdown)
