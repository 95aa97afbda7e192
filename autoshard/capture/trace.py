"""Capture: a model traced with torch.export on the meta device, folded into an OpGraph."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import replace

import torch
from torch import nn

from autoshard.capture import disk_cache
from autoshard.capture.blocks import find_blocks
from autoshard.capture.build_ops import coarsen
from autoshard.capture.expand import expand_blocks
from autoshard.capture.export import export_model, positional_inputs
from autoshard.capture.ir import Op, OpGraph, OpKind
from autoshard.models import LoadedModel, ModelSpec, build_module

__all__ = ["capture", "capture_model", "capture_ref"]

log = logging.getLogger(__name__)


def _tied_params(model: nn.Module) -> tuple[tuple[str, str], ...]:
    first: dict[int, str] = {}
    tied = []
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(p), name)
        if owner != name:
            tied.append((name, owner))
    return tuple(tied)


def _with_block_classes(model: nn.Module, blocks: tuple) -> tuple:
    """Each block group named by its block module's class (`LlamaDecoderLayer`, `BertLayer`): what `find_blocks`
    reads off the ops names a block whose forward runs no op of its own by its first leaf (`Linear`)."""
    out = []
    for group in blocks:
        first = group.op_names[0][0] if group.op_names and group.op_names[0] else ""
        index = first[len(group.name) + 1:].split(".", 1)[0] if first.startswith(group.name + ".") else ""
        try:
            out.append(replace(group, module_type=type(model.get_submodule(f"{group.name}.{index}")).__name__))
        except AttributeError:
            out.append(group)
    return tuple(out)


def capture(model: nn.Module, example_inputs: tuple | dict, *, name: str | None = None) -> OpGraph:
    """Trace `model` on `example_inputs` (any device, meta included; positional, or keyword arguments as a
    dict) into an `OpGraph`.

    Sizes in the graph are per sample; dim 0 of every tensor input is the batch.
    """
    t0 = time.perf_counter()
    example_inputs = positional_inputs(model, example_inputs)
    with _one_expert_kernel():
        exported = export_model(model, example_inputs)
    coarse = coarsen(exported, model)
    ops, blocks = find_blocks(_mark_shared(coarse.ops))
    blocks = _with_block_classes(model, blocks)
    seq = _seq_len(ops)
    graph = OpGraph(model_name=name or type(model).__name__, ops=ops, blocks=blocks, seq_len=seq,
                    outputs=coarse.outputs, unknown_ops=coarse.unknown, tied_params=_tied_params(model),
                    root_type=type(model).__name__, root_kwargs=_forward_parameters(model),
                    capture_s=time.perf_counter() - t0)
    if coarse.unknown:
        log.warning("operators unknown to the planner (priced as memory-bound): %s", ", ".join(coarse.unknown))
    log.info("captured %s: %d ops, %d params, %.1f s", graph.model_name, len(ops), graph.num_params,
             graph.capture_s)
    return graph


@contextlib.contextmanager
def _one_expert_kernel():
    """Mixture-of-experts layers in transformers pick their grouped matmul by device and dtype (`grouped_mm` for
    bf16 under export, its own `grouped_mm_fallback` op otherwise): the same model captured on the meta device
    in one dtype and on the CPU in another would give two graphs with two fingerprints, and a plan made by
    `estimate` would not match the model `measure` runs. Capture always records the fallback op (it has a fake
    kernel, so the meta device traces it): one name, the same shapes and FLOPs."""
    try:
        from transformers.integrations import moe
    except ImportError:  # no transformers: no MoE layers of its making
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return
    moe._can_use_grouped_mm = lambda *args, **kwargs: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


def _forward_parameters(model) -> tuple[str, ...]:
    import inspect

    try:
        return tuple(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):  # a builtin or C-implemented forward
        return ()


def _mark_shared(ops: tuple[Op, ...]) -> tuple[Op, ...]:
    """A parameter used by several ops (tied embedding and LM head) is owned by the first: only there does it
    count for memory and gradient synchronization."""
    seen: set[str] = set()
    out = []
    for op in ops:
        params = []
        for p in op.params:
            params.append(p if p.name not in seen else replace(p, owner=False))
            seen.add(p.name)
        out.append(replace(op, params=tuple(params)) if params != list(op.params) else op)
    return tuple(out)


def _seq_len(ops: tuple[Op, ...]) -> int | None:
    """Sequence length: dim 1 of the first 2-D+ user input (token ids are (batch, seq))."""
    for op in ops:
        if op.kind is OpKind.INPUT and len(op.output_meta.shape) >= 1 and op.output_meta.batch_dims == (0,):
            shape = op.output_meta.shape
            if len(shape) >= 2 and op.output_meta.dtype.startswith("int"):
                return shape[1]
    return None


def capture_ref(ref, *, seq: int | None = None, attn: str | None = None) -> OpGraph:
    """The graph of a zoo name, spec string or `module:factory`; a spec model found in the graph cache is not
    even built (building a 96-layer Hugging Face model on the meta device takes seconds)."""
    from autoshard.models import load_model

    hit = disk_cache.cached_graph(ref, seq=seq, attn=attn)
    if hit is not None:
        return hit
    return capture_model(load_model(ref, seq=seq, attn=attn))


def capture_model(loaded: LoadedModel, *, use_cache: bool = True) -> OpGraph:
    """Capture a zoo / spec / factory model. Spec models are traced with 2 blocks and expanded (same graph,
    a fraction of the time); others are traced whole. A spec with attn=flash gets causal FlashAttention.
    Spec models come from the on-disk graph cache when they were captured before (`disk_cache`)."""
    key = None
    if loaded.spec is not None and use_cache and disk_cache.cache_enabled():
        key = disk_cache.cache_key(loaded.spec, loaded.name)
        hit = disk_cache.load_cached(key)
        if hit is not None:
            return hit
    graph = None
    if loaded.spec is not None and loaded.spec.layers > 2:
        graph = _capture_spec(loaded.spec)
        if graph is not None:
            graph = replace(graph, model_name=loaded.name, _index={})
    if graph is None:
        graph = capture(loaded.module, loaded.example_inputs(2), name=loaded.name)
    if loaded.spec is not None and loaded.spec.attn == "flash":
        graph = _with_attention_kernel(graph, "flash")
    if key is not None:
        disk_cache.store(key, graph)
    return graph


def _with_attention_kernel(graph: OpGraph, kernel: str) -> OpGraph:
    ops = tuple(replace(op, variant=kernel) if op.kind is OpKind.ATTENTION else op for op in graph.ops)
    return replace(graph, ops=ops, _index={})


@functools.lru_cache(maxsize=16)
def _capture_spec(spec: ModelSpec) -> OpGraph | None:
    t0 = time.perf_counter()
    # traced in bf16, the dtype GPUs train in: upcasts inside the model (RMSNorm statistics, softmax) show as
    # float32 kernels (`Op.kernel_io_wide_numel`); sizes and FLOPs do not depend on it
    module = build_module(spec, layers=2, dtype=torch.bfloat16)
    small = LoadedModel(name=spec.name, family=spec.family, module=module, spec=spec)
    graph = capture(small.module, small.example_inputs(2), name=spec.name)
    if len(graph.blocks) != 1 or graph.blocks[0].count != 2:
        return None  # blocks not recognised: the caller traces the whole model
    graph = expand_blocks(graph, spec.layers)
    return replace(graph, capture_s=time.perf_counter() - t0, _index={})
