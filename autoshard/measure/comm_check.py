"""Count the collectives a training step really issues on this rank, with their sizes.

`CollectiveRecorder` is a `TorchDispatchMode` that sees both kinds of collectives the runtime issues:
functional collectives (`_c10d_functional.*`, what DTensor redistributions call) and c10d ops (`c10d.*`,
what FSDP2 calls directly on its process groups). `CommDebugMode` sees both too but only counts calls; the
cost model needs bytes. Backward collectives are recorded as well: autograd carries the dispatch-mode stack
into its worker threads.

Sizes are the bytes of the *full* buffer a collective works on, whatever the group size:

    all_gather      the gathered output        reduce_scatter   the input before scattering
    all_reduce      the tensor                 all_to_all       the input
    broadcast       the tensor                 p2p              the tensor sent (receives are not counted)

so a cost model turns them into traffic with its own factor ((n-1)/n for a ring, etc.; `group_size` is kept
per call for that). gloo has no all-to-all: DTensor falls back to an all-gather, recorded as what it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["CollectiveCall", "CollectiveRecorder", "measure_step_comm", "bytes_by_collective"]

_funcol = torch.ops._c10d_functional
_c10d = torch.ops.c10d

# op -> (collective kind, how to size it: "out0" first output x1, "in" input x1, "in_x_group" input x group)
_FUNCOL = {
    _funcol.all_gather_into_tensor.default: ("all_gather", "in_x_group"),
    _funcol.all_gather_into_tensor_coalesced.default: ("all_gather", "in_x_group"),
    _funcol.reduce_scatter_tensor.default: ("reduce_scatter", "in"),
    _funcol.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", "in"),
    _funcol.all_reduce.default: ("all_reduce", "in"),
    _funcol.all_reduce_coalesced.default: ("all_reduce", "in"),
    _funcol.all_to_all_single.default: ("all_to_all", "in"),
    _funcol.broadcast.default: ("broadcast", "in"),
}
_C10D = {
    _c10d._allgather_base_.default: ("all_gather", "out0"),
    _c10d.allgather_.default: ("all_gather", "out0"),
    _c10d.allgather_into_tensor_coalesced_.default: ("all_gather", "out0"),
    _c10d._reduce_scatter_base_.default: ("reduce_scatter", "in"),
    _c10d.reduce_scatter_.default: ("reduce_scatter", "in"),
    _c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", "in"),
    _c10d.allreduce_.default: ("all_reduce", "out0"),
    _c10d.allreduce_coalesced_.default: ("all_reduce", "out0"),
    _c10d.alltoall_base_.default: ("all_to_all", "in"),
    _c10d.alltoall_.default: ("all_to_all", "in"),
    _c10d.broadcast_.default: ("broadcast", "out0"),
    _c10d.send.default: ("p2p", "out0"),  # pipeline stages (torch.distributed.pipelining's isend): sends only
}


@dataclass(frozen=True)
class CollectiveCall:
    kind: str  # all_gather, reduce_scatter, all_reduce, all_to_all, broadcast, p2p
    bytes: int  # of the full buffer (see the module docstring)
    group_size: int
    op: str  # the ATen / c10d op, for debugging


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tensors) if isinstance(t, torch.Tensor))


def _funcol_group_size(func, args) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    if func in (_funcol.all_gather_into_tensor.default, _funcol.all_gather_into_tensor_coalesced.default,
                _funcol.reduce_scatter_tensor.default, _funcol.reduce_scatter_tensor_coalesced.default):
        return int(args[-2])
    return _resolve_process_group(args[-1]).size()


def _c10d_call(func, args) -> CollectiveCall:
    kind, how = _C10D[func]
    boxed = next(a for a in args if isinstance(a, torch.ScriptObject))
    size = dist.ProcessGroup.unbox(boxed).size()  # the dispatcher hands over the C++ group boxed
    if kind == "p2p":
        size = 2  # a pair of ranks, whatever group it is sent in
    nbytes = _nbytes(args[0]) if how == "out0" else _nbytes(args[1])  # outputs first, then inputs
    return CollectiveCall(kind=kind, bytes=nbytes, group_size=size, op=str(func))


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective dispatched while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CollectiveCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            # Modes run before tensor subclasses: decline, let DTensor desugar the op into local ops and
            # collectives, and see those (the trick CommDebugMode uses).
            return NotImplemented
        if func in _FUNCOL:
            kind, how = _FUNCOL[func]
            size = _funcol_group_size(func, args)
            nbytes = _nbytes(args[0]) * (size if how == "in_x_group" else 1)
            self.calls.append(CollectiveCall(kind=kind, bytes=nbytes, group_size=size, op=str(func)))
        elif func in _C10D:
            self.calls.append(_c10d_call(func, args))
        return func(*args, **kwargs)


def bytes_by_collective(calls: list[CollectiveCall], *, skip_trivial: bool = True) -> dict[str, int]:
    """{collective kind: total bytes}; groups of one rank move nothing and are skipped by default."""
    out: dict[str, int] = {}
    for c in calls:
        if skip_trivial and c.group_size == 1:
            continue
        out[c.kind] = out.get(c.kind, 0) + c.bytes
    return dict(sorted(out.items()))


def measure_step_comm(step: Callable[[], object]) -> dict[str, int]:
    """Run `step()` (e.g. forward, loss, backward and optimizer step) and return {collective: bytes} for
    this rank."""
    with CollectiveRecorder() as rec:
        step()
    return bytes_by_collective(rec.calls)
