"""Pipeline chunks: a model cut at block boundaries into modules that keep the original parameter names.

Chunk c of a plan's `PipelineSpec` holds blocks `stage_layers[c]` of the model's one list of repeated blocks;
chunk 0 also holds what comes before the blocks (embeddings), the last chunk what comes after them (final
norm, head), exactly as the planner assigns ops (`planner.template.stage_of`). A `PipelineChunk` registers the
model's *own* submodules under their original paths (`transformer.h.2` stays `transformer.h.2`), so the
runtime's per-module machinery, plan lookups and parameter FQNs work on a chunk as on the whole model.

Why per-family chunk forwards and not a traced split (`torch.distributed.pipelining.pipeline` over
`torch.export`): the tensor-parallel runtime acts by replacing the `forward` of the model's leaf modules
(tensor_parallel.py) and keeps the user's parameter objects; a traced stage runs an exported graph of aten ops
instead, with new module objects, so neither would apply. Each supported family therefore says, in a few
lines, what its forward does around the blocks (masks, positions, rotary tables) — the same calls the model's
own forward makes, in the same order, so results are bit-identical. Other models get a `ConfigurationError`
naming their class.

A parameter tied across chunks (GPT-2's token embedding and LM head) gets its own copy in every chunk after
the first that uses it; the copies' gradients are summed after each step (Megatron-LM's embedding group).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from autoshard.errors import ConfigurationError

__all__ = ["ChunkFamily", "PipelineChunk", "TiedCopy", "family_of", "build_chunks", "prune_model",
           "untie_across_chunks", "SUPPORTED_CLASSES"]


def _positions(h: torch.Tensor) -> torch.Tensor:
    return torch.arange(h.shape[1], device=h.device).unsqueeze(0)  # (1, S)


def _causal_mask(chunk: nn.Module, h: torch.Tensor, pos: torch.Tensor):
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(config=chunk.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
                              position_ids=pos)


def _lm_output(logits: torch.Tensor):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(logits=logits)


# -- GPT-2 (transformers GPT2LMHeadModel / GPT2Model.forward) -------------------------------------------------
def _gpt2_embed(c: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    t = c.transformer
    return t.drop(t.wte(ids) + t.wpe(_positions(ids)))  # (B, S, H)


def _gpt2_context(c: nn.Module, h: torch.Tensor) -> dict:
    pos = _positions(h)
    return {"pos": pos, "mask": _causal_mask(c, h, pos)}


def _gpt2_block(block: nn.Module, h: torch.Tensor, ctx: dict) -> torch.Tensor:
    return block(h, None, ctx["mask"], None, encoder_attention_mask=None, use_cache=False, position_ids=ctx["pos"])


# -- Llama (transformers LlamaForCausalLM / LlamaModel.forward) -----------------------------------------------
def _llama_context(c: nn.Module, h: torch.Tensor) -> dict:
    pos = _positions(h)
    return {"pos": pos, "mask": _causal_mask(c, h, pos), "rope": c.model.rotary_emb(h, position_ids=pos)}


def _llama_block(block: nn.Module, h: torch.Tensor, ctx: dict) -> torch.Tensor:
    return block(h, attention_mask=ctx["mask"], position_embeddings=ctx["rope"], position_ids=ctx["pos"],
                 past_key_values=None, use_cache=False)


# -- the zoo's nanoGPT-style GQAGPT and residual MLP (autoshard/models/small.py) ------------------------------
def _gqa_embed(c: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1], device=ids.device)
    return c.wte(ids) + c.wpe(pos)  # (B, T, C)


def _no_context(c: nn.Module, h: torch.Tensor) -> dict:
    return {}


def _plain_block(block: nn.Module, h: torch.Tensor, ctx: dict) -> torch.Tensor:
    return block(h)


def _identity(c: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class ChunkFamily:
    """What a model family's forward does around its list of blocks, as functions of a chunk."""

    classes: tuple[str, ...]  # class names (any class in the model's MRO)
    blocks: str  # path of the ModuleList of repeated blocks
    first: tuple[str, ...]  # modules before the blocks: chunk 0
    last: tuple[str, ...]  # modules after the blocks: the last chunk
    embed: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # chunk 0: inputs -> hidden states
    context: Callable[[nn.Module, torch.Tensor], dict]  # per chunk: what every block call needs besides h
    block: Callable[[nn.Module, torch.Tensor, dict], torch.Tensor]
    head: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # last chunk: hidden states -> output
    shared: tuple[str, ...] = ()  # parameter-free modules every chunk calls (rotary tables)
    wrap_output: Callable[[torch.Tensor], object] = field(default=lambda out: out)  # as forward() returns it


FAMILIES = (
    ChunkFamily(classes=("GPT2LMHeadModel",), blocks="transformer.h",
                first=("transformer.wte", "transformer.wpe", "transformer.drop"),
                last=("transformer.ln_f", "lm_head"), embed=_gpt2_embed, context=_gpt2_context,
                block=_gpt2_block, head=lambda c, h: c.lm_head(c.transformer.ln_f(h)), wrap_output=_lm_output),
    ChunkFamily(classes=("LlamaForCausalLM",), blocks="model.layers", first=("model.embed_tokens",),
                last=("model.norm", "lm_head"), shared=("model.rotary_emb",),
                embed=lambda c, ids: c.model.embed_tokens(ids), context=_llama_context, block=_llama_block,
                head=lambda c, h: c.lm_head(c.model.norm(h)), wrap_output=_lm_output),
    ChunkFamily(classes=("GQAGPT",), blocks="h", first=("wte", "wpe"), last=("ln_f", "lm_head"),
                embed=_gqa_embed, context=_no_context, block=_plain_block,
                head=lambda c, h: c.lm_head(c.ln_f(h))),
    ChunkFamily(classes=("MLP",), blocks="blocks", first=(), last=("head",), embed=_identity,
                context=_no_context, block=_plain_block, head=lambda c, h: c.head(h)),
)
SUPPORTED_CLASSES = tuple(name for f in FAMILIES for name in f.classes)


def family_of(model: nn.Module) -> ChunkFamily:
    names = [cls.__name__ for cls in type(model).__mro__]
    for family in FAMILIES:
        if any(n in family.classes for n in names):
            return family
    raise ConfigurationError(f"pipeline parallelism does not know how to cut a {type(model).__name__} into "
                             f"stages; supported: {', '.join(SUPPORTED_CLASSES)}. Plan it without pipeline "
                             "parallelism (pp=1) or add its family to autoshard/runtime/pipeline_split.py")


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register `module` under `path` in `root`, creating empty containers for the parents on the way."""
    *parents, name = path.split(".")
    node = root
    for part in parents:
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    node.add_module(name, module)


class PipelineChunk(nn.Module):
    """Chunk `index` of `num_chunks`: [embedding part if first] -> blocks[lo:hi] -> [norm + head if last].

    `run` computes on whatever it is given; `forward` goes through `boundary` when pipeline.py has set one
    (plain local tensors in and out of a stage that computes on DTensors)."""

    boundary: Callable[[PipelineChunk, torch.Tensor], torch.Tensor] | None = None

    def __init__(self, model: nn.Module, family: ChunkFamily, index: int, num_chunks: int,
                 layers: tuple[int, int]) -> None:
        super().__init__()
        self.family, self.index, self.num_chunks = family, index, num_chunks
        self.is_first, self.is_last = index == 0, index == num_chunks - 1
        self.layers = range(*layers)
        self.config = getattr(model, "config", None)
        for path in self.module_paths():
            module = model.get_submodule(path)
            _attach(self, path, module)

    def module_paths(self) -> list[str]:
        f = self.family
        paths = list(f.first) if self.is_first else []
        paths += [*f.shared, *(f"{f.blocks}.{i}" for i in self.layers)]
        return paths + (list(f.last) if self.is_last else [])

    def run(self, x: torch.Tensor) -> torch.Tensor:
        f = self.family
        h = f.embed(self, x) if self.is_first else x
        if self.layers:
            ctx = f.context(self, h)
            blocks = self.get_submodule(f.blocks)
            for i in self.layers:
                out = f.block(blocks.get_submodule(str(i)), h, ctx)
                h = out[0] if isinstance(out, tuple) else out
        return f.head(self, h) if self.is_last else h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x) if self.boundary is None else self.boundary(self, x)


def _check_layers(stage_layers: tuple[tuple[int, int], ...], num_blocks: int, model: nn.Module) -> None:
    expected = 0
    for lo, hi in stage_layers:
        if lo != expected or hi < lo:
            break
        expected = hi
    else:
        if expected == num_blocks:
            return
    raise ConfigurationError(f"the plan's pipeline chunks {list(stage_layers)} do not cover the "
                             f"{num_blocks} blocks of this {type(model).__name__} in order; re-plan for this model")


def build_chunks(model: nn.Module, stage_layers: tuple[tuple[int, int], ...]) -> list[PipelineChunk]:
    """Every chunk of the pipeline, in model order (the caller keeps the ones on this rank)."""
    family = family_of(model)
    num_blocks = len(model.get_submodule(family.blocks))
    _check_layers(stage_layers, num_blocks, model)
    chunks = [PipelineChunk(model, family, c, len(stage_layers), lay) for c, lay in enumerate(stage_layers)]
    _check_coverage(model, chunks)
    return chunks


def _check_coverage(model: nn.Module, chunks: list[PipelineChunk]) -> None:
    """Every parameter of the model belongs to some chunk (else the family description misses a module)."""
    covered = {id(p) for c in chunks for p in c.parameters()}
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise ConfigurationError(f"parameters {missing[:3]} of {type(model).__name__} belong to no pipeline "
                                 "chunk; the model has modules outside its blocks, embeddings and head that "
                                 "autoshard's pipeline split does not know")


@dataclass(frozen=True)
class TiedCopy:
    """One parameter tied across chunks: (chunk index, module path, local name) of every holder."""

    holders: tuple[tuple[int, str, str], ...]

    def chunks(self) -> tuple[int, ...]:
        return tuple(c for c, _, _ in self.holders)


def untie_across_chunks(chunks: list[PipelineChunk], local: set[int]) -> list[TiedCopy]:
    """Give each local chunk after the first that uses a shared parameter its own copy; return every tied
    group (the same list on every rank).

    Every chunk becomes its own FSDP root and its own pipeline stage, so no parameter may span two of them.
    """
    holders: dict[int, list[tuple[int, str, str, nn.Module]]] = {}
    for chunk in chunks:
        for path, mod in chunk.named_modules(remove_duplicate=False):
            for name, p in mod._parameters.items():
                if p is not None:
                    holders.setdefault(id(p), []).append((chunk.index, path, name, mod))
    groups = []
    for entries in holders.values():
        if len({c for c, *_ in entries}) < 2:
            continue
        first, copies = entries[0][0], {}
        for c, _, name, mod in entries:
            if c != first and c in local:
                original = mod._parameters[name]
                if c not in copies:
                    copies[c] = nn.Parameter(original.detach().clone(), requires_grad=original.requires_grad)
                mod._parameters[name] = copies[c]
        groups.append(TiedCopy(holders=tuple((c, path, name) for c, path, name, _ in entries)))
    return groups


def prune_model(model: nn.Module, family: ChunkFamily, local: list[PipelineChunk]) -> None:
    """Drop from `model` every block, embedding and head that no local chunk holds, so its parameters are
    exactly this rank's (original names). Blocks keep their indices: `transformer.h.2` stays named so."""
    kept = {path for chunk in local for path in chunk.module_paths()}
    blocks = model.get_submodule(family.blocks)
    for name in list(blocks._modules):
        if f"{family.blocks}.{name}" not in kept:
            del blocks._modules[name]
    for path in (*family.first, *family.last):
        if path not in kept:
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            parent._modules[name] = None
    # a chunk holding a tied copy registered it on the shared module object: the model sees the copy too
