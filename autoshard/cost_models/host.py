"""Host time of eager PyTorch on a GPU, and when the GPU waits for it.

A GPU runs the kernels its host issues, in order. Eager PyTorch issues them one ATen op at a time: Python, the
dispatcher, autograd's bookkeeping and the launch cost the host `GPUProfile.host_us_per_op` each (views too:
no kernel, but the same trip through the dispatcher and autograd). The host runs ahead of the GPU while kernels
take longer than issuing them, and the GPU idles where they take less: a phase takes the longer of its kernels'
time and its host time. Small models and small micro-batches are bound by the host (GPT-2 small at 1,024
tokens: ~1,500 ops of 15 us against ~3 ms of kernels a micro-batch); large ones never are.

The phases are a micro-batch's forward and its backward (recompute included), and the optimizer step: the
host cannot run ahead across phases by more than the launch queue holds, so one phase's slack does not hide
the next one's host time (`max` per phase, evaluate.py). Per phase the host time is

    forward    dispatches x (host_us_per_op + dtensor_us_per_op on DTensors) + half the FSDP2 hooks
    backward   BACKWARD_DISPATCHES x that + the other half of the hooks (+ the forward again where recomputed)
    optimizer  parameter tensors x optimizer_us_per_tensor  (torch.optim.AdamW's per-tensor work)

Compiled blocks (`torch.compile` of each repeated block, `PlanContext.compile`) issue no ATen ops one by one:
the block's forward and its backward each run as one compiled graph, whose Python wrapper checks its guards
and launches the generated kernels (one per fused region and per extern GEMM or attention call; views are free):

    compiled phase   COMPILED_GRAPH_US + kernels x COMPILED_US_PER_KERNEL   per block, forward and backward

Only on GPU profiles: on CPU ranks the host is the device and its costs are device time already (opcost.py).
The datasheet GPU profiles carry the H200 host's figures (references/gpu_h200.md). DTensor's dispatch is a cost of
autoshard's runtime (and torchtitan's, the same parts; `PlanContext.autoshards_engine`); FSDP's hooks and the
optimizer's per-tensor work are paid by every engine that runs PyTorch's FSDP and a torch optimizer (llm-foundry
too), not by Megatron's engines or DeepSpeed's ZeRO-3 of 2021 (`PlanContext.torch_fsdp_and_optimizer`).
"""

from __future__ import annotations

from autoshard.hardware_profiles.profiles import GPUProfile

__all__ = ["BACKWARD_DISPATCHES", "COMPILED_GRAPH_US", "COMPILED_US_PER_KERNEL", "compiled_host_s", "separate_host", "forward_host_s", "hooks_host_s", "optimizer_host_s"]

# ATen ops autograd dispatches in backward per op dispatched in forward (kernels and views): counted with a
# TorchDispatchMode over forward and backward of transformers 5.24's GPT-2 (83 kernels + 95 views forward, 136 +
# 195 backward: 1.86) and Llama (161 + 171, 298 + 308: 1.83), 4 layers each, torch 2.13 (2026-11-28). A Linear
# has two gradient GEMMs for one forward GEMM; a view's gradient is a view.
BACKWARD_DISPATCHES = 1.85

# Host cost of Inductor's generated code, from meta-pytorch/tritonbench PR #1017 (2026-04-14, GB200 host): a
# compiled graph's end-to-end call (guards, DeviceGuard, the CompiledFxGraph wrapper, one no-op kernel) took
# 44.3 us, each further kernel launched through `CachingAutotuner.run` 6.8-9.1 us (0 and 19 arguments): the
# 19-argument figure per kernel, the rest (44.3 - 9.1) per graph.
COMPILED_US_PER_KERNEL = 9.1
COMPILED_GRAPH_US = 35.2


def separate_host(gpu: GPUProfile) -> bool:
    """Whether `gpu`'s host is a processor of its own, which runs ahead of the device and which the device may
    wait for (a GPU); on CPU ranks the host is the device."""
    return gpu.device != "cpu"


def forward_host_s(dispatches: int, gpu: GPUProfile, *, on_dtensors: bool) -> float:
    """Host seconds to issue `dispatches` ATen ops in forward; backward issues BACKWARD_DISPATCHES times that."""
    per_op = gpu.host_us_per_op + (gpu.dtensor_us_per_op if on_dtensors else 0.0)
    return dispatches * per_op * 1e-6


def compiled_host_s(kernels: float, graphs: float = 0.0) -> float:
    """Host seconds of `graphs` compiled graph calls launching `kernels` generated kernels in all."""
    return (graphs * COMPILED_GRAPH_US + kernels * COMPILED_US_PER_KERNEL) * 1e-6


def hooks_host_s(gpu: GPUProfile) -> float:
    """Host seconds of FSDP2's hooks on one module holding parameters, per forward + backward (half each)."""
    return gpu.fsdp_us_per_module * 1e-6


def optimizer_host_s(param_tensors: int, gpu: GPUProfile) -> float:
    """Host seconds of one AdamW step over `param_tensors` tensors (its per-tensor work: lists, foreach groups)."""
    return param_tensors * gpu.optimizer_us_per_tensor * 1e-6
