"""Ranks whose tensors live on another device than the default one, as on a GPU machine, on CPU ranks.

On a GPU machine the default device is the CPU and the ranks' tensors are on CUDA: a tensor the runtime makes
without naming its device lands on the CPU, and NCCL refuses it ("No backend type associated with device type
cpu") or an op mixing it with CUDA tensors fails. CPU ranks cannot show that, since both are the CPU. Here the
default device becomes `meta` while the ranks keep their tensors on the CPU, and every tensor factory called from
autoshard's code without a `device` fails at once with the file and line (`DefaultDeviceTensors`): the check
CI can run for "every tensor the runtime creates takes its device from the plan or its inputs".
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import autoshard

__all__ = ["ranks_off_the_default_device", "DefaultDeviceTensors"]

_PACKAGE = str(Path(autoshard.__file__).resolve().parent)
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.as_tensor, torch.arange,
              torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace, torch.eye, torch.scalar_tensor}


class DefaultDeviceTensors(RuntimeError):
    """A tensor factory was called from autoshard's code without a device."""


class _Check(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None:
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(_PACKAGE):
                line = sys._getframe(1).f_lineno
                raise DefaultDeviceTensors(f"torch.{func.__name__} without device= at {caller}:{line}: on a GPU "
                                           "it makes a CPU tensor beside the ranks' CUDA tensors")
        return func(*args, **kwargs)


@contextlib.contextmanager
def ranks_off_the_default_device():
    """Within: the default device is `meta` and autoshard's tensor factories must name their device."""
    torch.set_default_device("meta")
    try:
        with _Check():  # pushed after set_default_device's mode: sees the call before it fills in the device
            yield
    finally:
        torch.set_default_device(None)
