"""The plan is never beaten by a hand configuration under the same cost model (issue 17).

For a seeded grid of models x clusters x global batches x sequence lengths x memory caps, every configuration
`autoshard estimate` accepts (tp, pp, dp, micro-batch, recompute, sequence parallel, ZeRO stage, schedule and
virtual stages, Megatron-style per-op assignment) is priced on the same captured graph; the plan's predicted
iteration time must be no slower than the fastest one that fits, within the ILP's relative tolerance.
"""

from __future__ import annotations

import pytest

from autoshard.api import load_graph, resolve_cluster
from autoshard.errors import AutoshardError
from autoshard.planner.estimate import HandConfig, estimate
from autoshard.planner.planning import make_plan
from autoshard.planner.search import SPACE

ILP_TOLERANCE = 1e-3  # relative MIP gap the solvers stop at, plus float noise in the evaluator

CASES = [  # model, cluster, global batch, memory cap GiB (None: the GPU's)
    ("gpt:layers=4,hidden=1024,heads=16,seq=1024,vocab=32000", "2x4xA100-80GB", 24, None),
    ("gpt:layers=8,hidden=4096,heads=32,seq=2048,vocab=50257", "2x4xA100-40GB", 32, 10),
    ("llama:layers=8,hidden=4096,heads=32,seq=8192,vocab=128256,kv_heads=8,ffn=14336", "1x8xH100-80GB", 16, 20),
    ("llama:layers=4,hidden=4096,heads=32,seq=32768,vocab=128256,kv_heads=8,ffn=14336", "1x8xH200-141GB", 16, 60),
]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def hand_configs(graph, cluster, global_batch: int):
    """Every hand configuration of the grid: tensor parallelism inside a node, as Megatron runs it."""
    n, gpn = cluster.num_gpus, cluster.gpus_per_node
    for tp in _divisors(gpn):
        for pp in _divisors(n // tp):
            dp = n // (tp * pp)
            if pp > graph.num_layers or global_batch % dp:
                continue
            schedules = [(None, 1)] if pp == 1 else [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2),
                                                      ("looped-bfs", 2)]
            for mb in _divisors(global_batch // dp):
                for rc in ("none", "selective", "full"):
                    for sp in (False, True) if tp > 1 else (False,):
                        for zero in (0, 1, 2, 3) if dp > 1 else (0,):
                            for schedule, v in schedules:
                                yield HandConfig(tp=tp, pp=pp, dp=dp, micro_batch=mb, global_batch=global_batch,
                                                 recompute=rc, sequence_parallel=sp, zero=zero, schedule=schedule,
                                                 virtual_stages=v)


@pytest.mark.slow
@pytest.mark.parametrize("model,cluster_text,global_batch,cap_gib", [  # all but the first in the long suite
    pytest.param(m, c, b, cap, id=f"{m.split(':')[0]}-{c}-gb{b}-cap{cap}", marks=[pytest.mark.long] if i else [])
    for i, (m, c, b, cap) in enumerate(CASES)])
def test_no_hand_configuration_of_the_grid_beats_the_plan(model, cluster_text, global_batch, cap_gib):
    cluster = resolve_cluster(cluster_text)
    graph = load_graph(model)
    cap = cap_gib * 2**30 if cap_gib else cluster.device_memory_bytes
    plan, _ = make_plan(graph, cluster, global_batch=global_batch, space=frozenset(SPACE), cap_bytes=cap)
    planned = plan.prediction.iteration_time_s
    priced = 0
    for cfg in hand_configs(graph, cluster, global_batch):
        try:
            hand, _ = estimate(graph, cluster, cfg)
        except AutoshardError:  # cannot run (heads, layers, schedule) or does not fit the GPU
            continue
        if hand.prediction.memory.total_bytes > cap:
            continue
        priced += 1
        assert planned <= hand.prediction.iteration_time_s * (1 + ILP_TOLERANCE), (
            f"{cfg} predicts {hand.prediction.iteration_time_s:.4f} s, the plan ({plan.mesh}, micro-batch "
            f"{plan.micro_batch}, recompute {plan.recompute}) {planned:.4f} s")
    assert priced > 0, "the grid priced no configuration that fits: the case checks nothing"
