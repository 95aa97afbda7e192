"""Collective communication time: NCCL's ring model on measured bus-bandwidth curves.

Sizes follow nccl-tests: `nbytes` is the full buffer (all-reduce: the buffer; all-gather: the gathered
output; reduce-scatter: the input; all-to-all: what one rank sends in total); bus bandwidth busbw = algbw x
factor, factor = 2(n-1)/n (all-reduce), (n-1)/n (all-gather, reduce-scatter, all-to-all), 1 (broadcast, p2p)
(REFERENCES.md §3).

A ring collective on n ranks runs `steps` = 2(n-1) (all-reduce) or n-1 (all-gather, reduce-scatter) steps,
each moving a chunk of nbytes/n per rank, so (NCCL src/graph/tuning.cc, ring latency = steps x per-hop latency)

    t = steps(n) x overhead(nbytes / n) + nbytes x factor(n) / B

B is the link's large-message bus bandwidth. `overhead(chunk)` is what a step costs beyond moving its bytes
at B (launch, protocol handshakes, the pipeline filling): read off the link's measured nccl-tests curve
(busbw by message size at `curve_ranks` ranks) as (measured time - bandwidth time) / steps at the same
per-rank chunk, never below the link's small-message latency per hop. At n = curve_ranks this reproduces the
measured curve exactly; a larger group at the same total size moves smaller chunks, pays more steps and so
reaches less of B (why the message size needed for a given busbw grows with scale). A link without a curve
uses its small-message latency per step (plain alpha-beta).

Across N nodes with k group members per node, NCCL runs one flat ring over all n ranks: N - 1 (all-gather,
reduce-scatter) or 2(N - 1) (all-reduce) of its steps cross the network and pay the network's per-step latency
instead of NVLink's; the ring's bandwidth is the slower of the intra-node links and the node's network
ports, which the gpus_per_node / k groups of a node (SPMD: all ranks issue the same collective on their own
groups) share. All-reduce may use NCCL's tree instead (2 log2 N network steps), whichever is faster.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from autoshard.hardware_profiles.profiles import COLLECTIVES, LinkProfile

__all__ = ["GroupPlacement", "group_placement", "collective_time_s", "bus_factor", "p2p_time_s", "ring_steps",
           "step_overhead_s", "curve_busbw_gbps", "peak_busbw_gbps", "redistribute_time_s"]


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


def ring_steps(collective: str, n: int) -> int:
    """Steps of NCCL's ring (all-reduce: reduce-scatter then all-gather); broadcast as a pipelined chain."""
    if n <= 1:
        return 0
    if collective == "all_reduce":
        return 2 * (n - 1)
    if collective == "p2p":
        return 1
    return n - 1


def curve_busbw_gbps(points: tuple[tuple[float, float], ...], nbytes: float) -> float:
    """Bus bandwidth at `nbytes`, interpolated linearly in log(size) between measured points; flat beyond
    the largest point, proportional to size below the smallest (latency-bound: time constant)."""
    sizes = [p[0] for p in points]
    if nbytes >= sizes[-1]:
        return points[-1][1]
    if nbytes <= sizes[0]:
        return points[0][1] * nbytes / sizes[0]
    i = bisect.bisect_right(sizes, nbytes)
    (s0, b0), (s1, b1) = points[i - 1], points[i]
    w = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return b0 + w * (b1 - b0)


def step_overhead_s(link: LinkProfile, collective: str, chunk_bytes: float, ranks: int | None = None) -> float:
    """Seconds one ring step costs beyond moving its bytes at the curve's large-message bandwidth, for a
    per-rank chunk of `chunk_bytes` (see the module docstring), from the curve measured on the group size
    closest to `ranks`; the link's small-message latency per hop when it has no curve."""
    floor = link.latency_us * 1e-6
    found = link.curve(collective, ranks)
    if found is None:
        return floor
    measured, n0, points = found
    total = chunk_bytes * n0
    factor = bus_factor(measured, n0)
    t = total * factor / (curve_busbw_gbps(points, total) * 1e9)
    t_bw = total * factor / (_best_gbps(points) * 1e9)
    return max(floor, (t - t_bw) / ring_steps(measured, n0))


def _best_gbps(points: tuple[tuple[float, float], ...]) -> float:
    """The highest busbw of a measured curve: its large-message bandwidth B. nccl-tests curves rise to it at their
    largest sizes; gloo's on CPU ranks peak at a few MB and fall beyond (memory traffic outgrows the caches:
    all-gather on 4 ranks of this project's VM 0.49 GB/s at 8 MB, 0.25 at 32 MB, 2026-11-26). Taking the last
    point as B priced every smaller collective at the largest one's bandwidth, 2.4x too slow at 8 MB; with the
    best, the rest of the curve is overhead and the measured curve is reproduced at every size."""
    return max(p[1] for p in points)


def peak_busbw_gbps(link: LinkProfile, collective: str, ranks: int | None = None) -> float:
    """Large-message bus bandwidth of `collective` on groups of `ranks`: the best point of its own measured curve
    (`_best_gbps`; NVLink SHARP all-reduce only reaches its peak on 8 GPUs, nccl #1455), else the profile's figure."""
    found = link.curve(collective, ranks)
    if found is not None and found[0] == collective:
        return _best_gbps(found[2])
    return link.busbw_gbps[collective]


def _intra_s(collective: str, nbytes: float, n: int, link: LinkProfile) -> float:
    steps = ring_steps(collective, n)
    return steps * step_overhead_s(link, collective, nbytes / n, n) + \
        nbytes * bus_factor(collective, n) / (peak_busbw_gbps(link, collective, n) * 1e9)


def _across_nodes_s(collective: str, nbytes: float, group: GroupPlacement, cluster) -> float:
    n, k, nodes = group.size, group.ranks_per_node, group.num_nodes
    intra, inter = cluster.intra, cluster.inter
    # the node's ports are shared by the gpus_per_node / k groups that communicate at the same time
    net_gbps = inter.busbw_gbps[collective] * k / cluster.gpus_per_node
    bw = min(peak_busbw_gbps(intra, collective, k), net_gbps) if k > 1 else net_gbps
    data_s = nbytes * bus_factor(collective, n) / (bw * 1e9)
    intra_step = step_overhead_s(intra, collective, nbytes / n, k)
    inter_step = max(intra_step, step_overhead_s(inter, collective, nbytes / n, nodes))
    steps = ring_steps(collective, n)
    net_steps = (2 if collective == "all_reduce" else 1) * (nodes - 1)
    ring = (steps - net_steps) * intra_step + net_steps * inter_step + data_s
    if collective != "all_reduce":
        return ring
    # NCCL's tree: up and down a chain inside each node and a binary tree across nodes (tuning.cc)
    tree = 2 * ((k - 1) * intra_step + math.ceil(math.log2(nodes)) * inter_step) + data_s
    return min(ring, tree)


def collective_time_s(collective: str, nbytes: float, group: GroupPlacement, cluster) -> float:
    """Seconds for one `collective` of `nbytes` on `group` of `cluster` (a ClusterSpec), issued between
    compute kernels (each link's `sync_us` added: see LinkProfile)."""
    n, nodes = group.size, group.num_nodes
    if n <= 1 or nbytes <= 0:
        bus_factor(collective, 2)  # still reject unknown collectives
        return 0.0
    link = cluster.intra if nodes == 1 else cluster.inter
    return _collective_s(collective, nbytes, group, cluster) + link.sync_us * 1e-6


def redistribute_time_s(collective: str, nbytes: float, group: GroupPlacement, cluster) -> float:
    """`collective_time_s` of a collective a tensor-parallel plan issues through DTensor's `redistribute`: the
    same, plus what that path costs beyond the raw call on the link (`LinkProfile.redistribute_us`, measured by
    `autoshard profile`; 0 in the datasheet profiles)."""
    t = collective_time_s(collective, nbytes, group, cluster)
    if t == 0.0:
        return t
    link = cluster.intra if group.num_nodes == 1 else cluster.inter
    return t + link.redistribute_extra_us(collective, group.size) * 1e-6


def _collective_s(collective: str, nbytes: float, group: GroupPlacement, cluster) -> float:
    n, k, nodes = group.size, group.ranks_per_node, group.num_nodes
    if collective == "p2p":
        return p2p_time_s(nbytes, cluster, same_node=nodes == 1)
    if nodes == 1:
        return _intra_s(collective, nbytes, n, cluster.intra)
    if collective == "all_to_all":  # direct sends: the cross-node share over the node's ports, the rest local
        inter, intra = cluster.inter, cluster.intra
        per_gpu_net = inter.busbw_gbps["all_to_all"] / cluster.gpus_per_node
        cross, local = nbytes * (n - k) / n, nbytes * (k - 1) / n
        return ((nodes - 1) * step_overhead_s(inter, collective, nbytes / n, nodes) + cross / (per_gpu_net * 1e9)
                + local / (intra.busbw_gbps["all_to_all"] * 1e9))
    if collective == "broadcast":  # a pipelined chain through the nodes
        bw = cluster.inter.busbw_gbps["broadcast"] * k / cluster.gpus_per_node
        return math.ceil(math.log2(nodes)) * cluster.inter.latency_us * 1e-6 + nbytes / (bw * 1e9)
    return _across_nodes_s(collective, nbytes, group, cluster)


def p2p_time_s(nbytes: float, cluster, *, same_node: bool) -> float:
    """One point-to-point send of `nbytes` (pipeline activations), all GPUs of a node sending at once."""
    if nbytes <= 0:
        return 0.0
    link = cluster.intra if same_node else cluster.inter
    bw = link.busbw_gbps["p2p"] if same_node else link.busbw_gbps["p2p"] / cluster.gpus_per_node
    return step_overhead_s(link, "p2p", nbytes, 2) + nbytes / (bw * 1e9) + link.sync_us * 1e-6
