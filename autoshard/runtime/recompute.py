"""Activation recomputation as the plan says (`Plan.recompute`), per repeated block, as torchtitan applies it.

    full        every block's forward runs under `torch.utils.checkpoint` (non-reentrant): only the block's
                inputs are kept, the whole block runs again in backward
    selective   the same checkpoint with a selective policy (`create_selective_checkpoint_contexts`): outputs
                of the ops that are expensive to recompute are kept, the cheap ones recomputed in backward.
                With materialized attention scores (eager attention) the recomputed ops are exactly those
                producing score-shaped tensors (QK^T, scale, mask, softmax, dropout): Korthikanti et al. 2022's
                selective recompute. With a fused attention kernel there are no scores to drop; the policy is
                then torchtitan's "op" selective AC: keep the attention kernel's output and every other matmul's
                output, recompute the rest (norms, activations, rotary, the other matmuls).

The cost model prices the same policies (cost_models/opcost.py). The block's `forward` is replaced on the instance,
so parameter names and module paths stay as they were (a `checkpoint_wrapper` would prefix them).
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autoshard.plans.plan import Plan

__all__ = ["apply_recompute", "block_paths"]

_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")  # the outermost indexed component of a module path, as data_parallel.py
_aten = torch.ops.aten
_MM = {_aten.mm.default, _aten.addmm.default}
# fused attention kernels whose outputs torchtitan's op-level policy keeps
_ATTENTION = {getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu") if hasattr(_aten, name)}


def block_paths(plan: Plan, model: nn.Module) -> list[str]:
    """Module paths of the model's repeated blocks that the plan's ops live in, in order."""
    modules = dict(model.named_modules())
    paths = {m.group(1) for p in plan.ops if p.layer is not None and (m := _BLOCK.match(p.module))}
    return sorted((p for p in paths if p in modules), key=lambda p: [int(x) if x.isdigit() else x
                                                                        for x in p.split(".")])


def _op_level_policy():
    """torchtitan's op-level selective AC: keep fused attention and every other matmul, recompute the rest."""
    meta: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if func in _MM:
            meta[key] += 1
        keep = func in _ATTENTION or (func in _MM and meta[key] % 2 == 1)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _score_policy(seq: int):
    """Korthikanti's selective recompute: recompute what produces a (..., seq, seq) score tensor."""

    def policy(ctx, func, *args, **kwargs):
        if _is_view(func) or ctx_out_is_scores(func, args, seq):
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return create_selective_checkpoint_contexts(policy)


def _is_view(func) -> bool:
    """Views cost nothing to recompute and are not saved: on DTensors a saved view was handed back in
    recomputation for another view of a different shape (Bloom's fused q/k/v, GPT-J's rotary slice under
    dp x tp with selective recompute: "not enough values to unpack")."""
    return getattr(func, "is_view", False) or func in (_aten._unsafe_view.default, _aten.alias.default)


def ctx_out_is_scores(func, args, seq: int) -> bool:
    """Does `func` produce attention scores? Judged from its first tensor argument's and its own shape: a
    batched matmul of (…, seq, d) by (…, d, seq), or a pointwise / softmax op on a (…, seq, seq) tensor."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        return False
    x = tensors[0]
    if x.dim() >= 4 and x.shape[-1] == seq and x.shape[-2] == seq:
        return True
    if func in (_aten.bmm.default, _aten.matmul.default, _aten.mm.default) and len(tensors) >= 2:
        y = tensors[1]
        return x.dim() >= 3 and x.shape[-2] == seq and y.shape[-1] == seq
    return False


def _checkpointed(forward, context_fn):
    """`forward` under a checkpoint whose recomputation (in backward, outside the model's forward) runs in
    the same function mode as the forward did: on a tensor-parallel mesh the model's code runs under
    `SPMDMode`, which lifts plain tensors (rotary tables, masks) to DTensors; without it the recomputed block
    mixes the two and fails."""
    from autoshard.runtime.dtensor_ext import SPMDMode

    def in_spmd(*args, **kwargs):
        if _spmd_active():
            return forward(*args, **kwargs)
        with SPMDMode():
            return forward(*args, **kwargs)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        fn = in_spmd if _spmd_active() else forward
        policy = {} if context_fn is None else {"context_fn": context_fn}
        return checkpoint(fn, *args, use_reentrant=False, **policy, **kwargs)

    return run


def _spmd_active() -> bool:
    from torch.overrides import _get_current_function_mode_stack

    from autoshard.runtime.dtensor_ext import SPMDMode

    return any(isinstance(m, SPMDMode) for m in _get_current_function_mode_stack())


def apply_recompute(model: nn.Module, plan: Plan, *, scores: bool) -> int:
    """Checkpoint every repeated block of `model` as `plan.recompute` says (module docstring); `scores`: the
    model materializes attention scores (eager attention). Returns the number of blocks wrapped."""
    if plan.recompute == "none":
        return 0
    if plan.recompute == "full":
        context_fn = None  # checkpoint's own default: a compiled block's checkpoint traces with no other
    elif scores and plan.seq:
        context_fn = functools.partial(_score_policy, plan.seq)
    else:
        context_fn = _op_level_policy
    paths = block_paths(plan, model)
    for path in paths:
        block = model.get_submodule(path)
        block.forward = _checkpointed(block.forward, context_fn)
    return len(paths)
