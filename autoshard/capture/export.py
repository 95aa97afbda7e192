"""torch.export with a symbolic batch dimension, so every size is known per sample.

The model is traced with fake tensors (torch.export's non-strict mode), so a model on the meta device or a
real one costs no compute and no memory. Dim 0 of every tensor input is marked dynamic; shapes in the graph
then carry a batch symbol wherever they grow with the batch (`(s0, 2048, 768)`, `(2048*s0, 768)`), which is
how the planner knows per-sample sizes and which dims it may shard as "batch". A model that specializes on
the batch size is exported twice with static shapes (batch B and B+1) and the dims that changed are the
batch dims.
"""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass

import torch
from torch import nn

from autoshard.errors import CaptureError

__all__ = ["ExportedGraph", "export_model", "per_sample_shape", "training_outputs", "positional_inputs"]

log = logging.getLogger(__name__)


def positional_inputs(model: nn.Module, example_inputs) -> tuple:
    """`example_inputs` as the positional arguments of `model.forward`: a tuple as it is, one tensor as a
    1-tuple, a dict of keyword arguments (T5's `input_ids=..., decoder_input_ids=...`) bound to the forward's
    parameters in order, the ones it skips at their defaults (None for T5's `attention_mask`)."""
    import inspect

    if isinstance(example_inputs, tuple):
        return example_inputs
    if not isinstance(example_inputs, dict):
        return (example_inputs,)
    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [p.name for p in params]
    unknown = sorted(set(example_inputs) - set(names))
    if unknown:
        raise CaptureError(f"example inputs {unknown} are not positional parameters of "
                           f"{type(model).__name__}.forward ({', '.join(names)}); pass inputs it takes")
    last = max(names.index(k) for k in example_inputs)
    out = []
    for p in params[: last + 1]:
        if p.name in example_inputs:
            out.append(example_inputs[p.name])
        elif p.default is not inspect.Parameter.empty:
            out.append(p.default)
        else:
            raise CaptureError(f"example inputs give no {p.name!r}, which {type(model).__name__}.forward needs")
    return tuple(out)


@dataclass(frozen=True)
class ExportedGraph:
    program: torch.export.ExportedProgram
    # per-node (per-sample shape, batch dims); filled for every node whose value is a tensor
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    param_names: dict[str, str]  # placeholder name -> canonical parameter FQN
    buffer_names: dict[str, str]  # placeholder name -> buffer FQN
    input_names: tuple[str, ...]  # placeholder names of user inputs


def per_sample_shape(shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape with the batch symbol set to 1, dims that contain it) for a possibly symbolic shape."""
    dims, batch_dims = [], []
    for i, d in enumerate(shape):
        if isinstance(d, torch.SymInt):
            expr = d.node.expr
            free = expr.free_symbols
            if free:
                batch_dims.append(i)
                expr = expr.subs({s: 1 for s in free})
            dims.append(int(expr))
        else:
            dims.append(int(d))
    return tuple(dims), tuple(batch_dims)


def _canonical_param_names(model: nn.Module) -> dict[str, str]:
    """Every name a parameter is reachable under -> the first one (what `named_parameters()` reports)."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters():
        first.setdefault(id(p), name)
    return {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


def _dynamic_batch(example_inputs: tuple) -> tuple:
    batch = torch.export.Dim("batch", min=2, max=1 << 24)
    return tuple({0: batch} if isinstance(x, torch.Tensor) and x.dim() > 0 else None for x in example_inputs)


def _grow_batch(example_inputs: tuple) -> tuple:
    return tuple(torch.cat([x, x[:1]]) if isinstance(x, torch.Tensor) and x.dim() > 0 else x
                 for x in example_inputs)


@contextlib.contextmanager
def _quiet_torch_logs():
    """torch.export logs its own diagnosis of a failed trace; we report one line, so keep it off stderr."""
    names = ("torch", "torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    sink = io.StringIO()  # it also prints the partial graph of a failed trace
    try:
        with contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
            yield
    finally:
        for lg, lv in zip(loggers, levels, strict=True):
            lg.setLevel(lv)


def _export(model: nn.Module, inputs: tuple, dynamic: bool) -> torch.export.ExportedProgram:
    kwargs = {"dynamic_shapes": _dynamic_batch(inputs)} if dynamic else {}
    with _quiet_torch_logs():
        return torch.export.export(model, inputs, strict=False, **kwargs)


def _describe(exc: BaseException) -> str:
    """First line of the error and the innermost frame of the user's code where tracing failed."""
    text = str(exc).strip().splitlines()
    head = (text[0] if text else type(exc).__name__)[:240]
    where = _user_frame(exc)
    return f"{head} (at {where})" if where else head


def _user_frame(exc: BaseException) -> str | None:
    import os
    import traceback

    torch_dir = os.path.dirname(torch.__file__)
    ours = os.path.dirname(os.path.dirname(__file__))
    found = None
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for fr in traceback.extract_tb(exc.__traceback__):
            if not fr.filename.startswith((torch_dir, ours)) and "site-packages" not in fr.filename \
                    and not fr.filename.startswith("<"):
                found = f"{os.path.basename(fr.filename)}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()}"
        exc = exc.__cause__ or exc.__context__
    return found


@contextlib.contextmanager
def training_outputs(model: nn.Module):
    """Inference-only outputs off while inside: a Hugging Face config's `use_cache` (a key/value cache is an
    object torch.export cannot return, and training never reads it) is set to False on every config the
    model's modules hold (encoder-decoder models keep one per stack), and restored on the way out."""
    configs = {id(c): c for m in model.modules() for c in [getattr(m, "config", None)]
               if c is not None and getattr(c, "use_cache", None)}
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True


def export_model(model: nn.Module, example_inputs: tuple) -> ExportedGraph:
    """Export `model` on `example_inputs`; raises `CaptureError` naming the failing op when it cannot."""
    if not isinstance(model, nn.Module):
        raise CaptureError(f"expected an nn.Module, got {type(model).__name__}; pass the model object itself")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    if any(isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == 1 for x in example_inputs):
        example_inputs = _grow_batch(example_inputs)  # export specializes a batch of 1; trace with 2
    was_training = model.training
    model.train()  # capture the training graph: dropout is part of it
    try:
        with training_outputs(model):
            try:
                program = _export(model, example_inputs, dynamic=True)
                shapes = _node_shapes(program)
            except Exception as exc:  # noqa: BLE001 - any export failure falls back to static shapes
                log.info("dynamic-batch export failed (%s); exporting twice with static shapes", _describe(exc))
                program, shapes = _export_static_twice(model, example_inputs)
    finally:
        model.train(was_training)
    return _with_names(program, shapes, model)


def _export_static_twice(model: nn.Module, example_inputs: tuple):
    try:
        small = _export(model, example_inputs, dynamic=False)
        large = _export(model, _grow_batch(example_inputs), dynamic=False)
    except Exception as exc:  # noqa: BLE001 - turned into one clear line for the user
        raise CaptureError(
            f"torch.export could not trace {type(model).__name__}: {_describe(exc)}. Make the model exportable "
            "(no data-dependent Python control flow; for Hugging Face models pass use_cache=False) or give a "
            "factory that builds an exportable variant"
        ) from exc
    batch = next(x.shape[0] for x in example_inputs if isinstance(x, torch.Tensor) and x.dim() > 0)
    a_nodes, b_nodes = list(small.graph.nodes), list(large.graph.nodes)
    if len(a_nodes) != len(b_nodes):
        raise CaptureError(f"{type(model).__name__} traces to different graphs at batch {batch} and "
                           f"{batch + 1}; the planner needs a graph whose structure does not depend on the batch")
    shapes = {}
    for a, b in zip(a_nodes, b_nodes, strict=True):
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
            dims = [int(x) for x in va.shape]
            batch_dims = tuple(i for i, (x, y) in enumerate(zip(va.shape, vb.shape, strict=True)) if x != y)
            for i in batch_dims:
                dims[i] = int(vb.shape[i]) - int(va.shape[i])  # per-sample size of a dim linear in batch
            shapes[a.name] = (tuple(dims), batch_dims)
    return small, shapes


def _node_shapes(program) -> dict:
    shapes = {}
    for node in program.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            shapes[node.name] = per_sample_shape(val.shape)
    return shapes


def _with_names(program, shapes, model: nn.Module) -> ExportedGraph:
    canonical = _canonical_param_names(model)
    params, buffers, inputs = {}, {}, []
    for spec in program.graph_signature.input_specs:
        kind = spec.kind.name
        if kind == "PARAMETER":
            params[spec.arg.name] = canonical.get(spec.target, spec.target)
        elif kind in ("BUFFER", "CONSTANT_TENSOR"):
            buffers[spec.arg.name] = spec.target or spec.arg.name
        elif kind == "USER_INPUT":
            inputs.append(spec.arg.name)
    return ExportedGraph(program=program, shapes=shapes, param_names=params, buffer_names=buffers,
                         input_names=tuple(inputs))
