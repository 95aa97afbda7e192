"""Expert parallelism (EP): the experts of every mixture-of-experts layer over the ranks of an ep group.

Layout (torchtitan's, and autoshard's runtime, runtime/expert_parallel.py). The ep group is ep consecutive
ranks of the data-parallel group (ep borrows from dp: no extra ranks). Rank r of it holds experts
[r·E/ep, (r+1)·E/ep) of each layer's E; outside the experts every rank is an ordinary data-parallel rank.
An expert's weights are replicated (or ZeRO-sharded) over the dp / ep ranks that hold the same experts, and
their gradients are reduced there only.

Per MoE layer and micro-batch a rank routes its T tokens to k experts each and moves the T·k (token, expert)
rows of the hidden size H:
    forward:   a tiny all-to-all of the rows per (rank, expert) (E integers), the dispatch all-to-all of
               T·k·H activations to the experts' ranks, the combine all-to-all of T·k·H back
    backward:  the combine's and the dispatch's gradients, one all-to-all of T·k·H each
all on the ep group, between the router and the experts' GEMMs: nothing to overlap them with (torchtitan and
Megatron-Core's default dispatchers wait for them; Megatron's `--moe-shared-expert-overlap` and DeepEP's
overlap are other engines). Sizes as nccl-tests count an all-to-all: what one rank sends in total.

Load imbalance. Routing is data-dependent: the rank holding the most-chosen experts receives more than T·k
rows, and every rank of the group waits for it in the combine. The experts' GEMMs, their pointwise ops, the
rows they keep for backward and the all-to-alls are priced at the busiest rank's load over the mean,
`ep_load_imbalance`: with each expert's load spread around the mean by a coefficient of variation cv, a rank
holding g = E/ep experts carries their sum (spread cv/sqrt(g), loads taken independent), and the busiest of the
ep ranks is the expected maximum of ep normal draws (Blom's approximation, z(n) = Phi^-1((n - 0.375)/(n + 0.25))):

    imbalance(ep, E) = 1 + cv / sqrt(E/ep) * z(ep)

cv is fixed by one published figure (`EXPERT_LOAD_CV`). Without EP (ep = 1) every rank runs its own T·k rows
through all its experts: no rank waits for another's routing, and no imbalance applies.

The experts' GEMM: `grouped_mm` runs one GEMM per local expert over its rows; with balanced routing, E/ep
GEMMs of T·k·ep/E rows each (capture records it as one GEMM of T·k rows).
"""

from __future__ import annotations

import math
from statistics import NormalDist

__all__ = ["EXPERT_LOAD_CV", "expected_max_normal", "ep_load_imbalance", "dispatch_bytes", "counts_bytes",
           "grouped_gemm_rows"]

# Coefficient of variation of one expert's load over the mean. ROUGH: set so that the busiest of 8 experts
# (Mixtral's count) carries 1.25x the mean, Switch Transformer's training capacity factor (Fedus et al. 2022,
# JMLR, sec. 2.2 and Table 1: expert capacity 1.0-1.25x the even share, 1.25 kept), the load a router trained
# with a load-balancing loss is held to by systems that drop the overflow; dropless engines (torchtitan,
# MegaBlocks, autoshard's runtime) run the overflow and wait for it. cv = 0.25 / z(8).
# Override per run with `estimate --ep-imbalance` (a measured max / mean of rows per rank).
EXPERT_LOAD_CV = 0.25 / NormalDist().inv_cdf((8 - 0.375) / (8 + 0.25))


def expected_max_normal(n: int) -> float:
    """Expected maximum of n standard normal draws, Blom's approximation (0 for n = 1)."""
    return 0.0 if n <= 1 else NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def ep_load_imbalance(ep: int, experts: int, cv: float = EXPERT_LOAD_CV) -> float:
    """The busiest of `ep` ranks' routed rows over the mean, each rank holding experts / ep of `experts`."""
    if ep <= 1 or experts <= 0:
        return 1.0
    return 1.0 + cv / math.sqrt(max(1, experts // ep)) * expected_max_normal(ep)


def dispatch_bytes(rows: float, hidden: int, bytes_per_elem: float) -> float:
    """Bytes one rank sends in one dispatch (or combine) all-to-all: its (token, expert) rows of `hidden`."""
    return rows * hidden * bytes_per_elem


def counts_bytes(num_experts: int) -> float:
    """The rows-per-(rank, expert) exchange before each dispatch: one int64 per global expert."""
    return 8.0 * num_experts


def grouped_gemm_rows(rows: float, local_experts: int) -> float:
    """Rows of each of the `local_experts` GEMMs a grouped expert matmul runs, routing balanced."""
    return rows / max(1, local_experts)
