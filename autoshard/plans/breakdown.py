"""Result records of the cost model: where the time of one iteration goes, and the memory of one GPU."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["MemoryBreakdown", "TimeBreakdown", "GIB"]

GIB = float(1 << 30)


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Peak bytes on the most loaded GPU, by kind."""

    params_bytes: float = 0.0
    grads_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    activations_bytes: float = 0.0
    transient_bytes: float = 0.0  # gathered weights, communication buffers, the largest live gradient
    other_bytes: float = 0.0  # framework overhead: CUDA context, allocator fragmentation

    @property
    def total_bytes(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def gib(self) -> dict[str, float]:
        out = {f.name.removesuffix("_bytes").replace("optimizer", "optimizer"): getattr(self, f.name) / GIB
               for f in fields(self)}
        out["total"] = self.total_bytes / GIB
        return out

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        return MemoryBreakdown(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


@dataclass(frozen=True, kw_only=True)
class TimeBreakdown:
    """Seconds of one training iteration on the critical path, by cause."""

    compute_s: float = 0.0  # forward, backward and recompute kernels
    host_bound_s: float = 0.0  # the GPU idle while its host issues kernels that take less time than that
    exposed_comm_s: float = 0.0  # communication not hidden behind compute
    bubble_s: float = 0.0  # pipeline fill and drain
    optimizer_s: float = 0.0  # optimizer step
    overhead_s: float = 0.0  # kernel launches and other fixed per-iteration costs

    @property
    def total_s(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def seconds(self) -> dict[str, float]:
        return {k.removesuffix("_s"): v for k, v in asdict(self).items()}
