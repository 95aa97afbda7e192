"""Architectures from `transformers`, built from tiny configs with their default settings (and a plain CNN of
our own), for the conformance matrix (test_model_zoo.py). Sizes are the smallest that keep each family's
structure: 2 blocks, 4 query heads (2 key/value heads where the family groups them), hidden 32."""

from __future__ import annotations

import torch
from adamw_bound import ATOL, AdamWBound
from torch import nn

__all__ = ["ARCHS", "DECODERS", "build", "example", "batch", "loss_fn"]

VOCAB, SEQ, CLASSES = 128, 8, 10
_C = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64, vocab_size=VOCAB,
          max_position_embeddings=64)


class SmallCNN(nn.Module):
    """A plain CNN: two convolutions, pooling, a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _hf(name: str):
    import transformers as T

    builders = {
        "opt": lambda: T.OPTForCausalLM(T.OPTConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                                    ffn_dim=64, vocab_size=VOCAB, max_position_embeddings=64,
                                                    word_embed_proj_dim=32)),
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**_C, num_key_value_heads=2, head_dim=8)),
        "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**_C, num_key_value_heads=2, head_dim=8)),
        "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**_C, num_key_value_heads=2, head_dim=8)),
        "phi": lambda: T.PhiForCausalLM(T.PhiConfig(**_C)),
        "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**_C, num_key_value_heads=4, pad_token_id=0,
                                                       eos_token_id=1, bos_token_id=1)),
        "falcon": lambda: T.FalconForCausalLM(T.FalconConfig(hidden_size=32, num_attention_heads=4,
                                                             num_hidden_layers=2, vocab_size=VOCAB)),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**_C, num_key_value_heads=2)),
        "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(**_C, num_key_value_heads=2, num_local_experts=4,
                                                                num_experts_per_tok=2)),
        "qwen2moe": lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**_C, num_key_value_heads=2, num_experts=4,
                                                                   num_experts_per_tok=2, moe_intermediate_size=32,
                                                                   shared_expert_intermediate_size=64)),
        "bart": lambda: T.BartForConditionalGeneration(T.BartConfig(
            d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB, max_position_embeddings=64)),
        "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                              num_heads=4, vocab_size=VOCAB)),
        "vit": lambda: T.ViTForImageClassification(T.ViTConfig(hidden_size=32, num_hidden_layers=2,
                                                               num_attention_heads=4, intermediate_size=64,
                                                               image_size=32, patch_size=8, num_labels=CLASSES)),
        # added after a probe of architectures the matrix did not list (all passed its cases; recompute under
        # tensor parallelism and pipelines did not, before runtime/recompute.py ran recomputation in the
        # forward's mode)
        "gptneox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**_C)),
        "bloom": lambda: T.BloomForCausalLM(T.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB)),
        "gptj": lambda: T.GPTJForCausalLM(T.GPTJConfig(n_embd=32, n_head=4, n_layer=2, n_inner=64,
                                                       n_positions=64, vocab_size=VOCAB, rotary_dim=4)),
        "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**_C, num_key_value_heads=2, head_dim=8)),
        "olmo2": lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**_C, num_key_value_heads=2)),
        "starcoder2": lambda: T.Starcoder2ForCausalLM(T.Starcoder2Config(**_C, num_key_value_heads=2)),
        "deepseekv3": lambda: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            **_C, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16,
            q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)),
        # architectures of kinds the matrix did not have (state-space and recurrent blocks, short convolutions,
        # hybrid attention / SSM / MoE stacks, ALiBi, multi-query with a fused q/k/v, attention sinks), added
        # after a sweep of transformers' causal-LM classes captured and planned all of them
        "mamba": lambda: T.MambaForCausalLM(T.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB,
                                                          state_size=8, expand=2, conv_kernel=4)),
        "falconmamba": lambda: T.FalconMambaForCausalLM(T.FalconMambaConfig(
            hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB, state_size=8, expand=2, conv_kernel=4)),
        # RWKV's first block has an extra LayerNorm: three blocks so the other two repeat. Its recurrent state is
        # updated in place when use_cache is on (the default in eval mode), which autograd refuses even in one
        # process: off, as a user training it in eval mode must set it
        "rwkv": lambda: T.RwkvForCausalLM(T.RwkvConfig(hidden_size=32, num_hidden_layers=3, vocab_size=VOCAB,
                                                       attention_hidden_size=32, intermediate_size=64,
                                                       context_length=64, use_cache=False)),
        "gptbigcode": lambda: T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(n_embd=32, n_head=4, n_layer=2, n_inner=64,
                                                                         n_positions=64, vocab_size=VOCAB,
                                                                         multi_query=True)),
        "persimmon": lambda: T.PersimmonForCausalLM(T.PersimmonConfig(**_C)),
        "mpt": lambda: T.MptForCausalLM(T.MptConfig(d_model=32, n_heads=4, n_layers=2, expansion_ratio=2,
                                                    vocab_size=VOCAB, max_seq_len=64)),
        "jamba": lambda: T.JambaForCausalLM(T.JambaConfig(
            **_C, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
            expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
            mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False)),
        "lfm2": lambda: T.Lfm2ForCausalLM(T.Lfm2Config(**_C, num_key_value_heads=2,
                                                       layer_types=["conv", "full_attention"])),
        "gptoss": lambda: T.GptOssForCausalLM(T.GptOssConfig(**_C, num_key_value_heads=2, head_dim=8,
                                                             num_local_experts=4, num_experts_per_tok=2)),
        "recurrentgemma": lambda: T.RecurrentGemmaForCausalLM(T.RecurrentGemmaConfig(
            hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64, vocab_size=VOCAB,
            lru_width=32, attention_window_size=16, conv1d_width=4, block_types=["recurrent", "attention"],
            head_dim=8, num_key_value_heads=1)),
        "qwen3next": lambda: T.Qwen3NextForCausalLM(T.Qwen3NextConfig(
            **_C, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])),
        "resnet": lambda: T.ResNetForImageClassification(T.ResNetConfig(
            num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
            num_labels=CLASSES)),
    }
    return builders[name]()


DECODERS = ("opt", "mistral", "gemma", "gemma2", "phi", "phi3", "falcon", "qwen2", "mixtral", "qwen2moe",
            "gptneox", "bloom", "gptj", "qwen3", "olmo2", "starcoder2", "deepseekv3", "mamba", "falconmamba", "rwkv",
            "gptbigcode", "persimmon", "mpt", "jamba", "lfm2", "gptoss", "recurrentgemma", "qwen3next")
ARCHS = (*DECODERS[:10], "bart", "t5", "vit", "cnn", *DECODERS[10:], "resnet")
_IMAGES = ("vit", "cnn", "resnet")


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = SmallCNN() if name == "cnn" else _hf(name)
    return model.eval()  # dropout off: the comparison is of the arithmetic, not of random masks


def batch(name: str, size: int, seed: int = 1) -> tuple[tuple, torch.Tensor]:
    """(model inputs, target) of a global batch: token ids and next tokens, or images and labels. T5 takes
    its decoder's ids positionally, as its forward orders them (input_ids, attention_mask, decoder_input_ids)."""
    g = torch.Generator().manual_seed(seed)
    if name in _IMAGES:
        return (torch.randn(size, 3, 32, 32, generator=g),), torch.randint(0, CLASSES, (size,), generator=g)
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    target = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    if name == "t5":
        return (ids, None, torch.randint(0, VOCAB, (size, SEQ), generator=g)), target
    return (ids,), target


def example(name: str) -> tuple | dict:
    """Example inputs for capture and `autoparallel`; T5's as users pass them, by keyword."""
    inputs = batch(name, 2)[0]
    if name == "t5":
        return {"input_ids": inputs[0], "decoder_input_ids": inputs[2]}
    return inputs


def loss_fn(out, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _grad_errors(ref: nn.Module, pm: nn.Module) -> tuple[float, str]:
    from dist_checks import full_named

    names = [n for n, _ in ref.named_parameters()]
    local = {n for n, _ in pm.named_parameters(remove_duplicate=False)}
    names = [n for n in names if n in local]  # a pipelined model holds this rank's stages only
    got = full_named(pm, names, grads=True)
    worst, where = 0.0, ""
    for n in names:
        g, w = got[n], ref.get_parameter(n).grad
        # atol 1e-5 up to gradients of 1, relative beyond: RWKV's tiny initial embeddings feed a LayerNorm and get
        # gradients of ~100, which any other order of an fp32 sum changes by ~7e-5 (7e-7 relative)
        d = float("inf") if g is None or w is None or g.shape != w.shape else \
            (g - w).abs().max().item() / max(1.0, w.abs().max().item())
        if d > worst:
            worst, where = d, n
    return worst, where


def run_case(case: dict) -> dict:
    """One matrix case on this rank: the parallel model (the parent's plan through `autoparallel`) against a
    single-process copy, on one global batch: the loss and every gradient of the first step, and every
    parameter after three AdamW steps."""
    import copy

    from autoshard import autoparallel

    name = case["arch"]
    model = build(name)
    ref = copy.deepcopy(model)
    inputs, target = batch(name, case["batch"])
    ref_loss = loss_fn(ref(*inputs), target)
    ref_loss.backward()
    world = torch.distributed.get_world_size()
    # plan=None: rank 0 captures and plans, broadcasts the plan, every rank applies it (the README's usage)
    pm = autoparallel(model, f"1x{world}xcpu", example_inputs=example(name), global_batch=case["batch"],
                      plan=case["plan"], graph=case["graph"] if case["plan"] is not None else None,
                      loss_fn=loss_fn)
    *local, local_target = pm.shard_inputs((*inputs, target))
    loss = pm.train_step(tuple(local), local_target)
    grad_diff, worst = _grad_errors(ref, pm)
    # then three AdamW steps on both (eps 1e-6 as in dist_checks: a near-zero gradient's rounding stays small)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    bound = AdamWBound(opt_ref, dict(ref.named_parameters()), atol=ATOL)
    for step in range(3):
        if step:
            loss_fn(ref(*inputs), target).backward()
            pm.train_step(tuple(local), local_target)
        opt_ref.step()
        bound.after_step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    param_diff, param_worst, excess, excess_at = _param_errors(ref, pm, bound)
    return {"id": case["id"], "loss_diff": abs(loss.item() - ref_loss.item()), "grad_diff": grad_diff,
            "grad_worst": worst, "param_diff": param_diff, "param_worst": param_worst, "param_excess": excess,
            "param_excess_at": excess_at, "mesh": str(pm.plan.mesh)}


def _param_errors(ref: nn.Module, pm: nn.Module, bound: AdamWBound) -> tuple[float, str, float, str]:
    """(largest |parameter difference|, where; largest excess over the AdamW bound, where)."""
    from dist_checks import full_named

    local = {n for n, _ in pm.named_parameters(remove_duplicate=False)}
    names = [n for n, _ in ref.named_parameters() if n in local]
    got = {n: t.detach() for n, t in full_named(pm, names, grads=False).items()}
    want = {n: ref.get_parameter(n).detach() for n in names}
    worst, where = 0.0, ""
    for n in names:
        d = (got[n] - want[n]).abs().max().item()
        if d > worst:
            worst, where = d, n
    return worst, where, *bound.excess(got, want)


def matrix_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [run_case(c) for c in cases]
