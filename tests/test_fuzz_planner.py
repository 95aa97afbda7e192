"""Property: over random small transformers, clusters and memory caps the planner returns a plan within the cap
(by its own estimate) or a clear InfeasiblePlanError, never another exception."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoshard.api import plan
from autoshard.errors import InfeasiblePlanError
from autoshard.hardware_profiles import ClusterSpec


@st.composite
def cases(draw):
    family = draw(st.sampled_from(["gpt", "llama"]))
    heads = draw(st.sampled_from([2, 4, 8]))
    hidden = heads * draw(st.sampled_from([16, 32, 64]))
    layers = draw(st.integers(1, 4))
    seq = draw(st.sampled_from([32, 64, 128]))
    kv = draw(st.sampled_from([k for k in (1, 2, heads) if heads % k == 0])) if family == "llama" else heads
    spec = f"{family}:layers={layers},hidden={hidden},heads={heads},seq={seq},vocab=256,kv_heads={kv}"
    nodes = draw(st.integers(1, 4))
    gpus = draw(st.sampled_from([1, 2, 4, 8]))
    gpu = draw(st.sampled_from(["A100-80GB", "H100-80GB", "V100-32GB"]))
    batch = nodes * gpus * draw(st.sampled_from([1, 2, 4]))
    cap = draw(st.sampled_from([None, 0.05, 0.5, 2.0, 16.0]))
    return spec, f"{nodes}x{gpus}x{gpu}", batch, cap


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_planner_respects_the_cap_or_says_it_cannot(case):
    spec, cluster, batch, cap = case
    try:
        p = plan(spec, cluster, global_batch=batch, memory_cap=cap, time_limit_s=5)
    except InfeasiblePlanError as exc:
        assert exc.min_memory_gib is None or cap is None or exc.min_memory_gib > cap
        return
    limit = (cap * 2**30) if cap is not None else ClusterSpec.parse(cluster).device_memory_bytes
    assert p.prediction.memory.total_bytes <= limit * 1.0001
    assert p.prediction.iteration_time_s > 0 and p.mesh.size <= int(cluster.split("x")[0]) * int(cluster.split("x")[1])
