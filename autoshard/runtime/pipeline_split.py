"""Pipeline chunks: a model cut at block boundaries into modules that keep the original parameter names.

Chunk c of a plan's `PipelineSpec` holds blocks `stage_layers[c]` of the model's one list of repeated blocks;
chunk 0 also holds what comes before the blocks (embeddings), the last chunk what comes after them (final
norm, head), exactly as the planner assigns ops (`planner.template.stage_of`). A `PipelineChunk` registers the
model's *own* submodules under their original paths (`transformer.h.2` stays `transformer.h.2`), so the
runtime's per-module machinery, plan lookups and parameter FQNs work on a chunk as on the whole model.

How a chunk runs. The tensor-parallel runtime acts by replacing the `forward` of the model's leaf modules
(tensor_parallel.py) and keeps the user's parameter objects, so a chunk must run the model's own modules,
not a traced copy (`torch.distributed.pipelining.pipeline` over `torch.export` makes new module objects).
Any model whose forward takes `inputs_embeds=` (every decoder in `transformers`) is cut generically: its one
list of repeated blocks is found in the model (plans/contract.py states the rule for the planner), the
modules that own parameters are assigned to the first or the last chunk by the order a forward calls them,
and a chunk runs the model's *own* forward with the list holding only its blocks: chunk 0 on the inputs,
a later chunk on `inputs_embeds=h` with its first block's hidden-states argument replaced by `h` (so nothing
the forward does to the embeddings is applied twice); a chunk that is not last stops after its last block.
Modules of other chunks are stood in for by parameter-free stubs while a chunk runs. autoshard's own test
models (no `inputs_embeds`) keep a hand-written description (`FAMILIES`).

A parameter tied across chunks (GPT-2's token embedding and LM head) gets its own copy in every chunk after
the first that uses it; the copies' gradients are summed after each step (Megatron-LM's embedding group).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from autoshard.capture.export import training_outputs
from autoshard.errors import ConfigurationError
from autoshard.plans.contract import OWN_PIPELINE_CLASSES, PIPELINE_ENTRY

__all__ = ["ChunkFamily", "PipelineChunk", "TiedCopy", "family_of", "build_chunks", "prune_model",
           "untie_across_chunks", "SUPPORTED_CLASSES"]


def _lm_output(logits: torch.Tensor):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(logits=logits)


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
    entry: str | None = None  # generic cut: the forward keyword a later chunk enters with (embed etc. unused)


FAMILIES = (  # autoshard's own test models: their forwards take no inputs_embeds
    ChunkFamily(classes=("GQAGPT",), blocks="h", first=("wte", "wpe"), last=("ln_f", "lm_head"),
                embed=_gqa_embed, context=_no_context, block=_plain_block,
                head=lambda c, h: c.lm_head(c.ln_f(h))),
    ChunkFamily(classes=("MLP",), blocks="blocks", first=(), last=("head",), embed=_identity,
                context=_no_context, block=_plain_block, head=lambda c, h: c.head(h)),
)
SUPPORTED_CLASSES = tuple(name for f in FAMILIES for name in f.classes)
assert set(SUPPORTED_CLASSES) == set(OWN_PIPELINE_CLASSES)


def family_of(model: nn.Module, example: torch.Tensor | None = None) -> ChunkFamily:
    """How to cut `model`: its own description, or the generic cut of a model whose forward takes
    `inputs_embeds` (`example`: an input whose other dims are real; token ids of 2 by default)."""
    names = [cls.__name__ for cls in type(model).__mro__]
    for family in FAMILIES:
        if any(n in family.classes for n in names):
            return family
    import inspect

    try:
        accepts = PIPELINE_ENTRY in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        accepts = False
    if not accepts:
        raise ConfigurationError(f"pipeline parallelism cannot cut a {type(model).__name__} into stages: its "
                                 f"forward takes no {PIPELINE_ENTRY}= to enter a later stage with hidden states; "
                                 "plan it without pipeline parallelism (pp=1)")
    blocks = _block_list(model)
    first, last = _outside_blocks(model, blocks, example)
    return ChunkFamily(classes=(type(model).__name__,), blocks=blocks, first=first, last=last, embed=_identity,
                       context=_no_context, block=_plain_block, head=_identity, wrap_output=_lm_output,
                       entry=PIPELINE_ENTRY)


def _block_list(model: nn.Module) -> str:
    """The path of the model's one list of repeated blocks (lists inside a block, e.g. experts, not counted)."""
    lists = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) >= 2
             and len({type(c) for c in m}) == 1 and any(True for _ in m.parameters())]
    top = [n for n in lists if not any(n.startswith(o + ".") for o in lists if o != n)]
    if len(top) != 1:
        found = f"{len(top)} ({', '.join(top)})" if top else "none"
        raise ConfigurationError(f"pipeline parallelism cuts one list of repeated blocks; {type(model).__name__} "
                                 f"has {found}. Plan it without pipeline parallelism (pp=1)")
    return top[0]


def _outside_blocks(model: nn.Module, blocks: str, example: torch.Tensor | None) -> tuple[tuple[str, ...], ...]:
    """(modules owning parameters called before the blocks, those called after), in call order, from a
    fake-tensor forward (registration order is not call order: OPT registers its final norm first)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    owners = [n for n, m in model.named_modules() if n and m._parameters and not n.startswith(blocks + ".")
              and n != blocks]
    owners = [n for n in owners if not any(n.startswith(o + ".") for o in owners if o != n)]
    order: list[str] = []
    hooks = [model.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: order.append(n)) for n in owners]
    first_block = next(iter(model.get_submodule(blocks)))
    hooks.append(first_block.register_forward_pre_hook(lambda m, a: order.append(blocks)))
    try:
        device = example.device if example is not None else next(model.parameters()).device
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.zeros((1, 2), dtype=torch.long, device=device) if example is None else \
                torch.empty((1, *example.shape[1:]), dtype=example.dtype, device=device)
            model(x)
    finally:
        for h in hooks:
            h.remove()
    seen = list(dict.fromkeys(order))
    at = seen.index(blocks) if blocks in seen else len(seen)
    first = [n for n in seen[:at]] + [n for n in owners if n not in seen]  # never called: kept with chunk 0
    return tuple(first), tuple(n for n in seen[at + 1:] if n not in first)


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
    send_dtype: torch.dtype | None = None  # floating outputs handed to the next stage in this dtype (precision.py)

    def __init__(self, model: nn.Module, family: ChunkFamily, index: int, num_chunks: int,
                 layers: tuple[int, int]) -> None:
        super().__init__()
        self.family, self.index, self.num_chunks = family, index, num_chunks
        self.is_first, self.is_last = index == 0, index == num_chunks - 1
        self.layers = range(*layers)
        self.config = getattr(model, "config", None)
        self.__dict__["whole"] = model  # not a submodule: the chunk holds only its own parameters
        # the model's own forward, bound now: the pipelined model's class later refuses direct calls
        self.__dict__["whole_forward"] = type(model).forward.__get__(model)
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
        if f.entry is not None:
            return _run_own_forward(self, x)
        h = f.embed(self, x) if self.is_first else x
        if self.layers:
            ctx = f.context(self, h)
            blocks = self.get_submodule(f.blocks)
            for i in self.layers:
                out = f.block(blocks.get_submodule(str(i)), h, ctx)
                h = out[0] if isinstance(out, tuple) else out
        return f.head(self, h) if self.is_last else h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.run(x) if self.boundary is None else self.boundary(self, x)
        if self.send_dtype is not None and y.is_floating_point() and y.dtype != self.send_dtype:
            y = y.to(self.send_dtype)  # autocast leaves some outputs in fp32; the stages exchange one dtype
        return y


class _ChunkDone(Exception):  # noqa: N818 - control flow, not an error: the chunk's last block has run
    def __init__(self, h: torch.Tensor) -> None:
        super().__init__()
        self.h = h


class _Absent(nn.Module):
    """Stands in for a module of another chunk while a chunk runs: before the blocks it returns a zero (its
    result never reaches the blocks, whose input is replaced), after them it ends the chunk with its input."""

    def __init__(self, ends_chunk: bool) -> None:
        super().__init__()
        self.ends_chunk = ends_chunk

    def forward(self, *args, **kwargs):
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if self.ends_chunk:
            raise _ChunkDone(x)
        return torch.zeros((), device=x.device if x is not None else None)


def _first_tensor_replaced(x: torch.Tensor):
    def hook(module, args, kwargs):
        if args:
            return (x, *args[1:]), kwargs
        key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        return args, {**kwargs, key: x}
    return hook


def _stop_after(module, args, out):
    raise _ChunkDone(out[0] if isinstance(out, tuple) else out)


@contextmanager
def _swapped_modules(root: nn.Module, replacements: dict[str, nn.Module]):
    saved = []
    for path, module in replacements.items():
        parent_path, _, name = path.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        saved.append((parent, name, parent._modules.get(name)))
        parent._modules[name] = module
    try:
        yield
    finally:
        for parent, name, module in reversed(saved):
            parent._modules[name] = module


def _run_own_forward(chunk: PipelineChunk, x: torch.Tensor):
    """The chunk through the model's own forward (module docstring): the block list holds only this chunk's
    blocks; other chunks' modules are stubs; a later chunk enters with `inputs_embeds=x` and its first block
    (or, without blocks, its first module after them) takes `x`; a chunk that is not last ends after its
    last block."""
    f, model = chunk.family, chunk.whole
    if not chunk.layers and not chunk.is_first and not chunk.is_last:
        return x
    blocks = model.get_submodule(f.blocks)
    mine = OrderedDict((str(i), chunk.get_submodule(f"{f.blocks}.{i}")) for i in chunk.layers)
    stubs = {p: _Absent(ends_chunk=False) for p in f.first if not chunk.is_first}
    stubs |= {p: _Absent(ends_chunk=True) for p in f.last if not chunk.is_last}
    hooks = []
    if mine and not chunk.is_last:
        hooks.append(next(reversed(mine.values())).register_forward_hook(_stop_after))
    if not chunk.is_first:
        entry = next(iter(mine.values())) if mine else chunk.get_submodule(f.last[0])
        hooks.append(entry.register_forward_pre_hook(_first_tensor_replaced(x), with_kwargs=True))
    saved = blocks._modules
    blocks._modules = mine
    try:
        with _swapped_modules(model, stubs), training_outputs(model):
            out = chunk.whole_forward(x) if chunk.is_first else chunk.whole_forward(**{f.entry: x})
    except _ChunkDone as done:
        return done.h
    finally:
        blocks._modules = saved
        for h in hooks:
            h.remove()
    return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out


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


def build_chunks(model: nn.Module, stage_layers: tuple[tuple[int, int], ...],
                 example: torch.Tensor | None = None) -> list[PipelineChunk]:
    """Every chunk of the pipeline, in model order (the caller keeps the ones on this rank); `example` as for
    `family_of`."""
    family = family_of(model, example)
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
