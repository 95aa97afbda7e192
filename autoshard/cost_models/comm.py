"""Collective communication time: an alpha-beta model on nccl-tests bus bandwidths, hierarchical across nodes.

Sizes follow nccl-tests: `nbytes` is the full buffer (all-reduce: the buffer; all-gather: the gathered
output; reduce-scatter: the input; all-to-all: what one rank sends in total). With bus bandwidth B measured
for the link, one collective on n ranks takes

    t = steps * latency + nbytes * factor(n) / B,   factor = 2(n-1)/n (all-reduce), (n-1)/n (all-gather,
                                                     reduce-scatter, all-to-all), 1 (broadcast, p2p)

(REFERENCES.md §3). A group inside one node uses the intra-node link. A group spanning N nodes with k members
per node runs hierarchically, as NCCL does: reduce-scatter inside the node, the collective across nodes on
1/k of the data per GPU, all-gather inside the node. Across nodes every GPU of a node communicates at the same
time (SPMD: all ranks issue the same collective on their own groups), so each gets 1/gpus_per_node of the
node's network bandwidth, whether its group is strided (one member per node) or not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoshard.hardware_profiles.profiles import COLLECTIVES

__all__ = ["GroupPlacement", "group_placement", "collective_time_s", "bus_factor", "p2p_time_s"]


@dataclass(frozen=True)
class GroupPlacement:
    """A communication group: `size` ranks, `ranks_per_node` of them in each node they touch."""

    size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.ranks_per_node < 1 or self.size % self.ranks_per_node:
            raise ValueError(f"invalid group: size {self.size}, {self.ranks_per_node} per node")

    @property
    def num_nodes(self) -> int:
        return self.size // self.ranks_per_node


def group_placement(axes: list[tuple[int, int]], gpus_per_node: int) -> GroupPlacement:
    """The group spanned by mesh axes given as (stride, degree) pairs, ranks laid out row-major over nodes."""
    members = [0]
    for stride, degree in axes:
        members = [m + i * stride for m in members for i in range(degree)]
    in_first_node = sum(1 for m in members if m < gpus_per_node)
    size = len(members)
    per_node = max(1, in_first_node)
    if size % per_node:  # irregular layouts: treat as fully spread (conservative)
        per_node = 1
    return GroupPlacement(size=size, ranks_per_node=per_node)


def bus_factor(collective: str, n: int) -> float:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
    if n <= 1:
        return 0.0
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def _steps(collective: str, n: int, *, tree: bool = False) -> int:
    """Latency-bound steps of a ring; across nodes NCCL's all-reduce switches to a tree (log steps)."""
    if n <= 1:
        return 0
    if collective == "all_reduce":
        return min(2 * (n - 1), 2 * math.ceil(math.log2(n)) + 2) if tree else 2 * (n - 1)
    if collective in ("p2p", "broadcast"):
        return 1 if collective == "p2p" else math.ceil(math.log2(n))
    return n - 1


def _flat_time_s(collective: str, nbytes: float, n: int, busbw_gbps: float, latency_us: float,
                 *, tree: bool = False) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps = _steps(collective, n, tree=tree)
    return steps * latency_us * 1e-6 + nbytes * bus_factor(collective, n) / (busbw_gbps * 1e9)


def collective_time_s(collective: str, nbytes: float, group: GroupPlacement, cluster) -> float:
    """Seconds for one `collective` of `nbytes` on `group` of `cluster` (a ClusterSpec)."""
    n, k, nodes = group.size, group.ranks_per_node, group.num_nodes
    if n <= 1 or nbytes <= 0:
        bus_factor(collective, 2)  # still reject unknown collectives
        return 0.0
    intra, inter = cluster.intra, cluster.inter
    if nodes == 1:
        return _flat_time_s(collective, nbytes, n, intra.busbw_gbps[collective], intra.latency_us)
    per_gpu_net = inter.busbw_gbps[collective] / cluster.gpus_per_node
    if collective == "all_reduce":
        local = 2 * _flat_time_s("reduce_scatter", nbytes, k, intra.busbw_gbps["reduce_scatter"], intra.latency_us)
        return local + _flat_time_s("all_reduce", nbytes / k, nodes, per_gpu_net, inter.latency_us, tree=True)
    if collective in ("all_gather", "reduce_scatter"):
        local = _flat_time_s(collective, nbytes, k, intra.busbw_gbps[collective], intra.latency_us)
        return local + _flat_time_s(collective, nbytes / k, nodes, per_gpu_net, inter.latency_us)
    if collective == "all_to_all":
        cross = nbytes * (n - k) / n
        local = nbytes * (k - 1) / n
        return ((nodes - 1) * inter.latency_us * 1e-6 + cross / (per_gpu_net * 1e9)
                + local / (intra.busbw_gbps["all_to_all"] * 1e9))
    if collective == "broadcast":
        return _flat_time_s("broadcast", nbytes, nodes, per_gpu_net, inter.latency_us)
    return p2p_time_s(nbytes, cluster, same_node=False)


def p2p_time_s(nbytes: float, cluster, *, same_node: bool) -> float:
    """One point-to-point send of `nbytes` (pipeline activations), all GPUs of a node sending at once."""
    if nbytes <= 0:
        return 0.0
    if same_node:
        link = cluster.intra
        return link.latency_us * 1e-6 + nbytes / (link.busbw_gbps["p2p"] * 1e9)
    link = cluster.inter
    return link.latency_us * 1e-6 + nbytes / (link.busbw_gbps["p2p"] / cluster.gpus_per_node * 1e9)
