"""Models that transformers does not provide: a GPT with grouped-query attention and a plain MLP.

Both are ordinary nn.Modules written the way users write them (nanoGPT style), so the runtime is exercised on
models that reshape with explicit head counts as well as on Hugging Face ones that reshape with -1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GQAGPT", "MLP"]


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = _Attention(hidden, heads, kv_heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, ffn)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(self.act(self.fc(self.ln_2(x))))


class GQAGPT(nn.Module):
    """GPT-2 architecture (learned positions, LayerNorm, GELU MLP, tied head) with grouped-query attention."""

    def __init__(self, *, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                 seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.h = nn.ModuleList(_Block(hidden, heads, kv_heads, ffn) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


class _MLPBlock(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class MLP(nn.Module):
    """Residual MLP blocks on (B, hidden) inputs, then a linear head back to `hidden` outputs."""

    def __init__(self, *, layers: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_MLPBlock(hidden, ffn) for _ in range(layers))
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)
