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
