"""Named model configurations, each with the source of its dimensions."""

from __future__ import annotations

from autoshard.models.spec import ModelSpec

__all__ = ["ZOO", "SOURCES"]


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048) -> ModelSpec:
    return ModelSpec(name=name, family="gpt", layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int,
           rope_theta: float) -> ModelSpec:
    return ModelSpec(name=name, family="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     ffn=ffn, vocab=vocab, seq=seq, rope_theta=rope_theta)


_ENTRIES = [
    # GPT-2 (Radford et al. 2019; Hugging Face configs): vocab 50257, context 1024.
    (_gpt("gpt2", 12, 768, 12, vocab=50257, seq=1024), "GPT-2 small, HF gpt2 config"),
    (_gpt("gpt2-medium", 24, 1024, 16, vocab=50257, seq=1024), "HF gpt2-medium config"),
    (_gpt("gpt2-large", 36, 1280, 20, vocab=50257, seq=1024), "HF gpt2-large config"),
    (_gpt("gpt2-xl", 48, 1600, 25, vocab=50257, seq=1024), "HF gpt2-xl config"),
    # Narayanan et al. 2021 Table 1 (vocab 51200, seq 2048).
    (_gpt("gpt-1.7b", 24, 2304, 24), "Narayanan et al. 2021 Table 1"),
    (_gpt("gpt-3.6b", 30, 3072, 32), "Narayanan et al. 2021 Table 1"),
    (_gpt("gpt-7.5b", 36, 4096, 32), "Narayanan et al. 2021 Table 1"),
    (_gpt("gpt-18.4b", 40, 6144, 48), "Narayanan et al. 2021 Table 1"),
    (_gpt("gpt-39.1b", 48, 8192, 64), "Narayanan et al. 2021 Table 1"),
    (_gpt("gpt-76.1b", 60, 10240, 80), "Narayanan et al. 2021 Table 1"),
    (_gpt("gpt-145.6b", 80, 12288, 96), "Narayanan et al. 2021 Table 1"),
    (_gpt("gpt-310.1b", 96, 16384, 128), "Narayanan et al. 2021 Table 1"),
    (_gpt("gpt-529.6b", 105, 20480, 128), "Narayanan et al. 2021 Table 1"),
    (_gpt("gpt-1t", 128, 25600, 160), "Narayanan et al. 2021 Table 1 (1008.0 B)"),
    (_gpt("gpt3-175b", 96, 12288, 96), "Brown et al. 2020 Table 2.1; vocab padded to 51200 as in Megatron-LM"),
    # Llama 2 (Touvron et al. 2023, Table 1 / HF configs) and Llama 3 (Dubey et al. 2024, Table 3).
    (_llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, 1e4), "Llama 2 paper; HF Llama-2-7b config"),
    (_llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, 1e4), "Llama 2 paper; HF Llama-2-13b config"),
    (_llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, 1e4), "Llama 2 paper; HF Llama-2-70b config"),
    (_llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, 5e5), "Llama 3 herd paper Table 3"),
    (_llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, 5e5), "Llama 3 herd paper Table 3"),
    (_llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, 5e5), "Llama 3 herd paper Table 3"),
    # Mixtral 8x7B (Jiang et al. 2024, Table 1): 8 experts per layer, 2 per token; context 32768, rope 1e6
    (ModelSpec(name="mixtral-8x7b", family="mixtral", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336,
               vocab=32000, seq=32768, rope_theta=1e6, experts=8, top_k=2), "Jiang et al. 2024 Table 1"),
    (ModelSpec(name="bert-large", family="bert", layers=24, hidden=1024, heads=16, ffn=4096, vocab=30522,
               seq=512), "Devlin et al. 2019 (BERT-Large); HF bert-large-uncased config"),
    (ModelSpec(name="vit-huge", family="vit", layers=32, hidden=1280, heads=16, ffn=5120, image=224, patch=14),
     "Dosovitskiy et al. 2021 Table 1 (ViT-H/14)"),
    (ModelSpec(name="mlp", family="mlp", layers=8, hidden=4096, ffn=16384),
     "a plain residual MLP: Linear-GELU-Linear blocks"),
]

ZOO: dict[str, ModelSpec] = {spec.name: spec for spec, _ in _ENTRIES}
SOURCES: dict[str, str] = {spec.name: src for spec, src in _ENTRIES}
