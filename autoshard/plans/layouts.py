"""Meshes and layouts on named axes: the vocabulary plans are written in.

A `MeshSpec` names its axes outermost first: `pp` (pipeline stages), `dp` (data parallel), `cp` (context
parallel: each rank of a cp group holds a part of every sequence), and the tensor-parallel axes `tp` (1D),
`tp_r, tp_c` (2D) or `tp_x, tp_y, tp_z` (3D). Ranks are laid out row-major over the
axes, so the last axis is the fastest-varying one: tensor-parallel groups sit inside a node, as in Megatron-LM.

A `Layout` gives, for each non-pipeline axis, the placement of one activation tensor, in DTensor's vocabulary
with *semantic* dims, so a plan reads the same for (B, S, H) and (B, nh, S, hd) tensors:

    R        replicated                      S(batch)  sharded on the batch dim
    P        partial sums, to be reduced     S(seq)    sharded on the sequence dim
                                             S(feat)   sharded on the feature dim (hidden, heads, vocab)

A parameter's placement per axis is R, S(out) (its output-feature dim: a column-parallel Linear, a
statistics-parallel norm's weight) or S(in) (its input dim: a row-parallel Linear, a vocabulary-parallel
embedding). The runtime maps semantic dims to tensor dims; the planner never does.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

__all__ = [
    "AXIS_NAMES", "TP_AXES", "ACT_PLACEMENTS", "PARAM_PLACEMENTS", "MeshSpec", "Layout", "layout",
    "REPLICATE", "PARTIAL", "BATCH", "SEQ", "FEAT", "OUT", "IN",
]

TP_AXES = ("tp", "tp_r", "tp_c", "tp_x", "tp_y", "tp_z")
AXIS_NAMES = ("pp", "dp", "cp", *TP_AXES)

REPLICATE, PARTIAL = "R", "P"
BATCH, SEQ, FEAT = "S(batch)", "S(seq)", "S(feat)"
OUT, IN = "S(out)", "S(in)"
ACT_PLACEMENTS = (REPLICATE, PARTIAL, BATCH, SEQ, FEAT)
PARAM_PLACEMENTS = (REPLICATE, OUT, IN)


@dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """Named axes with their degrees, outermost first; the product is the number of GPUs used."""

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        names = [a for a, _ in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axes must be distinct, got {names}")
        for name, degree in self.axes:
            if name not in AXIS_NAMES:
                raise ValueError(f"unknown mesh axis {name!r}; allowed: {', '.join(AXIS_NAMES)}")
            if not isinstance(degree, int) or degree < 1:
                raise ValueError(f"mesh axis {name} needs a positive integer degree, got {degree!r}")
        order = [AXIS_NAMES.index(n) for n in names]
        if order != sorted(order):
            raise ValueError(f"mesh axes must be ordered {', '.join(AXIS_NAMES)} (outermost first), got {names}")

    @classmethod
    def of(cls, **degrees: int) -> MeshSpec:
        """MeshSpec.of(dp=4, tp=2): axes in canonical order, degree-1 axes kept only for pp/dp."""
        axes = tuple((n, degrees[n]) for n in AXIS_NAMES if n in degrees)
        unknown = set(degrees) - set(AXIS_NAMES)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; allowed: {', '.join(AXIS_NAMES)}")
        return cls(axes=axes)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.axes)

    @property
    def size(self) -> int:
        return math.prod(d for _, d in self.axes)

    def degree(self, axis: str) -> int:
        return self._degrees.get(axis, 1)

    @functools.cached_property
    def _degrees(self) -> dict[str, int]:  # asked hundreds of thousands of times per search
        return dict(self.axes)

    @functools.cached_property
    def tp_axes(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.axes if a in TP_AXES)

    @functools.cached_property
    def spmd_signature(self) -> tuple:
        """What per-operator strategies, kernel times and tensor-parallel redistributions depend on: the
        tensor-parallel axes and degrees (innermost, so their groups sit the same whatever pp and dp are) and
        whether there is a dp axis; not the pipeline or data-parallel degree."""
        return (tuple((a, d) for a, d in self.axes if a in TP_AXES), "dp" in self.names, self.degree("dp") > 1)

    @property
    def on_dtensors(self) -> bool:
        """Whether the runtime runs the blocks on DTensors: tensor-parallel axes, or pipeline stages of more than
        one rank (runtime/pipeline.py); else on plain tensors (data parallelism and ZeRO as torchtitan runs FSDP2)."""
        pp = self.degree("pp")
        return bool(self.tp_axes) or (pp > 1 and self.size // pp > 1)

    @property
    def tp_degree(self) -> int:
        return math.prod(self.degree(a) for a in self.tp_axes)

    def folded_cp(self) -> MeshSpec:
        """The mesh a context-parallel plan is priced on: cp folded into dp. Outside attention a cp rank is a
        data-parallel rank over a part of each sequence (same parameters, its own tokens, gradients summed over
        dp x cp, as torchtitan shards FSDP over dp x cp), and with cp just inside dp the ranks of a
        dp x cp group are the ranks of this mesh's dp group. Attention's own traffic is priced apart
        (`PlanContext.cp`, cost_models/context_parallel.py)."""
        cp = self.degree("cp")
        if cp == 1:
            return MeshSpec(axes=tuple((a, d) for a, d in self.axes if a != "cp"))
        return MeshSpec.of(**{a: d for a, d in self.axes if a not in ("dp", "cp")}, dp=self.degree("dp") * cp)

    @property
    def spmd_axes(self) -> tuple[str, ...]:
        """Axes inside one pipeline stage (everything but pp)."""
        return tuple(a for a, _ in self.axes if a != "pp")

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours along `axis` (row-major layout, last axis fastest)."""
        s = 1
        for name, d in reversed(self.axes):
            if name == axis:
                return s
            s *= d
        raise KeyError(axis)

    def __str__(self) -> str:
        return " x ".join(f"{n}={d}" for n, d in self.axes)

    def to_json(self) -> list:
        return [[n, d] for n, d in self.axes]

    @classmethod
    def from_json(cls, data: list) -> MeshSpec:
        return cls(axes=tuple((str(n), int(d)) for n, d in data))


@dataclass(frozen=True)
class Layout:
    """Placement per mesh axis; axes not listed are replicated."""

    items: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for axis, pl in self.items:
            if axis not in AXIS_NAMES or axis == "pp":
                raise ValueError(f"layout axis {axis!r} is not a data/tensor-parallel axis")
            if pl not in ACT_PLACEMENTS and pl not in PARAM_PLACEMENTS:
                raise ValueError(f"unknown placement {pl!r} on {axis}")

    def get(self, axis: str) -> str:
        for a, p in self.items:
            if a == axis:
                return p
        return REPLICATE

    def shard_degree(self, mesh: MeshSpec) -> int:
        """How many pieces the tensor is cut into (partial sums are full-size)."""
        return math.prod(mesh.degree(a) for a, p in self.items if p.startswith("S("))

    def with_(self, axis: str, placement: str) -> Layout:
        rest = tuple((a, p) for a, p in self.items if a != axis)
        items = rest if placement == REPLICATE else (*rest, (axis, placement))
        return Layout(tuple(sorted(items, key=lambda ap: AXIS_NAMES.index(ap[0]))))

    def __str__(self) -> str:
        return ",".join(f"{a}:{p}" for a, p in self.items) or "R"

    def to_json(self) -> dict:
        return dict(self.items)

    @classmethod
    def from_json(cls, data: dict) -> Layout:
        return layout(**data)


def layout(**placements: str) -> Layout:
    """layout(dp=BATCH, tp=FEAT); replicated axes may be omitted."""
    items = [(a, p) for a, p in placements.items() if p != REPLICATE]
    return Layout(tuple(sorted(items, key=lambda ap: AXIS_NAMES.index(ap[0]))))
