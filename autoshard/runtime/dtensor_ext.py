"""What DTensor needs to run unmodified models, and the runtime's one redistribution primitive.

1. `aten._scaled_dot_product_flash_attention_for_cpu` (what `F.scaled_dot_product_attention` runs on CPU) has
   no DTensor sharding rule in torch 2.13 (the CUDA flash / efficient / cuDNN kernels do). We register one
   that shards the batch (dim 0) or the heads (dim 1) of q, k, v, the output and the log-sum-exp, mirroring
   the CUDA flash-attention rule, only where torch has none.
2. `SPMDMode`, active during the parallel model's forward:
   - converts plain tensors that meet a DTensor in one call (causal masks, rotary tables, position ids built
     by the model from shapes) to replicated DTensors *before* autograd records the call, so backward sees
     DTensors only. (DTensor's `implicit_replication()` converts inside dispatch, so autograd saves the plain
     tensor and backward fails outside the context.)
   - aligns an attention mask with the query's sharding before `F.scaled_dot_product_attention`: DTensor
     never redistributes keyword arguments (`attn_mask` is keyword-only in the ATen op), so the mask must
     arrive sharded like q on every mesh dim where it is not a broadcast dim.
   - splits a fused projection's output (GPT-2's c_attn: q, k, v side by side, stored part by part as
     `_StridedShard`) into its parts locally; DTensor would all-gather any split of a sharded dim.
3. `redistribute`: `DTensor.redistribute` with the backward the plan needs (gradient placements fixed at every
   module boundary, dp partial sums left to FSDP); see its docstring.
4. `settle_masked_partial`: a vocabulary-parallel lookup's output (`_MaskPartial`) as plain partial sums, so
   that it can be reduced more than once (by consumers that want different layouts).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _MaskPartial, _StridedShard
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

__all__ = ["register_dtensor_rules", "SPMDMode", "redistribute", "settle_masked_partial", "flatten_call",
           "unflatten_call"]

aten = torch.ops.aten
_FLASH_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _mask_placement(mask, dim: int) -> Placement:
    # a mask dim of 1 broadcasts over the shards; otherwise it is sharded like q (it arrives so: see SPMDMode)
    return Shard(dim) if mask.shape[dim] > 1 else Replicate()


def _flash_cpu_fwd_rule(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    mask = [] if attn_mask is None else [Replicate()]
    rules = [([Replicate(), Replicate()], [Replicate()] * 3 + mask)]
    for dim in (0, 1):  # batch, heads: outputs (out, logsumexp) and inputs (q, k, v, mask?)
        mask = [] if attn_mask is None else [_mask_placement(attn_mask, dim)]
        rules.append(([Shard(dim), Shard(dim)], [Shard(dim)] * 3 + mask))
    return rules


def _flash_cpu_bwd_rule(grad, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask=None, scale=None):
    mask = [] if attn_mask is None else [Replicate()]
    rules = [([Replicate()] * 3, [Replicate()] * 6 + mask)]
    for dim in (0, 1):
        mask = [] if attn_mask is None else [_mask_placement(attn_mask, dim)]
        rules.append(([Shard(dim)] * 3, [Shard(dim)] * 6 + mask))
    return rules


def _fill_rule(self, value):
    """`x.fill_(v)` with a scalar tensor `v` (BART's shift_tokens_right): the output keeps x's layout."""
    rules = [([Replicate()], [Replicate(), Replicate()])]
    rules += [([Shard(d)], [Shard(d), Replicate()]) for d in range(self.ndim)]
    return rules


@functools.cache
def register_dtensor_rules() -> None:
    """Register our sharding rules once per process, only for ops DTensor does not cover itself."""
    from torch.distributed.tensor.experimental import register_sharding

    propagator = DTensor._op_dispatcher.sharding_propagator
    known = set(propagator.op_strategy_funcs) | set(propagator.op_to_rules)
    known |= set(getattr(propagator, "op_single_dim_strategy_funcs", {}))
    for op, rule in ((_FLASH_CPU, _flash_cpu_fwd_rule), (_FLASH_CPU_BWD, _flash_cpu_bwd_rule),
                     (aten.fill_.Tensor, _fill_rule)):
        if op not in known:
            register_sharding(op)(rule)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _VIEWS:
        handlers.setdefault(op, _view_of_contiguous_local)


_VIEWS = (aten.view.default, aten._unsafe_view.default)


@torch.compiler.disable
def _view_of_contiguous_local(op_call, args, kwargs):
    """`view` / `_unsafe_view` of a DTensor whose global strides say contiguous but whose local tensor is not:
    the local view would fail (or read the wrong elements), so it runs on a contiguous copy of the local
    tensor. Where a forward reshape meets this, SPMDMode fixes it (`_local_laid_out_as_global`); autograd's
    backward views (UnsafeViewBackward of a matmul's output reshape) come here: a gradient DTensor made by
    a transposed kernel carries its output's contiguous global strides. Runs below autograd (a dispatch
    handler), so the copy needs no gradient of its own; any other call goes DTensor's own way."""
    x = args[0]
    if isinstance(x, DTensor) and not x._local_tensor.is_contiguous() and x.is_contiguous():
        x = DTensor(x._local_tensor.contiguous(), x._spec, requires_grad=x.requires_grad)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op_call)
    try:
        return op_call(x, *args[1:], **(kwargs or {}))
    finally:
        handlers[op_call] = handler


def _align_mask(mask, query: DTensor):
    """`mask` (B|1, H|1, S, S) placed like `query` on batch and heads, replicated elsewhere."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return mask
    if not isinstance(mask, DTensor):
        mask = DTensor.from_local(mask, query.device_mesh, [Replicate()] * query.device_mesh.ndim,
                                  run_check=False)
    target = []
    for p in query.placements:
        if isinstance(p, Shard) and p.dim in (0, 1) and mask.shape[p.dim] > 1:
            target.append(Shard(p.dim))
        elif isinstance(p, Shard) and p.dim in (2, 3):
            raise NotImplementedError("attention on a sequence-sharded query is not supported; the plan must "
                                      "gather the sequence before attention")
        else:
            target.append(Replicate())
    return mask.redistribute(placements=target)


_CONTAINERS = (list, tuple, dict)


def flatten_call(args: tuple, kwargs: dict) -> tuple[list, object]:
    """pytree.tree_flatten((args, kwargs)), without pytree for the usual flat call (tensors and scalars),
    which is most calls of a model's forward."""
    flat = [*args, *kwargs.values()] if kwargs else list(args)
    for x in flat:  # a plain loop: this runs on every op of the forward
        if isinstance(x, _CONTAINERS):
            return pytree.tree_flatten((args, kwargs))
    return flat, (len(args), tuple(kwargs))


def unflatten_call(flat: list, tree) -> tuple[tuple, dict]:
    """The inverse of `flatten_call`."""
    if isinstance(tree, pytree.TreeSpec):
        return pytree.tree_unflatten(flat, tree)
    num_args, keys = tree
    return tuple(flat[:num_args]), dict(zip(keys, flat[num_args:], strict=True))


class SPMDMode(TorchFunctionMode):
    """Function-level implicit replication, attention-mask alignment and free splits of fused projections
    (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], DTensor) and getattr(func, "__name__", "") in ("split", "chunk"):
            pieces = _split_fused(func.__name__, args, kwargs)
            if pieces is not None:
                return pieces
        flat, tree = flatten_call(args, kwargs)
        mesh, plain = None, False
        for x in flat:  # one pass: the mesh of the first DTensor, and whether plain tensors need lifting
            if isinstance(x, DTensor):
                mesh = mesh or x.device_mesh
            elif isinstance(x, torch.Tensor):
                plain = True
        if mesh is None or _is_inplace(func, kwargs):
            return func(*args, **kwargs)
        if plain:
            rep = [Replicate()] * mesh.ndim
            args, kwargs = unflatten_call([DTensor.from_local(x, mesh, rep, run_check=False)
                                           if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
                                           for x in flat], tree)
        if func is F.scaled_dot_product_attention:
            _check_attention_dropout(args, kwargs, mesh)
            args, kwargs = _with_aligned_mask(args, kwargs)
        elif func in _RESHAPES and isinstance(args[0], DTensor):
            args = (_local_laid_out_as_global(args[0]), *args[1:])
        return func(*args, **kwargs)


_RESHAPES = (torch.Tensor.reshape, torch.reshape, torch.Tensor.view)


def _local_laid_out_as_global(x: DTensor) -> DTensor:
    """`x` with a contiguous local tensor where its global strides say contiguous. `reshape` decides between a
    view and a copy on the global strides; a local shard laid out otherwise (OLMo2's attention output under
    sequence parallelism, transposed after SDPA) then fails in the local `view`. Differentiable."""
    local = x._local_tensor
    if local.is_contiguous() or not x.is_contiguous():
        return x
    return DTensor.from_local(x.to_local().contiguous(), x.device_mesh, x.placements, run_check=False,
                              shape=x.shape, stride=x.stride())


def _equal_parts(name: str, args: tuple, kwargs: dict, size: int) -> int | None:
    """Number of equal parts a split / chunk call cuts a dim of `size` into, None if they are unequal."""
    arg = args[1] if len(args) > 1 else kwargs.get("chunks", kwargs.get("split_size", kwargs.get("split_size_or_sections")))
    if name == "chunk":
        return arg if isinstance(arg, int) and size % arg == 0 else None
    if isinstance(arg, int):
        return size // arg if size % arg == 0 else None
    if isinstance(arg, (list, tuple)) and len(set(arg)) == 1 and sum(arg) == size:
        return len(arg)
    return None


def _split_fused(name: str, args: tuple, kwargs: dict):
    """Split a fused projection's output (q, k, v sharded part by part, `_StridedShard`) into its parts
    locally: each rank already holds its shard of every part. None when the call is anything else."""
    x: DTensor = args[0]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    dim %= x.ndim
    on_dim = [(i, p) for i, p in enumerate(x.placements) if p.is_shard(dim) or isinstance(p, _StridedShard)
              and p.dim == dim]
    if len(on_dim) != 1 or not isinstance(on_dim[0][1], _StridedShard):
        return None
    axis, strided = on_dim[0]
    parts = _equal_parts(name, args, kwargs, x.shape[dim])
    # compared whole, not by `split_factor`: a placement is an opaque value to Dynamo, whose only members it
    # reads are `dim` and `__eq__` (torch's _register_placements_as_opaque), so compiled blocks trace this
    if parts is None or not strided == _StridedShard(dim, split_factor=parts):  # noqa: SIM201 (no __ne__)
        return None
    placements = list(x.placements)
    placements[axis] = Shard(dim)
    shape = list(x.shape)
    shape[dim] //= parts
    return tuple(DTensor.from_local(piece, x.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                                    stride=x.stride())
                 for piece in x.to_local().chunk(parts, dim=dim))


def _check_attention_dropout(args: tuple, kwargs: dict, mesh) -> None:
    dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
    if dropout and mesh.device_type == "cpu":
        # on CPU a dropout > 0 selects the composite math kernel, which builds plain tensors inside ATen where
        # nothing can convert them (torch 2.13); CUDA's flash / efficient kernels have DTensor rules with dropout
        raise NotImplementedError(f"attention dropout {dropout} is not supported on CPU ranks: DTensor cannot "
                                  "run the math attention kernel; set the model's attention dropout to 0")


def _is_inplace(func, kwargs) -> bool:
    return "out" in kwargs or _inplace_name(getattr(func, "__name__", ""))


def _inplace_name(name: str) -> bool:
    return name[-1:] == "_" and name[-2:] != "__"


def _with_aligned_mask(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    query = args[0]
    if not isinstance(query, DTensor):
        return args, kwargs
    if "attn_mask" in kwargs:
        kwargs = {**kwargs, "attn_mask": _align_mask(kwargs["attn_mask"], query)}
    elif len(args) > 3:
        args = (*args[:3], _align_mask(args[3], query), *args[4:])
    return args, kwargs


def _grad_placement(src: Placement, grad: Placement, *, data_parallel: bool) -> Placement:
    """Placement a gradient is brought to, on one mesh dim, by the backward of `redistribute` (see there)."""
    if data_parallel:
        return grad if grad.is_partial() or grad == src else src
    if src.is_partial():
        # reduce here, where the tensor is smallest: a partial gradient of a statistic (B, S, 1) left partial
        # is expanded to (B, S, H) by the reduction's backward and reduce-scattered there. A masked partial
        # (vocabulary-parallel embedding) needs the full gradient too, and DTensor cannot produce it itself.
        return Replicate()
    return src


class _Redistribute(torch.autograd.Function):
    """`DTensor.redistribute` with the backward described in `redistribute`."""

    @staticmethod
    def forward(ctx, x: DTensor, placements: tuple[Placement, ...], dp_dims: tuple[bool, ...]) -> DTensor:
        ctx.src, ctx.dp_dims = tuple(x.placements), dp_dims
        # with equal placements DTensor returns an alias, not a view (FSDP2 warns about views it returns)
        return x.redistribute(x.device_mesh, placements)

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, DTensor):
            return grad, None, None
        want = [_grad_placement(s, g, data_parallel=dp)
                for s, g, dp in zip(ctx.src, grad.placements, ctx.dp_dims, strict=True)]
        return (grad if list(grad.placements) == want else grad.redistribute(grad.device_mesh, want)), None, None


def redistribute(x: DTensor, placements: tuple[Placement, ...]) -> DTensor:
    """`x` with `placements`, and a backward that puts the gradient where the plan expects it.

    The runtime calls this at every planned module boundary, even when the forward is a no-op, because the
    backward is what fixes the gradient's placement there:

    - tensor-parallel dims: the gradient is brought to the input's placement, a partial input's to replicated
      (a replicated input gets its partial gradient all-reduced: Megatron-LM's `f`; a sequence shard gets it
      reduce-scattered; the all-reduce of a row-parallel output has an all-reduced gradient). Without
      this, partial gradients leak into whatever the producer computes in backward (a norm written in Python)
      and DTensor reduces them wherever an op first needs it, with whatever collective it picks. A masked
      partial (vocabulary-parallel embedding output) takes its gradient back replicated, which DTensor's own
      redistribute cannot do from `Partial(sum)`.
    - the dp dim: a partial gradient stays partial. DTensor would all-reduce the dp-partial gradient of an
      activation replicated on dp (a position embedding has no batch dim) in the middle of backward, and FSDP
      would then sum the already-reduced parameter gradient again; FSDP makes the one dp reduction.
    """
    mesh_names = x.device_mesh.mesh_dim_names or ()
    return _Redistribute.apply(x, tuple(placements), tuple(n == "dp" for n in mesh_names))


def settle_masked_partial(y):
    """`y` with every `_MaskPartial` placement (a vocabulary-parallel embedding's output) turned into a plain
    `Partial()` by zeroing, locally, the rows of tokens outside this rank's vocabulary slice; anything else as is.

    DTensor applies that mask only when it reduces the tensor, and then releases it: a second reduction of the
    same output (two consumers wanting different layouts) fails, and a reduce-scatter of it is not implemented.
    Masking right away costs nothing and leaves ordinary partial sums. The gradient comes back replicated on
    those axes (the lookup's backward reads the global token ids, not the mask).
    """
    if not isinstance(y, DTensor) or not any(isinstance(p, _MaskPartial) for p in y.placements):
        return y
    grad_placements = [Replicate() if isinstance(p, _MaskPartial) else p for p in y.placements]
    local = y.to_local(grad_placements=grad_placements)
    placements = []
    for p in y.placements:
        if isinstance(p, _MaskPartial):
            mask = p.mask_buffer.data  # (local ids shape): True where the token lives on another rank
            local = local.masked_fill(mask.reshape(*mask.shape, *([1] * (local.dim() - mask.dim()))), 0.0)
            p.mask_buffer.release_mask()
            placements.append(Partial(p.reduce_op))
        else:
            placements.append(p)
    return DTensor.from_local(local, y.device_mesh, placements, run_check=False, shape=y.shape, stride=y.stride())
