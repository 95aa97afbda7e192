"""A view of a DTensor whose local tensor is laid out otherwise than its global strides say (a gradient a
transposed kernel made) reads the right elements: runtime/dtensor_ext.py's dispatch handler for `view` and
`_unsafe_view`, which autograd's backward of a matmul's reshape calls below SPMDMode."""

from __future__ import annotations

import pytest
import torch


def _transposed_local_dtensor():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (1,))
    values = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    local = values.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strides (12, 1, 3)
    assert not local.is_contiguous()
    x = DTensor.from_local(local, mesh, [Replicate()], run_check=False, shape=values.shape, stride=values.stride())
    return values, x


@pytest.mark.parametrize("op", ["view", "_unsafe_view"])
def test_view_of_a_dtensor_with_a_transposed_local_tensor_keeps_its_values(one_rank, op):
    from autoshard.runtime.dtensor_ext import register_dtensor_rules

    register_dtensor_rules()
    values, x = _transposed_local_dtensor()
    assert x.is_contiguous()  # what its global strides say
    out = getattr(torch.ops.aten, op).default(x, [6, 4])
    assert torch.equal(out.full_tensor(), values.view(6, 4))


def test_backward_through_a_reshape_gets_a_gradient_laid_out_as_its_global_strides(one_rank):
    """The failure the handler fixes: the gradient reaching UnsafeViewBackward (a 3-D input's matmul) is a
    DTensor whose local tensor is transposed."""
    from torch.distributed.tensor import DTensor

    from autoshard.runtime.dtensor_ext import register_dtensor_rules

    register_dtensor_rules()
    values, grad = _transposed_local_dtensor()
    x = DTensor.from_local(torch.randn(6, 4), grad.device_mesh, grad.placements, run_check=False)
    x.requires_grad_(True)
    torch.ops.aten._unsafe_view.default(x, [2, 3, 4]).backward(grad)
    assert torch.equal(x.grad.full_tensor(), values.view(6, 4))
