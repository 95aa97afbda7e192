"""Build a model from a zoo name, a spec string or a `module:factory`, on the meta device by default."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from autoshard.errors import ModelSpecError
from autoshard.models.names import is_zoo_or_spec, resolve_spec, spec_and_name  # noqa: F401 - re-exported
from autoshard.models.small import GQAGPT, MLP
from autoshard.models.spec import FAMILIES, ModelSpec, parse_spec, spec_string  # noqa: F401 - re-exported

__all__ = ["LoadedModel", "load_model", "build_module", "resolve_spec"]

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A built module with what capture needs to trace it."""

    name: str
    family: str
    module: nn.Module
    spec: ModelSpec | None = None
    inputs: tuple | None = None  # example inputs a factory returned (any batch)
    seq_override: int | None = None  # --seq for a factory model: the token inputs' length

    @property
    def seq(self) -> int | None:
        return self.spec.seq if self.spec is not None and self.spec.seq else None

    def example_inputs(self, batch: int = 1, *, device: str | torch.device = "meta") -> tuple:
        """Inputs of `batch` samples for tracing (token ids, pixels or features)."""
        if self.inputs is not None:
            return tuple(_with_seq(_rebatch(x, batch), self.seq_override, self.name) for x in self.inputs)
        spec = self.spec
        if spec is None:
            cfg = getattr(self.module, "config", None)
            vocab, seq = getattr(cfg, "vocab_size", None), self.seq_override or _config_seq(cfg)
            if vocab is None:
                raise ModelSpecError(f"{self.name}: cannot guess example inputs; make the factory return "
                                     "(model, example_inputs)")
            if seq is None:  # e.g. BLOOM (ALiBi): no position table, so no length in its config
                raise ModelSpecError(f"{self.name}: its config states no sequence length (no n_positions, "
                                     "max_position_embeddings or seq_length); pass seq=N (the tokens per sample) or make "
                                     "the factory return (model, example_inputs)", params=("seq",))
            ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
            if getattr(cfg, "is_encoder_decoder", False):  # T5, BART: (input_ids, attention_mask, decoder_input_ids)
                return (ids, None, ids.clone())
            return (ids,)
        if spec.family == "vit":
            return (torch.zeros(batch, 3, spec.image, spec.image, device=device),)
        if spec.family == "mlp":
            return (torch.zeros(batch, spec.hidden, device=device),)
        return (torch.zeros(batch, spec.seq, dtype=torch.long, device=device),)


def _with_seq(x, seq: int | None, name: str):
    """A token-id input (batch, length) of the factory's, at length `seq` (--seq)."""
    if seq is None or not isinstance(x, torch.Tensor):
        return x
    if x.dim() != 2 or x.dtype.is_floating_point:
        raise ModelSpecError(f"seq sets the length of token-id inputs, but {name}'s example input has shape "
                             f"{tuple(x.shape)} ({x.dtype}); drop seq or make the factory build inputs of "
                             "the length you want", params=("seq",))
    reps = -(-seq // x.shape[1])
    return x.repeat(1, reps)[:, :seq]


def _rebatch(x, batch: int):
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    reps = -(-batch // x.shape[0])
    return x.repeat(reps, *([1] * (x.dim() - 1)))[:batch]


def _config_seq(cfg) -> int | None:
    for attr in ("n_positions", "max_position_embeddings", "seq_length"):
        val = getattr(cfg, attr, None)
        if isinstance(val, int) and val > 0:
            return min(val, 2048)
    return None


def load_model(ref: str | nn.Module, *, seq: int | None = None, device: str | None = "meta",
               attn: str | None = None) -> LoadedModel:
    """Build `ref` (zoo name, spec string, `module:factory` or an nn.Module) on `device`; `attn` overrides the
    attention implementation of zoo and spec models (sdpa, eager, flash)."""
    if isinstance(ref, nn.Module):
        return LoadedModel(name=type(ref).__name__, family="custom", module=ref)
    if not isinstance(ref, str) or not ref.strip():
        raise ModelSpecError(f"model must be a zoo name, a spec string or module:factory, got {ref!r}")
    if not is_zoo_or_spec(ref):
        loaded = _load_factory(ref, device)
        if seq is not None:
            if seq <= 0:
                raise ModelSpecError(f"seq must be a positive integer, got {seq}", params=("seq",))
            loaded = replace(loaded, name=f"{loaded.name}@seq{seq}", seq_override=seq)
            loaded.example_inputs(2)  # a factory whose inputs are not token ids says so now
        return loaded
    spec, name = spec_and_name(ref, seq=seq, attn=attn)
    return LoadedModel(name=name, family=spec.family,
                       module=build_module(spec, device=device), spec=spec)


def _load_factory(ref: str, device: str | None) -> LoadedModel:
    mod_name, _, attr = ref.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # a factory in the working directory imports, as with uvicorn/gunicorn
    try:
        module = importlib.import_module(mod_name.strip())
    except Exception as exc:  # noqa: BLE001 - any import failure becomes one line
        raise ModelSpecError(f"cannot import {mod_name!r} for model factory {ref!r}: {type(exc).__name__}: "
                             f"{exc}; check the module path and that it is on PYTHONPATH") from exc
    factory = getattr(module, attr.strip(), None)
    if not callable(factory):
        raise ModelSpecError(f"{mod_name} has no callable {attr!r}; a factory is `package.module:function` "
                             "returning an nn.Module")
    try:
        with torch.device(device) if device else _null():
            made = factory()
    except Exception as exc:  # noqa: BLE001
        raise ModelSpecError(f"model factory {ref} raised {type(exc).__name__}: {exc}") from exc
    inputs = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        made, inputs = made
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    if not isinstance(made, nn.Module):
        raise ModelSpecError(f"model factory {ref} returned {type(made).__name__}, not an nn.Module; return the "
                             "model, or (model, example_inputs)")
    return LoadedModel(name=ref, family="custom", module=made, inputs=inputs)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def build_module(spec: ModelSpec, *, device: str | None = "meta", dtype: torch.dtype = torch.float32,
                 layers: int | None = None) -> nn.Module:
    """Instantiate `spec` (with `layers` blocks if given) on `device` without touching real memory on meta."""
    if layers is not None:
        spec = replace(spec, layers=layers)
    with torch.device(device) if device else _null():
        model = _BUILDERS[spec.family](spec)
    return model.to(dtype) if dtype is not torch.float32 else model


def _hf_attn(spec: ModelSpec) -> str:
    """Flash attention is traced through SDPA (same shapes); capture then marks the kernel causal-flash."""
    return "sdpa" if spec.attn == "flash" else spec.attn


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ModelSpecError("zoo models are Hugging Face transformers classes: pip install 'autoshard[hf]'") from exc
    transformers.logging.set_verbosity_error()
    return transformers


def _gpt(spec: ModelSpec) -> nn.Module:
    if spec.num_kv_heads != spec.heads:  # GPT-2 has no grouped-query attention in transformers
        return GQAGPT(layers=spec.layers, hidden=spec.hidden, heads=spec.heads, kv_heads=spec.num_kv_heads,
                      ffn=spec.ffn_size, vocab=spec.vocab or 51200, seq=spec.seq)
    tf = _transformers()
    # gelu_pytorch_tanh: GPT-2's tanh-approximated GELU as one kernel, as Megatron-LM's fused bias-GeLU and
    # llm-foundry run it (transformers' default gelu_new composes eight pointwise kernels for the same function)
    cfg = tf.GPT2Config(n_layer=spec.layers, n_embd=spec.hidden, n_head=spec.heads, vocab_size=spec.vocab or 51200,
                        n_positions=spec.seq, n_inner=spec.ffn or None, use_cache=False,
                        activation_function="gelu_pytorch_tanh",
                        bos_token_id=0, eos_token_id=0, attn_implementation=_hf_attn(spec))
    return tf.GPT2LMHeadModel(cfg)


def _llama(spec: ModelSpec) -> nn.Module:
    tf = _transformers()
    cfg = tf.LlamaConfig(num_hidden_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
                         num_key_value_heads=spec.num_kv_heads, intermediate_size=spec.ffn_size,
                         vocab_size=spec.vocab or 32000, max_position_embeddings=spec.seq,
                         rope_theta=spec.rope_theta, tie_word_embeddings=False, use_cache=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation=_hf_attn(spec))
    return tf.LlamaForCausalLM(cfg)


def _bert(spec: ModelSpec) -> nn.Module:
    tf = _transformers()
    cfg = tf.BertConfig(num_hidden_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
                        intermediate_size=spec.ffn_size, vocab_size=spec.vocab or 30522,
                        max_position_embeddings=spec.seq, attn_implementation=_hf_attn(spec))
    return tf.BertForMaskedLM(cfg)


def _vit(spec: ModelSpec) -> nn.Module:
    tf = _transformers()
    cfg = tf.ViTConfig(num_hidden_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
                       intermediate_size=spec.ffn_size, image_size=spec.image or 224, patch_size=spec.patch or 16,
                       num_labels=1000, attn_implementation=_hf_attn(spec))
    return tf.ViTForImageClassification(cfg)


def _mlp(spec: ModelSpec) -> nn.Module:
    return MLP(layers=spec.layers, hidden=spec.hidden, ffn=spec.ffn_size)


def _mixtral(spec: ModelSpec) -> nn.Module:
    tf = _transformers()
    cfg = tf.MixtralConfig(num_hidden_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
                           num_key_value_heads=spec.num_kv_heads, intermediate_size=spec.ffn_size,
                           vocab_size=spec.vocab or 32000, max_position_embeddings=spec.seq,
                           rope_theta=spec.rope_theta, num_local_experts=spec.num_experts,
                           num_experts_per_tok=spec.num_experts_per_token, sliding_window=None,
                           tie_word_embeddings=False, use_cache=False, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0, attn_implementation=_hf_attn(spec))
    return tf.MixtralForCausalLM(cfg)


_BUILDERS = {"gpt": _gpt, "llama": _llama, "mixtral": _mixtral, "bert": _bert, "vit": _vit, "mlp": _mlp}
