"""What context parallelism costs in the model: attention's work and K/V traffic, activations over cp, errors.

The runtime's side (equality with one process, bytes issued) is tests/distributed/test_context_parallel.py.
"""

import json
import subprocess
import sys

import pytest

from autoshard.api import capture_ref, estimate_config
from autoshard.cost_models.context_parallel import head_tail_chunks, ring_exposed_s
from autoshard.cost_models.prediction import predicted_step_comm
from autoshard.errors import ConfigurationError
from autoshard.plans.contract import kv_head_fraction

# grouped-query attention: 4 key/value heads of 16
LLAMA = "llama:layers=4,hidden=1024,heads=16,kv_heads=4,ffn=2816,vocab=32000,seq={seq}"
CLUSTER = "1x8xH100-80GB"
LLAMA_8B_LAYERS = "llama:layers=4,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=32000,seq={seq}"


def _estimate(seq: int, cp: int, **kw):
    plan, cluster = estimate_config(LLAMA.format(seq=seq), CLUSTER, cp=cp, global_batch=kw.pop("global_batch", 8),
                                    **kw)
    return plan, cluster


def test_head_tail_chunks_give_every_rank_the_same_causal_work():
    cp = 4
    keys_seen = [sum(chunk + 1 for chunk in head_tail_chunks(cp, r)) for r in range(cp)]
    assert keys_seen == [2 * cp + 1] * cp
    assert sorted(c for r in range(cp) for c in head_tail_chunks(cp, r)) == list(range(2 * cp))


def test_the_kv_all_gather_moves_the_un_repeated_keys_and_values_of_the_whole_sequence():
    seq, cp = 8192, 4
    plan, cluster = _estimate(seq, cp, recompute="none")
    local = capture_ref(LLAMA.format(seq=seq), seq=seq // cp, attn="flash")
    assert kv_head_fraction(local) == pytest.approx(4 / 16)
    comm = predicted_step_comm(plan, local, cluster)
    # per layer and micro-batch: K and V of every token, 4 heads x 64 dims, bf16
    per_layer = 2 * seq * 4 * 64 * 2
    micro_batches = plan.num_microbatches
    assert comm["all_gather"] == pytest.approx(4 * micro_batches * per_layer)
    assert comm["reduce_scatter"] == pytest.approx(4 * micro_batches * per_layer)


def test_cp_halves_the_activations_a_rank_keeps():
    """Same ranks per sequence's tokens: tp=4 x dp=2 holds a whole sequence per rank, tp=4 x cp=2 half of one
    (plus the gathered keys and values attention keeps)."""
    whole, _ = _estimate(4096, 1, tp=4, dp=2, global_batch=2)
    half, _ = _estimate(4096, 2, tp=4, dp=1, global_batch=1)
    ratio = half.prediction.memory.activations_bytes / whole.prediction.memory.activations_bytes
    assert 0.5 < ratio < 0.6, ratio


@pytest.mark.long
def test_throughput_per_gpu_falls_as_cp_grows_at_a_fixed_sequence_per_gpu():
    """Published CP scaling (Llama 3 §3.3.2, torchtitan's CP runs): with the tokens per GPU fixed, a longer
    sequence over more cp ranks costs more per token (attention grows with the sequence), plus K/V traffic.
    On Llama 3 8B's layers, as those runs: the 1,024-wide toy above waits for its host at 4,096 tokens a GPU
    (cost_models/host.py), where attention's growth hides behind the host time."""
    per_gpu = []
    for cp in (1, 2, 4, 8):
        plan, _ = estimate_config(LLAMA_8B_LAYERS.format(seq=4096 * cp), CLUSTER, cp=cp, dp=8 // cp, global_batch=8,
                                  recompute="full")
        per_gpu.append(plan.prediction.tokens_per_s / 8)
    assert per_gpu == sorted(per_gpu, reverse=True), per_gpu
    assert per_gpu[-1] < 0.95 * per_gpu[0]


def test_ring_attention_hides_its_transfers_behind_long_blocks_and_not_behind_short_ones():
    assert ring_exposed_s(1.0, 5.0, 4, slowdown=1.0) == 0.0
    assert ring_exposed_s(5.0, 1.0, 4, slowdown=1.0) == pytest.approx(3 * 4.0)
    assert ring_exposed_s(1.0, 5.0, 1, slowdown=1.2) == 0.0


def test_ring_hides_kv_traffic_that_the_all_gather_waits_for_at_long_sequences():
    ag, _ = _estimate(32768, 8, dp=1, global_batch=1, recompute="full", cp_attention="allgather")
    ring, _ = _estimate(32768, 8, dp=1, global_batch=1, recompute="full", cp_attention="ring")
    assert ring.prediction.time.exposed_comm_s < ag.prediction.time.exposed_comm_s
    assert ring.prediction.iteration_time_s == pytest.approx(ag.prediction.iteration_time_s, rel=0.05)


def test_cp_with_materialized_attention_is_refused():
    with pytest.raises(ConfigurationError, match="fused attention kernel"):
        estimate_config(LLAMA.format(seq=1024), CLUSTER, cp=2, global_batch=8, attention="eager")


def test_cp_whose_chunks_do_not_divide_the_sequence_is_a_one_line_cli_error():
    out = subprocess.run([sys.executable, "-m", "autoshard.cli", "estimate", LLAMA.format(seq=1020), "--cluster",
                          CLUSTER, "--cp", "4", "--global-batch", "8"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "8 equal chunks" in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_estimate_json_reports_the_cp_degree_and_attention():
    out = subprocess.run([sys.executable, "-m", "autoshard.cli", "estimate", LLAMA.format(seq=2048), "--cluster",
                          CLUSTER, "--cp", "2", "--global-batch", "8", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["cp"] == 2 and data["cp_attention"] == "allgather" and ["cp", 2] in data["mesh"]


def _plan_json(seq: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "autoshard.cli", "plan", LLAMA.format(seq=seq), "--cluster", CLUSTER,
                          "--global-batch", "8", "--json", "--quiet"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.long
def test_the_planner_chooses_cp_where_no_plan_without_it_fits():
    data = _plan_json(262144)
    cp = data["context_parallel"]
    assert cp["without_cp_s"] is None and cp["chosen_cp"] > 1
    assert ["cp", cp["chosen_cp"]] in data["mesh"]
    assert data["predicted"]["iteration_time_s"] == pytest.approx(min(t for t in cp["by_cp_s"].values() if t))


def test_the_planner_tries_cp_where_no_layout_without_it_divides_the_gpus_and_the_batch():
    """One sequence on 4 GPUs with only data parallelism and CP in the space: without CP no layout uses the 4
    GPUs (the batch does not split), which must leave CP to try, not end the search with that error."""
    from autoshard.api import plan_with_baselines

    plan, result, _, _, _ = plan_with_baselines("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,"
                                                "seq=32768", "1x4xH100-80GB", global_batch=1, space="dp,zero,cp",
                                                baselines=False)
    assert plan.mesh.degree("cp") == 4 and result.context_parallel["without_cp_s"] is None


@pytest.mark.long
def test_the_planner_keeps_cp_off_where_data_parallel_is_faster():
    data = _plan_json(65536)
    cp = data["context_parallel"]
    assert cp["chosen_cp"] == 1 and all(t is None or t > cp["without_cp_s"] for t in cp["by_cp_s"].values())
    assert all(axis != "cp" for axis, _ in data["mesh"])


def test_runtime_cp_attention_refuses_a_sliding_window_shorter_than_the_sequence():
    """Before any collective: a window of 8 tokens over 2 x 8-token halves would be attended in full."""
    import torch
    from torch import nn

    from autoshard.errors import RuntimeSetupError
    from autoshard.runtime.context_parallel import _cp_attention, head_tail_positions

    module = nn.Module()
    module._autoshard_cp = (None, 2, 0)
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(RuntimeSetupError, match="sliding window of 8 tokens"):
        _cp_attention(module, q, q, q, None, sliding_window=8)
    assert head_tail_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
