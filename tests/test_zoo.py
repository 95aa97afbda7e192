import pytest

from autoshard.capture import capture_model
from autoshard.errors import ModelSpecError
from autoshard.models import ZOO, load_model, parse_spec


def _params(name):
    return capture_model(load_model(name)).num_params


def test_gpt3_175b_has_174_6_billion_parameters(gpt3_graph):
    assert gpt3_graph.num_params == pytest.approx(174.6e9, rel=0.005)
    assert gpt3_graph.num_layers == 96


def test_llama3_8b_has_8_03_billion_parameters():
    assert _params("llama3-8b") == pytest.approx(8.03e9, rel=0.005)


@pytest.mark.parametrize("name", ["gpt-1.7b", "gpt-7.5b", "gpt-39.1b", "gpt-145.6b", "gpt-1t"])
def test_narayanan_models_match_the_papers_parameter_formula(name):
    """Narayanan et al. 2021 §5.1: P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))."""
    spec = ZOO[name]
    l, h, v, s = spec.layers, spec.hidden, spec.vocab, spec.seq
    assert _params(name) == pytest.approx(12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h)), rel=0.005)


@pytest.mark.parametrize("name,billions", [("llama2-7b", 6.74), ("llama2-70b", 68.98), ("llama3-70b", 70.55),
                                           ("llama3-405b", 405.85)])
def test_llama_parameter_counts_match_published_sizes(name, billions):
    assert _params(name) == pytest.approx(billions * 1e9, rel=0.005)


def test_narayanan_family_uses_table1_dimensions():
    spec = ZOO["gpt-529.6b"]
    assert (spec.layers, spec.hidden, spec.heads, spec.vocab, spec.seq) == (105, 20480, 128, 51200, 2048)


def test_spec_string_builds_custom_gpt_with_ffn_and_vocab():
    spec = parse_spec("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=100,ffn=96")
    assert (spec.layers, spec.hidden, spec.heads, spec.seq, spec.vocab, spec.ffn_size) == (2, 64, 4, 32, 100, 96)
    g = capture_model(load_model("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=100,ffn=96"))
    # 2 x (4h^2 + 2*h*ffn + biases/norms) + embeddings
    linear = 2 * (4 * 64 * 64 + 2 * 64 * 96)
    assert g.num_params > linear


def test_gpt_spec_with_kv_heads_builds_grouped_query_attention():
    g = capture_model(load_model("gpt:layers=2,hidden=64,heads=8,kv_heads=2,seq=16,vocab=50"))
    k_proj = next(op for op in g.ops if op.name.endswith("attn.k_proj"))
    assert k_proj.params[0].shape == (16, 64)  # 2 kv heads x 8 dims


@pytest.mark.parametrize("bad,fragment", [
    ("gpt:layers=2,hidden=64,seq=32", "missing heads"),
    ("gpt:layers=2,hidden=65,heads=4,seq=32", "not divisible"),
    ("gpt:layers=x,hidden=64,heads=4,seq=32", "not an integer"),
    ("gpt:layers=2,hidden=64,heads=4,seq=32,colour=3", "unknown key"),
    ("llama:layers=2,hidden=64,heads=6,kv_heads=4,seq=32", "kv_heads"),
    ("gtp3-175b", "did you mean gpt3-175b"),
])
def test_bad_model_references_raise_model_spec_error(bad, fragment):
    with pytest.raises(ModelSpecError, match=fragment):
        load_model(bad)


def test_factory_returning_module_and_inputs_is_captured():
    g = capture_model(load_model("factory_models:tiny_mlp"))
    assert g.num_params == 32 * 64 + 64 + 64 * 32 + 32


def test_factory_errors_name_the_problem():
    with pytest.raises(ModelSpecError, match="raised RuntimeError: checkpoint not found"):
        load_model("factory_models:raises")
    with pytest.raises(ModelSpecError, match="not an nn.Module"):
        load_model("factory_models:not_a_module")
    with pytest.raises(ModelSpecError, match="cannot import"):
        load_model("no_such_pkg.models:build")
