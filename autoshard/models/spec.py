"""ModelSpec: a model described by its dimensions, parsed from a zoo name or a spec string.

Spec strings: `gpt:layers=96,hidden=12288,heads=96,seq=2048[,vocab=51200][,ffn=49152][,kv_heads=96][,attn=sdpa]`
and the same keys for `llama:`; `mixtral:` the llama keys and `experts=`, `top_k=` (a mixture-of-experts MLP:
`experts` per layer, each token routed to `top_k`); `bert:`, `vit:` and `mlp:` take their own (see `_KEYS`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from autoshard.errors import ModelSpecError

__all__ = ["ModelSpec", "parse_spec", "spec_string", "FAMILIES"]

FAMILIES = ("gpt", "llama", "mixtral", "bert", "vit", "mlp")
# sdpa: Hugging Face's default (SDPA with an explicit mask: PyTorch's memory-efficient kernel on GPU);
# eager: materialized scores and a softmax kernel (Megatron-LM's fused softmax, HF "eager");
# flash: causal FlashAttention-2 (Megatron's --use-flash-attn, llm-foundry, torchtitan).
ATTENTION_IMPLS = ("sdpa", "eager", "flash")

_REQUIRED = {
    "gpt": ("layers", "hidden", "heads", "seq"),
    "llama": ("layers", "hidden", "heads", "seq"),
    "mixtral": ("layers", "hidden", "heads", "seq"),
    "bert": ("layers", "hidden", "heads", "seq"),
    "vit": ("layers", "hidden", "heads"),
    "mlp": ("layers", "hidden"),
}
_OPTIONAL = {
    "gpt": ("vocab", "ffn", "kv_heads", "attn"),
    "llama": ("vocab", "ffn", "kv_heads", "attn", "rope_theta"),
    "mixtral": ("vocab", "ffn", "kv_heads", "attn", "rope_theta", "experts", "top_k"),
    "bert": ("vocab", "ffn", "attn"),
    "vit": ("ffn", "image", "patch", "attn"),
    "mlp": ("ffn",),
}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Dimensions of a transformer-like model. 0 means 'the family default'."""

    name: str
    family: str
    layers: int
    hidden: int
    heads: int = 0
    kv_heads: int = 0
    ffn: int = 0
    vocab: int = 0
    seq: int = 0
    image: int = 0
    patch: int = 0
    rope_theta: float = 10000.0
    attn: str = "sdpa"
    experts: int = 0  # mixture of experts (mixtral): experts per layer, 0 = the family default (8)
    top_k: int = 0  # experts each token is routed to, 0 = the family default (2)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ModelSpecError(f"unknown model family {self.family!r}; known: {', '.join(FAMILIES)}")
        for f in ("layers", "hidden"):
            if getattr(self, f) <= 0:
                raise ModelSpecError(f"{self.name}: {f} must be a positive integer, got {getattr(self, f)}")
        for f in ("heads", "kv_heads", "ffn", "vocab", "seq", "image", "patch", "experts", "top_k"):
            if getattr(self, f) < 0:
                raise ModelSpecError(f"{self.name}: {f} must not be negative, got {getattr(self, f)}")
        if self.family != "mlp":
            if self.heads <= 0:
                raise ModelSpecError(f"{self.name}: heads must be a positive integer")
            if self.hidden % self.heads:
                raise ModelSpecError(f"{self.name}: hidden={self.hidden} is not divisible by heads={self.heads}; "
                                     "pick heads that divide the hidden size")
            if self.kv_heads and self.heads % self.kv_heads:
                raise ModelSpecError(f"{self.name}: heads={self.heads} is not a multiple of "
                                     f"kv_heads={self.kv_heads}; grouped-query attention needs kv_heads | heads")
        if self.family == "mixtral" and self.num_experts_per_token > self.num_experts:
            raise ModelSpecError(f"{self.name}: top_k={self.num_experts_per_token} exceeds experts={self.num_experts}; "
                                 "route each token to at most as many experts as a layer has")
        if self.attn not in ATTENTION_IMPLS:
            raise ModelSpecError(f"{self.name}: attn={self.attn!r}; allowed: {', '.join(ATTENTION_IMPLS)}")

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def num_experts(self) -> int:
        return self.experts or 8

    @property
    def num_experts_per_token(self) -> int:
        return self.top_k or 2

    @property
    def ffn_size(self) -> int:
        if self.ffn:
            return self.ffn
        if self.family == "llama":  # Llama: 2/3 of 4h rounded up to a multiple of 256 (Touvron et al. 2023)
            return 256 * ((int(8 * self.hidden / 3) + 255) // 256)
        return 4 * self.hidden


def _int(key: str, text: str, spec: str) -> int | float:
    try:
        return float(text) if key == "rope_theta" else int(text)
    except ValueError:
        raise ModelSpecError(f"model spec {spec!r}: {key}={text!r} is not an integer") from None


def parse_spec(spec: str) -> ModelSpec:
    """Parse `family:key=value,...` into a ModelSpec, with an error naming the bad part."""
    family, _, body = spec.partition(":")
    family = family.strip().lower()
    if family not in _REQUIRED:
        raise ModelSpecError(f"model spec {spec!r}: unknown family {family!r}; use one of "
                             f"{', '.join(f + ':' for f in FAMILIES)} e.g. gpt:layers=24,hidden=2048,heads=16,seq=2048")
    values: dict[str, object] = {}
    allowed = _REQUIRED[family] + _OPTIONAL[family]
    for part in filter(None, (p.strip() for p in body.split(","))):
        key, eq, val = part.partition("=")
        key = key.strip().lower()
        if not eq:
            raise ModelSpecError(f"model spec {spec!r}: {part!r} is not key=value")
        if key not in allowed:
            raise ModelSpecError(f"model spec {spec!r}: unknown key {key!r} for {family}; allowed: {', '.join(allowed)}")
        values[key] = val.strip() if key == "attn" else _int(key, val.strip(), spec)
    missing = [k for k in _REQUIRED[family] if k not in values]
    if missing:
        raise ModelSpecError(f"model spec {spec!r}: missing {', '.join(missing)} (required for {family}: "
                             f"{', '.join(_REQUIRED[family])})")
    known = {f.name for f in fields(ModelSpec)}
    return ModelSpec(name=spec, family=family, **{k: v for k, v in values.items() if k in known})


def spec_string(spec: ModelSpec) -> str:
    """The spec string `parse_spec` turns back into `spec` (its dimensions, whatever its name)."""
    defaults = ModelSpec(name="", family=spec.family, layers=1, hidden=spec.hidden, heads=spec.heads)
    parts = []
    for key in _REQUIRED[spec.family] + _OPTIONAL[spec.family]:
        value = getattr(spec, key)
        if key in _REQUIRED[spec.family] or value != getattr(defaults, key):
            parts.append(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}")
    return f"{spec.family}:" + ",".join(parts)
