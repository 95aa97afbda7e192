"""OSDP operator splitting (Jiang et al. 2023): a Linear computed in S slices along its input dim.

    y = x W^T + b = sum_s x[..., K_s] W[:, K_s]^T + b          (K_s: the s-th 1/S of the input features)

Each slice's weight is a parameter of its own child module, so FSDP2 groups, gathers and frees it on its own
and a sharded (ZeRO-3) Linear never holds more than 1/S of its gathered weight. The slices are children
`slices.0 ... slices.{S-1}` of a `SplitLinear` that takes the Linear's place (same module path), which changes
the parameter names under it (`fc.weight` -> `fc.slices.s.weight`); `state_dict()` and `load_state_dict()`
keep the original key `fc.weight` through state-dict hooks, so checkpoints do not depend on the split.
The products are summed in slice order, so results match the unsplit Linear to rounding (not bit for bit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

__all__ = ["SplitLinear", "split_linear"]


class _Slice(nn.Module):
    """One slice of the weight: (out, in/S) for nn.Linear, (in/S, out) for HF Conv1D."""

    def __init__(self, weight: torch.Tensor, in_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=True)
        self.in_dim = in_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) if self.in_dim == 1 else torch.matmul(x, self.weight)


def _chunks(weight: torch.Tensor, num_splits: int, dim: int) -> list[torch.Tensor]:
    """`num_splits` copies of equal slices of `weight` along `dim` (a DTensor stays one on the same mesh).

    A DTensor is sliced through its local tensor: DTensor ops may hand back a spec holding an equal but
    different mesh object from their cache, which FSDP2's SPMD mode rejects."""
    if not isinstance(weight, DTensor):
        return [w.clone() for w in weight.chunk(num_splits, dim=dim)]
    if any(isinstance(p, Shard) and p.dim == dim for p in weight.placements):
        raise ValueError("operator splitting along a tensor-parallel-sharded input dim is not supported")
    return [DTensor.from_local(w.clone(), weight.device_mesh, weight.placements, run_check=False)
            for w in weight.to_local().chunk(num_splits, dim=dim)]


class SplitLinear(nn.Module):
    """A Linear (or HF Conv1D) computed in `num_splits` input-dim slices; `bias` stays whole."""

    def __init__(self, linear: nn.Module, num_splits: int) -> None:
        super().__init__()
        self.in_dim = 0 if type(linear).__name__ == "Conv1D" else 1
        weight = linear.weight.detach()
        if weight.shape[self.in_dim] % num_splits:
            raise ValueError(f"cannot split {type(linear).__name__} with {weight.shape[self.in_dim]} input "
                             f"features into {num_splits} equal slices; pick a split that divides it")
        self.num_splits = num_splits
        self.slices = nn.ModuleList(_Slice(w, self.in_dim) for w in _chunks(weight, num_splits, self.in_dim))
        self.bias = linear.bias
        self._register_state_dict_hook(_merge_slices)
        self._register_load_state_dict_pre_hook(_split_weight, with_module=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pieces = x.chunk(self.num_splits, dim=-1)  # (..., in/S) each
        y = self.slices[0](pieces[0])
        for piece, part in zip(pieces[1:], self.slices[1:], strict=True):
            y = y + part(piece)
        return y + self.bias if self.bias is not None else y


def _merge_slices(module: SplitLinear, state_dict: dict, prefix: str, local_metadata) -> None:
    """`prefix.slices.s.weight` -> `prefix.weight`, placed where a Linear's weight is (before its bias)."""
    keys = [f"{prefix}slices.{i}.weight" for i in range(module.num_splits)]
    if not all(k in state_dict for k in keys):
        return
    weight = torch.cat([state_dict[k] for k in keys], dim=module.in_dim)
    items, placed = [], False
    for k, v in state_dict.items():
        if k.startswith(prefix) and not placed:
            items.append((f"{prefix}weight", weight))
            placed = True
        if k not in keys:
            items.append((k, v))
    state_dict.clear()
    state_dict.update(items)


def _split_weight(module: SplitLinear, state_dict: dict, prefix: str, *args) -> None:
    key = f"{prefix}weight"
    if key in state_dict:
        for i, w in enumerate(state_dict.pop(key).chunk(module.num_splits, dim=module.in_dim)):
            state_dict[f"{prefix}slices.{i}.weight"] = w


def split_linear(model: nn.Module, path: str, num_splits: int) -> SplitLinear:
    """Replace the Linear at `path` by its `num_splits`-slice version (in place) and return it."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    split = SplitLinear(parent.get_submodule(name), num_splits)
    setattr(parent, name, split)
    return split
