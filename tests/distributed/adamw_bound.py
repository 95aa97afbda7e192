"""How far two AdamW runs may end apart when their gradients agree within a tolerance: the bound the
equality tests hold parameters to after three optimizer steps.

Two runs of the same model (one process, N gloo ranks) compute the same gradients up to float order: sums over
ranks, shards and micro-batches round differently. AdamW does not carry such a difference over linearly. Its
update of one element at step t is

    u_t = m̂_t / (sqrt(v̂_t) + eps),   p_t = p_{t-1} (1 - lr·wd) - lr·u_t

with m̂_t, v̂_t the bias-corrected averages of the gradient and its square. If every gradient of the two
runs differs by at most `delta`, then |Δm̂_t| <= delta and |Δ sqrt(v̂_t)| <= delta (a weighted mean, and a
weighted L2 norm, of the gradients: both 1-Lipschitz in the largest difference), and |m̂_t| <= sqrt(v̂_t)
(Cauchy-Schwarz; at the default betas within 0.2% over the first three steps), so

    |Δu_t| <= 2·delta / (sqrt(v̂_t) + eps),   and always |Δu_t| <= 2   (|u_t| <= 1 in either run).

An element whose gradient is large moves by ~lr·delta/|g| more; one whose gradient is zero (a key
projection's bias: softmax does not see a constant added to every key) turns rounding noise into a step of
±lr. A fixed tolerance on the parameters is therefore wrong in both directions: too strict where v̂ is tiny
(it failed on one CPU and passed on another for the same code: `h.3.attn.k_proj.bias 1.07e-05 <= 1e-05`),
needlessly loose where it is large. The bound per element is

    atol + sum over steps of lr · min(2, 2·delta / (sqrt(v̂_t) + eps))

with v̂_t read from the single-process run's own optimizer after each step, and delta the tolerance the
gradients themselves are held to (`atol`). Decoupled weight decay shrinks a difference (1 - lr·wd < 1), so
it adds nothing. A real error (a gradient reduced over the wrong group, a tied copy left unsynchronized, a
missed accumulation) moves parameters with non-negligible gradients by ~lr per step, far above this bound.
"""

from __future__ import annotations

import torch

__all__ = ["AdamWBound", "ATOL"]

ATOL = 1e-5  # what every equality test holds the loss and each gradient to (fp32 ranks against one process)


class AdamWBound:
    """Per-parameter, per-element bound on |p_parallel - p_reference| after AdamW steps (module docstring).

    Call `after_step()` right after each `opt_ref.step()` of the single-process optimizer; then `excess(got,
    want)` says by how much the worst element exceeds its bound (<= 0: within)."""

    def __init__(self, opt_ref: torch.optim.AdamW, named: dict[str, torch.nn.Parameter], *, atol: float) -> None:
        self.opt, self.atol = opt_ref, atol
        self.names = {id(p): n for n, p in named.items()}
        self.bound = {n: torch.full_like(p.detach(), atol) for n, p in named.items()}

    def after_step(self) -> None:
        for group in self.opt.param_groups:
            lr, eps, (_, beta2) = group["lr"], group["eps"], group["betas"]
            for p in group["params"]:
                name, state = self.names.get(id(p)), self.opt.state.get(p)
                if name is None or not state:
                    continue
                step = float(state["step"])
                v_hat = state["exp_avg_sq"] / (1 - beta2**step)
                self.bound[name] += lr * torch.clamp(2 * self.atol / (v_hat.sqrt() + eps), max=2.0)

    def excess(self, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
        """(the largest |got - want| - bound over all elements, the parameter where it is); a missing or
        misshapen parameter is +inf."""
        worst, where = -float("inf"), ""
        for name, g in got.items():
            w = want[name].detach()
            if g is None or g.shape != w.shape:
                return float("inf"), name
            over = ((g.detach() - w).abs() - self.bound[name]).max().item()
            if over > worst:
                worst, where = over, name
        return worst, where
