"""The activations the capture says a layer keeps for backward are the bytes autograd keeps, measured.

A real forward pass on CPU (float32, random weights) under torch.autograd.graph.saved_tensors_hooks records every
tensor autograd saves; each storage counts once (q/k/v projections share their input; the attention output and
the output projection's input are one tensor), parameters excluded. The difference between a 3- and a 2-layer
model is one layer, the quantity the memory model multiplies by layers and in-flight micro-batches.
"""

import pytest
import torch

from autoshard.api import capture_ref
from autoshard.capture.ir import OpKind
from autoshard.models import load_model

LLAMA = "llama:layers={L},hidden=256,heads=8,kv_heads=2,ffn=688,seq=128,vocab=1000"
GPT = "gpt:layers={L},hidden=256,heads=8,seq=128,vocab=1000"


def _without_dropout(model) -> None:
    """Without dropout CPU SDPA runs its flash kernel, the one the capture prices."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    for k in ("attn_pdrop", "resid_pdrop", "embd_pdrop", "attention_dropout"):
        if hasattr(model.config, k):
            setattr(model.config, k, 0.0)


def _saved_storage_bytes(model, inputs) -> int:
    """Bytes of the storages autograd saves in one forward of `model`, each once, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    return sum(storages.values())


def _measured_bytes(ref: str) -> int:
    loaded = load_model(ref, device="cpu", attn="sdpa")
    model = loaded.module.train()
    _without_dropout(model)
    return _saved_storage_bytes(model, loaded.example_inputs(1, device="cpu"))


def _predicted_bytes(ref: str) -> float:
    """float32 bytes of what the capture says is saved per sample (dropout masks left out, as measured)."""
    graph = capture_ref(ref)
    return sum(4 * t.numel for op in graph.ops for t in op.saved if t.dtype.startswith(("float", "bfloat")))


@pytest.mark.parametrize("spec", [LLAMA, GPT], ids=["llama-gqa-rmsnorm", "gpt-layernorm"])
def test_one_layer_keeps_for_backward_what_autograd_saves_on_this_machine(spec):
    measured = _measured_bytes(spec.format(L=3)) - _measured_bytes(spec.format(L=2))
    predicted = _predicted_bytes(spec.format(L=3)) - _predicted_bytes(spec.format(L=2))
    assert predicted == pytest.approx(measured, rel=0.02)


def test_grouped_query_attention_keeps_kv_heads_not_repeated_copies_and_shared_inputs_once():
    graph = capture_ref(LLAMA.format(L=2))
    ops = {op.name: op for op in graph.ops if op.layer == 0}
    attn = next(op for name, op in ops.items() if name.endswith("scaled_dot_product_attention"))
    q, k, v = (t.numel for t in attn.saved[:3])
    assert k == v == q * 2 // 8  # 2 of 8 heads
    assert len(ops["model.layers.0.self_attn.q_proj"].saved) == 1
    assert not ops["model.layers.0.self_attn.k_proj"].saved and not ops["model.layers.0.self_attn.v_proj"].saved
    assert not ops["model.layers.0.self_attn.o_proj"].saved  # the attention output, kept by the kernel


def test_a_pointwise_rmsnorm_keeps_its_float32_upcast_in_eager_and_only_its_input_when_fused():
    from autoshard.cost_models.memory import BF16_MIXED as bf16
    from autoshard.cost_models.memory import tensor_bytes

    graph = capture_ref(LLAMA.format(L=4))  # traced with 2 blocks in bf16, then expanded
    norm = next(op for op in graph.ops if op.name == "model.layers.0.input_layernorm")
    eager = sum(tensor_bytes(t, bf16) for t in norm.saved)
    fused = sum(tensor_bytes(t, bf16) for t in norm.saved_fused)
    tokens_x_hidden = 128 * 256
    assert eager == 6 * tokens_x_hidden + 4 * 128  # float32 upcast (4) + the normalized bf16 value (2) + 1/rms
    assert fused == 2 * tokens_x_hidden


def _measured_compiled_bytes(ref: str) -> int:
    """bf16 bytes autograd keeps with every decoder layer compiled: AOTAutograd's partition as Inductor gets
    it (backend aot_eager_decomp_partition: the same decompositions and min-cut partitioner, no code generation)."""
    loaded = load_model(ref, device="cpu", attn="sdpa")
    model = loaded.module.train().to(torch.bfloat16)
    blocks = model.model.layers if hasattr(model, "model") else model.transformer.h
    _without_dropout(model)  # as measured eager above
    for block in blocks:
        block.compile(backend="aot_eager_decomp_partition")
    x = loaded.example_inputs(1, device="cpu")
    model(*x)  # compiles
    return _saved_storage_bytes(model, x)


def _priced_compiled_bytes(ref: str) -> float:
    from autoshard.api import resolve_cluster
    from autoshard.planner.estimate import HandConfig, estimate

    graph = capture_ref(ref)
    cfg = HandConfig(tp=1, pp=1, dp=1, cp=1, cp_attention="allgather", micro_batch=1, global_batch=1,
                     recompute="none", sequence_parallel=False, virtual_stages=1, schedule=None, zero=0,
                     fused_kernels=False, fused_loss=False, zero_impl="fsdp2", tp_comm_overlap="",
                     allocator="expandable", precision=None, ep=1, ep_imbalance=None, compile=True, float8="")
    _, ev = estimate(graph, resolve_cluster("1x1xH100-80GB"), cfg)
    # dropout masks left out, as measured (dropout off)
    return sum(ev.op_costs[op.name].saved_bytes for op in graph.ops
               if op.layer is not None and op.kind is not OpKind.DROPOUT)


@pytest.mark.parametrize("spec", [LLAMA, GPT], ids=["llama-swiglu", "gpt-gelu"])
def test_a_compiled_layer_keeps_what_the_min_cut_partitioner_saves(spec):
    """Llama: the fused SwiGLU region keeps gate and up, not silu(gate), the norms their bf16 input, not the
    float32 upcast (29 bytes per token and hidden unit where eager keeps 43); GPT-2: q, k, v as one c_attn
    output, its GELU's input and output (cost_models/opcost.py `_saved_bytes`)."""
    measured = _measured_compiled_bytes(spec.format(L=3)) - _measured_compiled_bytes(spec.format(L=2))
    priced = _priced_compiled_bytes(spec.format(L=3)) - _priced_compiled_bytes(spec.format(L=2))
    assert priced == pytest.approx(measured, rel=0.02)


def test_megatrons_fused_swiglu_keeps_gate_and_up_not_their_silu():
    """Megatron-LM's fused SwiGLU (megatron/core/fusions/fused_bias_swiglu.py `SwiGLUFunction`) saves its input,
    gate and up, and recomputes silu(gate) in backward: under `--fused-kernels` the MLP's pointwise ops keep two
    intermediate-sized tensors per token, where eager PyTorch keeps three (gate, silu(gate), up)."""
    from autoshard.api import resolve_cluster
    from autoshard.planner.estimate import HandConfig, estimate

    graph = capture_ref(LLAMA.format(L=2))
    pointwise = [op.name for op in graph.ops if op.layer == 0 and ".mlp." in op.name
                 and op.kind is OpKind.ELEMENTWISE]
    intermediate = 128 * 688 * 2  # tokens x ffn, bf16

    def kept(fused: bool) -> float:
        cfg = HandConfig(micro_batch=1, global_batch=1, recompute="none", fused_kernels=fused)
        _, ev = estimate(graph, resolve_cluster("1x1xH100-80GB"), cfg)
        return sum(ev.op_costs[name].saved_bytes for name in pointwise)

    assert kept(fused=True) == 2 * intermediate
    assert kept(fused=False) == 3 * intermediate
