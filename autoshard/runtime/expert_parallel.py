"""Expert parallelism on the runtime: a mixture-of-experts layer's experts split over the ranks of an ep group.

What runs (as torchtitan runs it: token dispatch and combine by all-to-all):

- `apply_expert_parallel` keeps on ep rank r only the contiguous block of experts [r·E/ep, (r+1)·E/ep) of every
  experts module (the 3-D `gate_up_proj` / `up_proj` and `down_proj`, and their biases, become parameters of
  E/ep experts), and routes the experts' forward through transformers' experts interface
  (`ALL_EXPERTS_FUNCTIONS`, registered as "autoshard_ep");
- the router, attention and everything else stay whole on every rank: an ep rank is a data-parallel rank over
  its own tokens there (ep ranks are ranks of dp; the plan's data-parallel wrappers average those gradients
  over dp);
- each experts call sorts this rank's (token, slot) pairs by the global expert they were routed to, exchanges
  the number of rows per (rank, local expert) with one all-to-all of E int64 counts, dispatches the rows to the
  ranks that hold their experts (`all_to_all_single_autograd`: its backward sends the gradients back), runs
  each local expert on the rows it received from every rank, sends the results back with a second
  all-to-all (splits reversed), and on the token's own rank weights them by the router's weights and sums the
  k slots, as transformers' own `grouped_mm` implementation does.

Gradients: every rank takes the mean loss over its own tokens and the global loss is the mean over the ranks.
The backward of the combine all-to-all delivers to an expert the gradients of every rank's loss, so an expert
weight receives the gradient of the *sum* of the ep ranks' losses; the correct one is 1/ep of that. The expert
weights therefore enter the forward through an identity whose backward scales by 1/ep. Weights outside the
experts get each rank's own gradient, and the data-parallel wrapper averages them over dp; the expert
weights are averaged by the wrapper only over the ranks outside the ep group that hold the same experts.

Models: transformers' MoE models whose experts class is decorated with `use_experts_implementation` (Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GPT-OSS, ...), with any of its layouts: gated or not, concatenated or
interleaved gate/up (the class's own `_apply_gate` reads it), transposed weights, biases, a post-expert norm.
Hidden states, router outputs and expert weights are plain tensors (no DTensor). Anything else is refused
with a clear error.
"""

from __future__ import annotations

import collections

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoshard.errors import RuntimeSetupError

__all__ = ["EP_EXPERTS_NAME", "expert_modules", "expert_parallel_blocker", "apply_expert_parallel",
           "reset_routing_counts", "routing_imbalance"]

EP_EXPERTS_NAME = "autoshard_ep"
# forward calls per experts module whose received rows are kept for `routing_imbalance` (every rank keeps the
# same calls, so they stay aligned; a long run keeps its latest)
_ROUTING_CALLS = 4096

_EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
_EXPERT_BIASES = ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale` (1/ep on the expert weights, see the
    module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _has_3d_expert_weight(m: nn.Module) -> bool:
    return any(isinstance(p, torch.Tensor) and p.dim() == 3
               for p in (m._parameters.get(n) for n in _EXPERT_WEIGHTS))


def _is_interface_experts(m: nn.Module) -> bool:
    """Set by `use_experts_implementation`'s __init__ (with `config`): its forward dispatches by
    `config._experts_implementation`."""
    return (_has_3d_expert_weight(m) and hasattr(m, "config") and hasattr(m, "has_gate")
            and hasattr(m, "_is_expert_parallel"))


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every experts module of `model` that dispatches through transformers' experts
    interface, in `named_modules` order."""
    return [(name, m) for name, m in model.named_modules() if _is_interface_experts(m)]


def _up_name(m: nn.Module) -> str:
    return "gate_up_proj" if m.has_gate else "up_proj"


def _num_experts(m: nn.Module) -> int:
    return m._parameters[_up_name(m)].shape[0]


def expert_parallel_blocker(model: nn.Module, ep: int) -> str | None:
    """Why the runtime cannot run `model` with its experts split over `ep` ranks, or None."""
    others = [name for name, m in model.named_modules() if _has_3d_expert_weight(m) and not _is_interface_experts(m)]
    if others:
        import transformers

        return (f"{others[0]} holds 3-D expert weights but does not dispatch through transformers' experts "
                f"interface (use_experts_implementation; transformers {transformers.__version__} here: expert "
                "parallelism needs transformers>=5.20, install transformers>=5.23)")
    found = expert_modules(model)
    if not found:
        return (f"{type(model).__name__} has no mixture-of-experts layer going through transformers' experts "
                "interface (an experts module with 3-D gate_up_proj / up_proj weights)")
    for name, m in found:
        if getattr(m, "_autoshard_ep", None) is not None:
            return f"{name} is already expert-parallel"
        params = [m._parameters.get(n) for n in (*_EXPERT_WEIGHTS, *_EXPERT_BIASES)]
        if any(p is not None and type(p) not in (torch.Tensor, nn.Parameter) for p in params):
            return f"{name}'s expert weights are already sharded (DTensor or another tensor subclass)"
        if m._parameters.get(_up_name(m)) is None or m._parameters.get("down_proj") is None:
            return f"{name} lacks the {_up_name(m)} or down_proj parameter its experts layout needs"
        if m.has_bias and any(m._parameters.get(f"{w}_bias") is None for w in (_up_name(m), "down_proj")):
            return f"{name} declares expert biases but lacks {_up_name(m)}_bias or down_proj_bias"
        experts = _num_experts(m)
        if experts % ep:
            return f"{name} has {experts} experts, which do not split evenly over {ep} ranks"
    return None


def _local_param(p: torch.Tensor, lo: int, hi: int) -> nn.Parameter:
    return nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad)


def apply_expert_parallel(model: nn.Module, group, ep: int, ep_rank: int, *, checkpoint_mesh=None,
                          spmd: bool = False) -> None:
    """Split `model`'s experts over `group` (ep ranks, this one `ep_rank`), in place: this rank keeps experts
    [ep_rank·E/ep, (ep_rank+1)·E/ep) of every experts module, and the experts' forward dispatches tokens to
    the ranks that hold their experts. `checkpoint_mesh`: the (edp, ep) mesh checkpoints describe all the
    experts on (runtime/checkpoint.py), kept on each experts module. `spmd`: the model runs on DTensors
    (a tensor-parallel plan): the experts take their inputs as this rank's tokens, replicated on the
    tensor-parallel axes, and hand back a DTensor laid out the same; gradients are exact global ones there
    (parallel_module._to_local), so the expert weights' are not scaled by 1/ep. ep=1 (group None) runs the
    experts locally without any collective: how a tensor-parallel plan without expert parallelism keeps its
    grouped matmuls off DTensor."""
    if ep < 1 or not 0 <= ep_rank < ep:
        raise RuntimeSetupError(f"expert parallel: ep rank {ep_rank} is not one of {ep} ranks; pass 0 <= ep_rank < ep")
    why = expert_parallel_blocker(model, ep)
    if why:
        raise RuntimeSetupError(f"expert parallel {ep}: {why}; plan with ep=1")
    _register()
    found = [m for _, m in expert_modules(model)]
    for m in found:
        experts = _num_experts(m)
        lo, hi = ep_rank * experts // ep, (ep_rank + 1) * experts // ep
        for name in (*_EXPERT_WEIGHTS, *_EXPERT_BIASES):
            p = m._parameters.get(name)
            if p is not None and p.shape[0] == experts:
                setattr(m, name, _local_param(p, lo, hi))
        m._autoshard_ep = (group, ep, ep_rank, experts)
        m._autoshard_ep_spmd = spmd
        m._autoshard_rows = collections.deque(maxlen=_ROUTING_CALLS)  # rows this rank's experts received, per call
        m._autoshard_ep_mesh = checkpoint_mesh
    configs = {id(c): c for c in [getattr(model, "config", None), *(m.config for m in found)] if c is not None}
    for config in configs.values():
        # a property on PreTrainedConfig (stored in `_experts_implementation_internal`, set on the sub-configs
        # as well); the setter does not validate the name, transformers' dispatch looks it up at each call
        config._experts_implementation = EP_EXPERTS_NAME


def reset_routing_counts(model: nn.Module) -> None:
    """Forget the rows the experts received so far (e.g. in warm-up steps)."""
    for module in model.modules():
        if hasattr(module, "_autoshard_rows"):
            module._autoshard_rows.clear()


def routing_imbalance(model: nn.Module) -> float | None:
    """The busiest ep rank's routed rows over the ep group's mean, averaged over every expert-parallel MoE
    layer's forward calls since the last `reset_routing_counts`: what the cost model's load imbalance prices
    (`estimate --ep-imbalance` takes it). None without expert parallelism. Call on every rank (one all-gather
    per experts module over its ep group); every rank gets the same value."""
    ratios = []
    for module in model.modules():
        rows = getattr(module, "_autoshard_rows", None)
        if rows is None or module._autoshard_ep[1] == 1:
            continue
        group, ep = module._autoshard_ep[0], module._autoshard_ep[1]
        device = next(module.parameters()).device  # the ranks' device: NCCL gathers device tensors only
        mine = torch.tensor(list(rows), dtype=torch.float64, device=device)
        every = [torch.empty_like(mine) for _ in range(ep)]
        torch.distributed.all_gather(every, mine, group=group)
        per_call = torch.stack(every)  # (ep ranks, calls)
        mean = per_call.mean(0)
        ratios += (per_call.max(0).values[mean > 0] / mean[mean > 0]).tolist()
    if not ratios:
        return None
    local = torch.tensor([sum(ratios), len(ratios)], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(local)  # ep groups differ across the dp / ep replicas: one figure for the job
    return float(local[0] / local[1])


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if ALL_EXPERTS_FUNCTIONS.get(EP_EXPERTS_NAME) is not _ep_experts_forward:
        ALL_EXPERTS_FUNCTIONS.register(EP_EXPERTS_NAME, _ep_experts_forward)


def _exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Even all-to-all of the (ep, E/ep) rows-per-(rank, local expert) counts: row s of the result is what
    rank s sends to each of this rank's experts. Integers, no autograd."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_to_all_single(counts.reshape(-1).contiguous(), None, None, group))


def _expert_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool):
    out = x @ weight if transposed else F.linear(x, weight)
    return out if bias is None else out + bias


def _ep_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts-interface signature: this rank's (T, H) tokens, their (T, k) global expert ids
    and routing weights; returns (T, H), the weighted sum of the k experts' outputs."""
    state = getattr(self, "_autoshard_ep", None)
    if state is None:
        raise RuntimeSetupError(f"{type(self).__name__} runs expert-parallel experts but was not set up for it; "
                                "apply the plan with apply_plan / autoparallel")
    if isinstance(hidden_states, DTensor):  # a tensor-parallel plan in SPMD mode: this rank's tokens, whole
        mesh = hidden_states.device_mesh
        placements = tuple(Shard(0) if name == "dp" else Replicate() for name in mesh.mesh_dim_names)
        local = [x.redistribute(mesh, placements).to_local() if isinstance(x, DTensor) else x
                 for x in (hidden_states, top_k_index, top_k_weights)]
        out = _experts_on_local_tokens(self, *local)
        return DTensor.from_local(out, mesh, placements, run_check=False)
    return _experts_on_local_tokens(self, hidden_states, top_k_index, top_k_weights)


def _experts_on_local_tokens(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    group, ep, _, experts = self._autoshard_ep
    local = experts // ep
    tokens, k = top_k_index.shape
    device = hidden_states.device

    # 1. (token, slot) pairs sorted by global expert: rank d's experts form the d-th contiguous run
    expert_ids = top_k_index.reshape(-1)
    order = torch.sort(expert_ids, stable=True).indices
    send = torch.bincount(expert_ids, minlength=experts).reshape(ep, local)
    # 2. how many rows every rank sends to each of this rank's experts
    recv = _exchange_counts(send, group).reshape(ep, local) if ep > 1 else send
    send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    if ep > 1:
        self._autoshard_rows.append(sum(recv_splits))  # for `routing_imbalance`
    # 3. dispatch
    rows = hidden_states[order // k]
    received = all_to_all_single_autograd(rows, recv_splits, send_splits, group) if ep > 1 else rows
    # 4. received by source rank, then local expert -> by local expert (stable: source order kept)
    local_ids = torch.arange(local, device=device).repeat(ep).repeat_interleave(recv.reshape(-1).to(device))
    by_expert = torch.sort(local_ids, stable=True).indices
    inputs = received[by_expert]
    scale = 1.0 if self._autoshard_ep_spmd else 1.0 / ep
    up_name = _up_name(self)
    up_w = _ScaleGrad.apply(getattr(self, up_name), scale)
    down_w = _ScaleGrad.apply(self.down_proj, scale)
    up_b = _ScaleGrad.apply(getattr(self, f"{up_name}_bias"), scale) if self.has_bias else None
    down_b = _ScaleGrad.apply(self.down_proj_bias, scale) if self.has_bias else None
    outs = []
    # every local expert runs, on zero rows if none came: the graph links every received row to the output
    for j, x in enumerate(inputs.split(recv.sum(0).tolist())):
        h = _expert_linear(x.to(up_w.dtype), up_w[j], None if up_b is None else up_b[j], self.is_transposed)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        outs.append(_expert_linear(h, down_w[j], None if down_b is None else down_b[j], self.is_transposed))
    out = torch.cat(outs)
    if getattr(self, "has_post_expert_norm", False):  # transformers >= 5.20
        out = self.post_expert_norm(out)
    # 5. back to source-rank order, combine, undo the sort, weight and sum the k slots
    out = out[_inverse(by_expert)]
    combined = all_to_all_single_autograd(out.contiguous(), send_splits, recv_splits, group) if ep > 1 else out
    combined = combined[_inverse(order)]
    weighted = combined * top_k_weights.reshape(-1, 1)
    return weighted.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv
