"""Tiny models for the distributed tests: Hugging Face classes at toy sizes, dropout off, fp32.

Every factory is deterministic given `torch.manual_seed`, so each rank builds the same weights and keeps an
untouched copy as the single-process reference.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MODELS", "build", "example_batch"]

VOCAB, SEQ, HIDDEN, HEADS = 128, 16, 64, 4


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                      intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=False,
                      use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def tiny_qwen2() -> nn.Module:
    """Not in the zoo: Qwen2 (RMSNorm, rotary, biased q/k/v projections, grouped-query attention)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(num_hidden_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=False,
                      use_cache=False, use_sliding_window=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return Qwen2ForCausalLM(cfg)


def tiny_mlp() -> nn.Module:
    from autoshard.models.small import MLP

    return MLP(layers=2, hidden=16, ffn=32)


def tiny_mixtral() -> nn.Module:
    """Mixture of experts: 4 experts per layer, top-2 routing (transformers' experts interface)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(num_hidden_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=SEQ, num_local_experts=4,
                        num_experts_per_tok=2, tie_word_embeddings=False, use_cache=False, bos_token_id=0,
                        eos_token_id=0, pad_token_id=0)
    return MixtralForCausalLM(cfg)


MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama, "qwen2": tiny_qwen2, "mlp": tiny_mlp, "mixtral": tiny_mixtral}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]().train()


def example_batch(name: str, batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of a global batch: token ids and next tokens, or features and regression targets."""
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return torch.randn(batch, 16, generator=g), torch.randn(batch, 16, generator=g)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    return ids, torch.randint(0, VOCAB, (batch, SEQ), generator=g)


def tiny_neox() -> nn.Module:
    """Not in the zoo: GPT-NeoX (fused QKV laid out per head, partial rotary, parallel residual)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(num_hidden_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=128,
                        vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False, hidden_dropout=0.0,
                        attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    return GPTNeoXForCausalLM(cfg)


MODELS["neox"] = tiny_neox


def tiny_gpt_heads_then_minus_one() -> nn.Module:
    """Not a library model: nanoGPT-style GPT (autoshard.models.small) whose attention reshapes q, k, v with
    an explicit head count and -1 for the head dim, `view(B, T, heads, -1)`. On a tensor-parallel shard that
    runs without error but halves the head dim instead of the heads: the model's code is not shard-local, so
    the runtime must notice and run it on DTensors."""
    import torch.nn.functional as F

    from autoshard.models.small import GQAGPT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))

    model = GQAGPT(layers=2, hidden=HIDDEN, heads=HEADS, kv_heads=HEADS, ffn=128, vocab=VOCAB, seq=SEQ)
    for block in model.h:
        block.attn.forward = forward.__get__(block.attn)
    return model


MODELS["gpt-heads-minus-one"] = tiny_gpt_heads_then_minus_one
