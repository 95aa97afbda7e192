"""The AdamW bound the equality tests hold parameters to (adamw_bound.py), on two single-process runs of a
tiny model whose gradients differ as the parallel runs' do: by float order, or by a real error."""

from __future__ import annotations

import copy

import torch
from adamw_bound import ATOL, AdamWBound
from torch import nn


def _three_steps(perturb) -> tuple[float, float]:
    """Three AdamW steps (lr 1e-3, eps 1e-6, as the equality tests run them) of a Linear and its copy on the
    same batches; `perturb(step, copy)` alters the copy's gradients before its step. Returns (the largest
    parameter difference, its largest excess over the bound)."""
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    par = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-3, eps=1e-6)
    bound = AdamWBound(opt_ref, dict(ref.named_parameters()), atol=ATOL)
    for step in range(3):
        x = torch.randn(4, 8)
        for model in (ref, par):
            model(x).pow(2).mean().backward()
            # a bias whose gradient is zero up to rounding, as a key projection's bias under softmax
            model.bias.grad = torch.randn(8) * 1e-7
        perturb(step, par)
        opt_ref.step()
        bound.after_step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    got, want = dict(par.named_parameters()), dict(ref.named_parameters())
    diff = max((got[n] - want[n]).abs().max().item() for n in got)
    return diff, bound.excess(got, want)[0]


def test_rounding_noise_on_a_zero_gradient_stays_within_the_bound_where_a_fixed_tolerance_fails():
    def rounding(step: int, par: nn.Module) -> None:
        par.weight.grad += torch.randn_like(par.weight.grad) * 1e-8  # summed in another order

    diff, excess = _three_steps(rounding)
    assert diff > ATOL  # AdamW turned 1e-7 of noise on the bias into a step of lr in either direction
    assert excess <= 0


def test_a_gradient_of_the_wrong_batch_in_a_later_step_exceeds_the_bound():
    def stale(step: int, par: nn.Module) -> None:
        if step == 1:  # e.g. a gradient not zeroed, or not synchronized, after the first step
            par.weight.grad = par.weight.grad + torch.randn_like(par.weight.grad) * par.weight.grad.abs().mean()

    _, excess = _three_steps(stale)
    assert excess > 0
