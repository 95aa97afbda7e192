"""Hugging Face models as users build them: default configs (use_cache=True) plan through `module:factory`,
`--seq` applies to factory models (or says why not), and the contract keeps plans the runtime cannot run out."""

import json

import pytest

from autoshard.cli import main


@pytest.mark.parametrize("factory", ["default_mistral", "default_opt", "default_qwen2", "default_mixtral"])
def test_plan_of_a_default_config_decoder_works_without_use_cache_argument(factory, capsys):
    code = main(["plan", f"tests.factory_models:{factory}", "--cluster", "1x4xcpu", "--global-batch", "8",
                 "--json", "--time-limit", "10"])
    out = capsys.readouterr().out
    assert code == 0, out
    plan = json.loads(out)
    assert plan["ops"] and plan["mesh"]


def test_config_use_cache_is_restored_after_capture():
    import torch

    from autoshard.capture import capture
    from tests.factory_models import default_mistral

    model = default_mistral()
    assert model.config.use_cache is True
    capture(model, (torch.zeros(2, 8, dtype=torch.long),))
    assert model.config.use_cache is True


def test_seq_sets_the_token_length_of_a_factory_model():
    from autoshard.api import load_graph

    assert load_graph("tests.factory_models:default_qwen2", seq=16).seq_len == 16
    assert load_graph("tests.factory_models:default_qwen2", seq=8).seq_len == 8


def test_seq_on_a_factory_whose_inputs_are_not_tokens_is_one_clear_error():
    from autoshard.api import load_graph
    from autoshard.errors import ModelSpecError

    with pytest.raises(ModelSpecError, match="^seq sets the length of token-id inputs"):
        load_graph("tests.factory_models:tiny_mlp", seq=16)


def test_a_decoder_whose_config_states_no_length_asks_for_seq_and_plans_with_it(capsys):
    args = ["plan", "tests.factory_models:default_bloom", "--cluster", "1x4xcpu", "--global-batch", "8", "--json",
            "--time-limit", "10"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "states no sequence length" in err and "pass --seq N" in err
    assert main(args + ["--seq", "32"]) == 0
    assert json.loads(capsys.readouterr().out)["ops"]


def test_planner_never_splits_heads_a_key_value_head_count_does_not_divide():
    from autoshard.api import load_graph
    from autoshard.hardware_profiles import ClusterSpec
    from autoshard.planner.search import enumerate_candidates, parse_space

    graph = load_graph("tests.factory_models:default_mistral")  # 4 query heads, 2 key/value heads
    found, _ = enumerate_candidates(graph, ClusterSpec.parse("1x4xcpu"), global_batch=8,
                                    space=parse_space("dp,tp1d"), cap_bytes=1e12)
    degrees = {c.mesh.degree("tp") for c in found}
    assert degrees == {1, 2}  # tp=4 would split 2 key/value heads 4 ways


def test_an_mlp_width_that_is_no_multiple_of_the_heads_does_not_limit_tensor_parallelism():
    """Llama 2 7B's MLP is 11,008 wide, 86 heads of 128: a width, not heads. tp 8 splits the 32 heads and the
    MLP alike (Megatron-LM and torchtitan run it so); only the projections feeding the attention cut whole
    heads."""
    from autoshard.api import capture_ref, estimate_config
    from autoshard.plans.contract import largest_head_divisor, projection_head_slices

    graph = capture_ref("llama:layers=2,hidden=256,heads=4,kv_heads=4,ffn=704,seq=64,vocab=512")  # ffn 11 heads
    assert {name.rsplit(".", 1)[-1] for name in projection_head_slices(graph)} == {"q_proj", "k_proj", "v_proj"}
    assert largest_head_divisor(graph) == 4
    plan, _ = estimate_config("llama:layers=2,hidden=256,heads=4,kv_heads=4,ffn=704,seq=64,vocab=512",
                              "1x4xA100-80GB", tp=4, global_batch=4)
    assert plan.mesh.degree("tp") == 4


def test_bloom_attention_over_batch_times_heads_still_limits_tensor_parallelism_to_head_divisors():
    """BLOOM multiplies q and k as (batch x heads, S, head_dim) 3-D tensors: its 12 heads show only in the
    scores' softmax. tp 8 would cut heads; tp 4 does not."""
    from autoshard.api import estimate_config
    from autoshard.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="tp=8 does not divide the 12 attention heads"):
        estimate_config("tests.factory_models:bloom_12_heads", "1x8xA100-80GB", tp=8, global_batch=8)
    plan, _ = estimate_config("tests.factory_models:bloom_12_heads", "1x8xA100-80GB", tp=4, global_batch=8)
    assert plan.mesh.degree("tp") == 4


def test_baselines_split_heads_only_where_the_planner_and_estimate_would(capsys):
    """One key/value head: estimate refuses every tensor-parallel degree and the search offers none, so the
    tensor-parallel baselines are not priced either (they priced tp 2 and 2 x 2 grids), and say why."""
    from autoshard.cli import main

    assert main(["plan", "tests.factory_models:mqa_mistral", "--cluster", "1x4xA100-80GB", "--global-batch", "8",
                 "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    for family in ("tp1d", "tp2d", "tp3d"):
        assert out["baselines"][family] is None
        assert "divides the model's attention heads" in out["baseline_configs"][family]


def test_planner_offers_no_one_f_one_b_with_fewer_micro_batches_than_stages():
    from autoshard.api import load_graph
    from autoshard.hardware_profiles import ClusterSpec
    from autoshard.planner.search import enumerate_candidates, parse_space

    graph = load_graph("tests.factory_models:default_qwen2")
    found, _ = enumerate_candidates(graph, ClusterSpec.parse("1x4xcpu"), global_batch=2,
                                    space=parse_space("dp,pp"), cap_bytes=1e12)
    pipelined = [c for c in found if c.pipe.degree > 1 and c.pipe.schedule == "1f1b"]
    assert all(c.num_microbatches >= c.pipe.degree for c in pipelined)


def test_falcon_fused_qkv_is_a_linear_never_split_across_more_ranks_than_its_head_slices():
    """Falcon's `FalconLinear` multiplies by `self.weight.T` in its own forward: still a Linear (a weight
    transposed in a forward is a view), and its fused multi-query q/k/v (4 query heads + k + v = 6 head slices)
    is never split 4 ways over a 2 x 2 grid, which cuts heads the model's view to heads + 2 needs whole."""
    import torch
    import transformers as T

    from autoshard.capture import capture
    from autoshard.capture.ir import OpKind
    from autoshard.plans.contract import projection_head_slices
    from autoshard.plans.layouts import OUT, MeshSpec
    from autoshard.plans.strategies import strategies_for

    torch.manual_seed(0)
    model = T.FalconForCausalLM(T.FalconConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                               vocab_size=128))
    graph = capture(model, (torch.zeros(2, 8, dtype=torch.long),))
    qkv = next(op for op in graph.ops if op.name.endswith("h.0.self_attention.query_key_value"))
    assert qkv.kind is OpKind.LINEAR
    slices = projection_head_slices(graph)[qkv.name]
    assert slices == 6
    mesh = MeshSpec.of(tp_r=2, tp_c=2)

    def out_axes(st) -> int:  # grid axes splitting the output features (each of degree 2)
        return sum(1 for _, p in st.params[0].compute.items if p == OUT)

    assert {out_axes(st) for st in strategies_for(qkv, mesh, 2, head_slices=slices)} == {0, 1}
    assert 2 in {out_axes(st) for st in strategies_for(qkv, mesh, 2)}  # offered when heads are not counted


def test_sequence_parallel_on_a_convolutional_net_is_one_clear_error():
    """The sequence dim of a 4-D image tensor is its height, which a batch norm reduces over: `estimate`
    refuses sequence parallelism for a model with convolutions instead of pricing a plan that trains wrong."""
    import torch
    from torch import nn

    from autoshard.capture import capture
    from autoshard.errors import ConfigurationError
    from autoshard.hardware_profiles import ClusterSpec
    from autoshard.planner.estimate import HandConfig, estimate

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(8, 10))
    graph = capture(net, (torch.randn(2, 3, 16, 16),))
    cluster = ClusterSpec.parse("1x4xcpu")
    with pytest.raises(ConfigurationError, match="drop sequence_parallel"):
        estimate(graph, cluster, HandConfig(tp=2, dp=2, global_batch=8, sequence_parallel=True))
    estimate(graph, cluster, HandConfig(tp=2, dp=2, global_batch=8))  # without it the plan is priced


def test_encoder_decoder_captures_from_its_natural_keyword_inputs():
    """T5 as users call it, `model(input_ids=..., decoder_input_ids=...)`: the same graph as the positional
    form with the skipped `attention_mask` at its default; a keyword the forward does not take is one error."""
    import torch
    import transformers as T

    from autoshard.capture import capture
    from autoshard.errors import CaptureError

    torch.manual_seed(0)
    model = T.T5ForConditionalGeneration(T.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                                    vocab_size=128))
    ids = torch.zeros(2, 8, dtype=torch.long)
    by_name = capture(model, {"input_ids": ids, "decoder_input_ids": ids})
    by_position = capture(model, (ids, None, ids))
    assert by_name.fingerprint() == by_position.fingerprint()
    with pytest.raises(CaptureError, match="labels_typo"):
        capture(model, {"input_ids": ids, "labels_typo": ids})


def test_an_encoder_decoder_factory_without_inputs_is_given_decoder_ids_too(capsys):
    """A T5 factory returning only the model: autoshard guessed encoder token ids alone and the export failed
    with advice to make the model exportable; it now passes decoder ids too, as `model(ids, None, ids)`."""
    from autoshard.cli import main

    assert main(["estimate", "tests.factory_models:default_t5", "--seq", "16", "--cluster", "1x2xA100-80GB",
                 "--global-batch", "2", "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_time_s"] > 0


def test_a_model_whose_blocks_do_not_repeat_is_planned_without_recompute_it_would_not_run(capsys):
    """T5 with two layers: each block list's first block differs (relative position bias), so no block repeats
    and full recompute changes nothing; the tie went to "full" (alphabetically first), which the plan then
    claimed to run."""
    from autoshard.cli import main

    assert main(["plan", "tests.factory_models:default_t5", "--seq", "16", "--cluster", "1x2xA100-80GB",
                 "--global-batch", "4", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recompute"] == "none"


@pytest.mark.long
def test_a_block_list_whose_first_block_differs_is_never_pipelined_and_estimate_says_why(capsys):
    # RWKV's block 0 has an extra LayerNorm: blocks 1-2 repeat, block 0 does not. Stages cut the model's list of
    # identical blocks; before, the search's pipeline candidates indexed layer 2 of a 2-layer partition (KeyError).
    # Four tokens: the graph unrolls RWKV's recurrence per token, and what matters here is the block list
    from autoshard.api import load_graph
    from autoshard.plans.contract import pipeline_blocker

    graph = load_graph("tests.factory_models:default_rwkv", seq=4)
    assert [b.count for b in graph.blocks] == [2]
    assert "1 of the 3 blocks of rwkv.blocks (0) differ from the others" in pipeline_blocker(graph)
    code = main(["plan", "tests.factory_models:default_rwkv", "--cluster", "1x4xcpu", "--global-batch", "8",
                 "--seq", "4", "--space", "pp,dp", "--json", "--time-limit", "10"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "pp" not in dict(json.loads(out)["mesh"])
    assert main(["estimate", "tests.factory_models:default_rwkv", "--cluster", "1x4xcpu", "--seq", "4", "--pp", "2",
                 "--dp", "2", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot be cut into pipeline stages" in err and "use --pp 1" in err
