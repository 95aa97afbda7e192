"""Find repeated blocks: the children of one ModuleList whose operators match one-to-one.

Block i of a group is every operator whose module path starts with `<list path>.<i>.`; two blocks match when
their operator sequences have the same kinds, relative module paths, shapes and parameter shapes. Only a run
of matching blocks is tied; a block that differs (a different width, a cross-attention layer) stays untied.
"""

from __future__ import annotations

import re
from dataclasses import replace

from autoshard.capture.ir import BlockGroup, Op, OpKind

__all__ = ["find_blocks", "block_signature"]

_INDEXED = re.compile(r"^(?P<prefix>.*?)\.(?P<idx>\d+)(?:\.|$)")


def _block_key(path: str) -> tuple[str, int] | None:
    """('transformer.h', 3) for 'transformer.h.3.attn.c_attn'; the outermost indexed component wins."""
    m = _INDEXED.match(path)
    if m is None:
        return None
    return m.group("prefix"), int(m.group("idx"))


def _relative(name: str, prefix: str, idx: int) -> str:
    return name[len(f"{prefix}.{idx}"):]


def block_signature(ops: list[Op], prefix: str, idx: int) -> tuple:
    """What must be equal for two blocks to be tied."""
    sig = []
    for op in ops:
        sig.append((op.kind, _relative(op.name, prefix, idx), op.output_meta.shape,
                    tuple(m.shape for m in op.input_meta), tuple(p.shape for p in op.params),
                    op.fwd_flops))
    return tuple(sig)


def find_blocks(ops: tuple[Op, ...]) -> tuple[tuple[Op, ...], tuple[BlockGroup, ...]]:
    """Return the ops with `layer` set, and the block groups found."""
    members: dict[str, dict[int, list[Op]]] = {}
    types: dict[str, str] = {}
    for op in ops:
        key = _block_key(op.module_path) if op.module_path else None
        if key is None or _scalar_bookkeeping(op):
            continue
        members.setdefault(key[0], {}).setdefault(key[1], []).append(op)
    groups: list[BlockGroup] = []
    layer_of: dict[str, int] = {}
    for prefix, by_idx in members.items():
        if len(by_idx) < 2:
            continue
        indices = sorted(by_idx)
        sigs = {i: block_signature(by_idx[i], prefix, i) for i in indices}
        ref = sigs[indices[len(indices) // 2]]  # the common block type: the middle one is never an edge case
        tied = [i for i in indices if sigs[i] == ref]
        if len(tied) < 2:
            continue
        first_op = by_idx[tied[0]][0]
        types[prefix] = first_op.module_type
        groups.append(BlockGroup(name=prefix, module_type=_block_type(by_idx[tied[0]], prefix, tied[0]),
                                 op_names=tuple(tuple(op.name for op in by_idx[i]) for i in tied)))
        for i in indices:
            for op in by_idx[i]:
                layer_of[op.name] = i
    new_ops = tuple(replace(op, layer=layer_of[op.name]) if op.name in layer_of else op for op in ops)
    return new_ops, tuple(groups)


def _scalar_bookkeeping(op: Op) -> bool:
    """A 0-d index with no cost (a size torch.export computes once, in the first MoE layer that needs it): not
    part of any block's structure."""
    return op.kind is OpKind.INDEX and not op.output_meta.shape and not op.params and not op.fwd_flops


def _block_type(ops: list[Op], prefix: str, idx: int) -> str:
    """The class of the block module itself: the type of an op that sits directly in it, if any."""
    own = f"{prefix}.{idx}"
    for op in ops:
        if op.module_path == own:
            return op.module_type
    return ops[0].module_type if ops else ""
