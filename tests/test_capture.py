import math
from dataclasses import replace

import pytest
import torch

from autoshard.capture import OpKind, capture, capture_model
from autoshard.errors import CaptureError
from autoshard.models import load_model


def megatron_flops_per_token(l, h, s, v):
    """Narayanan et al. 2021: 24·l·h²·(1 + s/(6h)) + 2·h·V forward FLOPs per token."""
    return 24 * l * h * h * (1 + s / (6 * h)) + 2 * h * v


def test_gpt2_forward_flops_per_token_match_megatron_count():
    g = capture_model(load_model("gpt2"))
    want = megatron_flops_per_token(12, 768, 1024, 50257)
    assert g.matmul_flops_per_sample / 1024 == pytest.approx(want, rel=0.01)


def test_gpt3_forward_flops_per_token_match_megatron_count(gpt3_graph):
    want = megatron_flops_per_token(96, 12288, 2048, 51200)
    assert gpt3_graph.matmul_flops_per_sample / 2048 == pytest.approx(want, rel=0.01)


def test_two_block_capture_expanded_equals_full_trace():
    for ref in ("gpt:layers=5,hidden=64,heads=4,seq=16,vocab=128",
                "llama:layers=4,hidden=64,heads=4,kv_heads=2,seq=16,vocab=128",
                "bert:layers=3,hidden=64,heads=4,seq=16,vocab=128"):
        loaded = load_model(ref)
        # spec models are captured in bf16, the precision they are planned in
        full = capture(loaded.module.to(torch.bfloat16), loaded.example_inputs(2), name=loaded.name)
        fast = capture_model(loaded)
        assert replace(full, capture_s=0, _index={}) == replace(fast, capture_s=0, _index={}), ref


def _tiny(family, **kw):
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32,
                                          use_cache=False, bos_token_id=0, eos_token_id=0, **kw))
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                            num_key_value_heads=2, intermediate_size=128, vocab_size=100,
                                            max_position_embeddings=32, use_cache=False, bos_token_id=0,
                                            eos_token_id=0, pad_token_id=0, **kw))
    return BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      intermediate_size=128, vocab_size=100, max_position_embeddings=32, **kw))


@pytest.mark.parametrize("family,linears_per_block", [("gpt2", 4), ("llama", 7), ("bert", 6)])
def test_transformers_models_capture_with_tied_blocks(family, linears_per_block):
    with torch.device("meta"):
        model = _tiny(family)
    g = capture(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    assert len(g.blocks) == 1 and g.blocks[0].count == 2
    block = [g.op(n) for n in g.blocks[0].op_names[0]]
    assert sum(op.kind is OpKind.LINEAR for op in block) == linears_per_block
    assert any(op.kind is OpKind.ATTENTION for op in block)
    assert g.num_params == sum(p.numel() for p in model.parameters())
    assert not g.unknown_ops


def test_capture_records_batch_dims_and_per_sample_shapes():
    with torch.device("meta"):
        model = _tiny("gpt2")
    g = capture(model, (torch.zeros(8, 16, dtype=torch.long, device="meta"),))
    c_fc = g.op("transformer.h.0.mlp.c_fc")
    assert c_fc.output_meta.shape == (1, 16, 256) and c_fc.output_meta.batch_dims == (0,)
    assert c_fc.fwd_flops == 2 * 16 * 64 * 256 and c_fc.bwd_flops == 2 * c_fc.fwd_flops
    assert c_fc.gemm == (16, 256, 64)


def test_saved_activations_with_fused_kernels_match_korthikanti_34sbh_plus_5as2b():
    """Korthikanti et al. 2022 §4.1: a GPT layer keeps s·b·h·(34 + 5·a·s/h) bytes with 16-bit activations, with
    Megatron's fused kernels (GeLU keeps its input only); eager transformers' eight-kernel `gelu_new` keeps more."""
    s, h, a = 16, 64, 4
    with torch.device("meta"):
        model = _tiny("gpt2", attn_implementation="eager")
    g = capture(model, (torch.zeros(2, s, dtype=torch.long, device="meta"),))
    block = [g.op(n) for n in g.blocks[0].op_names[1]]
    def nbytes(tensors):
        return sum(t.numel * (1 if t.dtype == "bool" else 2) for t in tensors)

    fused = sum(nbytes(op.saved if op.saved_fused is None else op.saved_fused) for op in block)
    assert fused == s * h * (34 + 5 * a * s / h)
    assert sum(nbytes(op.saved) for op in block) > fused


def test_untraceable_model_raises_capture_error_naming_the_model():
    class DataDependent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow cannot be exported
                return self.lin(x)
            return x

    with pytest.raises(CaptureError, match="DataDependent"):
        capture(DataDependent(), (torch.randn(2, 4),))


def test_unknown_aten_ops_are_kept_and_reported():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.special.bessel_j0(self.lin(x))

    g = capture(Odd(), (torch.randn(2, 8),))
    assert g.unknown_ops and any(op.kind is OpKind.OTHER for op in g.ops)
    assert math.isclose(g.num_params, 72)


def test_an_in_place_aten_op_is_priced_as_its_functional_op_and_a_router_top_k_as_a_reduction():
    """DeepSeek-V3's attention assigns q and k by slices (`copy_`) and Mixtral's router divides in place (`div_`):
    left unknown they were priced as opaque ops the planner replicates under tensor parallelism."""
    from autoshard.capture.aten_kinds import classify
    from autoshard.capture.ir import OpKind

    assert classify("copy_") is classify("div_") is classify("scatter_") is OpKind.ELEMENTWISE
    assert classify("sigmoid_") is OpKind.ELEMENTWISE and classify("mul_") is OpKind.ELEMENTWISE
    assert classify("topk") is OpKind.REDUCTION
    assert classify("transpose_") is None  # an in-place view is still a view
    assert classify("__and__") is OpKind.ELEMENTWISE and classify("no_such_op_") is OpKind.OTHER


def test_repeated_blocks_are_named_by_their_module_class_even_when_the_block_runs_no_op_of_its_own():
    """BertLayer hands everything to its submodules (no op's module is the layer itself): its group was named
    after its first leaf, "Linear"."""
    from autoshard.api import capture_ref

    assert [g.module_type for g in capture_ref("bert:layers=2,hidden=64,heads=2,seq=32,vocab=128").blocks] == \
        ["BertLayer"]
    assert [g.module_type for g in capture_ref("llama:layers=2,hidden=64,heads=4,seq=32,vocab=128").blocks] == \
        ["LlamaDecoderLayer"]
