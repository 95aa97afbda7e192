"""Model factories used by tests through the `module:factory` model reference."""

import torch
from torch import nn


def tiny_mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)), (torch.zeros(4, 32),)


def tiny_hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                      use_cache=False, bos_token_id=0, eos_token_id=0))


def raises():
    raise RuntimeError("checkpoint not found")


def not_a_module():
    return 42


# Hugging Face decoders as a user writes them: default configs (use_cache=True), no arguments for autoshard
def _small(cfg_cls, **kw):
    return cfg_cls(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                   intermediate_size=64, vocab_size=128, max_position_embeddings=64, **kw)


def default_mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(_small(MistralConfig))


def default_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(_small(Qwen2Config))


def default_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(_small(MixtralConfig, num_local_experts=4, num_experts_per_tok=2))


def default_bloom():
    """BLOOM (ALiBi): its config has no position table, so it states no sequence length."""
    from transformers import BloomConfig, BloomForCausalLM

    return BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4))


def default_opt():
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(OPTConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, ffn_dim=64,
                                    vocab_size=128, max_position_embeddings=64, word_embed_proj_dim=32))


def mixtral_8x7b():
    """Mixtral-8x7B's published config (Jiang et al. 2024, Table 1), default settings otherwise."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                            num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                            num_local_experts=8, num_experts_per_tok=2,
                                            max_position_embeddings=4096))


def default_rwkv():
    """RWKV: its first block has an extra LayerNorm, so its block list is not all identical blocks."""
    from transformers import RwkvConfig, RwkvForCausalLM

    return RwkvForCausalLM(RwkvConfig(hidden_size=32, num_hidden_layers=3, vocab_size=128, attention_hidden_size=32,
                                      intermediate_size=64, context_length=64))


def bloom_12_heads():
    """BLOOM's attention: baddbmm / bmm over (batch x heads, S, head_dim), ALiBi, no 4-D q, k, v."""
    from transformers import BloomConfig, BloomForCausalLM

    return BloomForCausalLM(BloomConfig(hidden_size=96, n_head=12, n_layer=2, vocab_size=128)), \
        (torch.zeros(1, 32, dtype=torch.long),)


def default_t5():
    """An encoder-decoder as a user writes it: the model alone, its inputs left to autoshard."""
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                               vocab_size=128))


def mqa_mistral():
    """Multi-query attention: one key/value head beside 4 query heads (Gemma 2B, Falcon-7B, PaLM)."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=2,
                        intermediate_size=64, vocab_size=128, max_position_embeddings=64)
    return MistralForCausalLM(cfg)
