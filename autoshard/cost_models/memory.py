"""Memory per GPU: model states by precision and ZeRO stage, activations, fixed framework overhead.

Pure functions of element counts; the planner decides how many elements each GPU holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.capture.ir import DTYPE_BYTES, TensorMeta

__all__ = [
    "Precision", "BF16_MIXED", "FP32", "PRECISIONS", "model_state_bytes", "tensor_bytes",
    "framework_overhead_bytes", "CUDA_CONTEXT_GIB", "NCCL_PER_GROUP_GIB", "optimizer_step_bytes",
    "ALLOCATOR_FRAGMENTATION", "ALLOCATORS", "loss_buffer_bytes", "OPTIMIZER_PASSES",
]

GIB = float(1 << 30)
# CUDA context with lazy module loading (CUDA >= 11.7): ~300 MB (pytorch/pytorch#107667, ptrblck).
CUDA_CONTEXT_GIB = 0.3
# NCCL communicator buffers on A100: 544 MB for a 2-rank group, 688 MB for larger ones (NVIDIA/nccl#964).
NCCL_PER_GROUP_GIB = 0.65
# Memory the allocator holds but cannot hand out, as a fraction of what is allocated and freed every step
# (activations, gathered parameters, the loss's buffers), by PyTorch allocator mode:
# - "caching" (the default PYTORCH_CUDA_ALLOC_CONF): blocks split for one size cannot serve another. GMLake
#   (Guo et al., ASPLOS 2024) measures the fragmentation it removes in LLM training on A100-80GB at 15% on
#   average (up to 33%); torchtune #1185 measures 16.4 -> 10.8 GiB peak reserved with expandable segments.
# - "expandable" (expandable_segments:True; torchtitan's launcher sets it, and so does autoshard's runtime on
#   CUDA): segments grow page by page, so freed memory serves any size. What remains is the separate pool of
#   the communication stream, which the memory model counts as transient buffers (two gathered units).
#   Check: torchtitan ran Llama 2 13B without recompute at local batch 2 on A100-80GB (docs/performance.md),
#   which fits only with a few percent of slack. Against it: on one H200 (benchmarks/gpu_validation.md,
#   `autoshard measure` with expandable segments) the peak reserved was 16-25% above the peak allocated in all 11
#   plans, the excess about 4 bytes per parameter plus a part growing with the micro-batch, while the predicted
#   memory matched the allocated peak within +0.3% to +3.8% in 9 of 11. What holds the excess (the model built
#   on the GPU in fp32 before FSDP2 copies it into shards, or the pools of FSDP2's streams) is not established,
#   so it is not priced; `estimate` and `plan` caution where it could exceed the GPU (planner/envelope.py
#   `memory_warnings`).
ALLOCATOR_FRAGMENTATION = {"caching": 0.15, "expandable": 0.0}
ALLOCATORS = tuple(ALLOCATOR_FRAGMENTATION)


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes per element of each kind of state under a training precision."""

    name: str
    act_bytes: int  # floating-point activations
    param_bytes: int  # working copy of the parameters
    grad_bytes: int  # gradients as autograd computes them (the working copy's dtype)
    master_bytes: int  # fp32 master parameters (0 when the working copy is fp32)
    optim_bytes: int  # optimizer states (Adam: m and v in fp32)
    reduce_bytes: int = 4  # gradients as reduced over dp, accumulated across micro-batches and stepped on

    @property
    def main_grad_bytes(self) -> int:
        """A gradient as the fp32 parameter holds it and the optimizer reads it: FSDP2 casts each reduced shard
        to the sharded parameter's dtype (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py
        `foreach_reduce`); Megatron keeps an fp32 main_grad."""
        return self.master_bytes or self.grad_bytes

    @property
    def state_bytes_per_param(self) -> int:
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.optim_bytes


# Mixed-precision Adam: 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter (Rajbhandari et al. 2020, ZeRO §3).
# Gradients are reduced in fp32 (reduce_bytes 4): what autoshard's runtime runs on GPUs and torchtitan's default,
# FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) (torchtitan `mixed_precision_reduce`,
# runtime/precision.py): each unit's bf16 gradients are cast to fp32 before the reduce-scatter / all-reduce, the
# fp32 shard is accumulated into the fp32 sharded parameter's gradient, and AdamW reads it. Megatron-LM does the
# same for bf16 (its fp32 main_grad buffer: `accumulate_allreduce_grads_in_fp32` is forced on with --bf16).
BF16_MIXED = Precision(name="bf16-mixed", act_bytes=2, param_bytes=2, grad_bytes=2, master_bytes=4, optim_bytes=8)
FP32 = Precision(name="fp32", act_bytes=4, param_bytes=4, grad_bytes=4, master_bytes=0, optim_bytes=8)
# DeepSpeed's and Megatron-LM's fp16 engines: 16-bit gradients, reduced and held in 16 bits (the published memory
# figures of ZeRO and Korthikanti et al. count them so)
BF16_MIXED_16BIT_GRADS = Precision(name="bf16-mixed-16bit-grads", act_bytes=2, param_bytes=2, grad_bytes=2,
                                   master_bytes=4, optim_bytes=8, reduce_bytes=2)
PRECISIONS = {p.name: p for p in (BF16_MIXED, FP32, BF16_MIXED_16BIT_GRADS)}


def model_state_bytes(numel: float, precision: Precision, *, zero: int, dp: int) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer states incl. master copy) bytes on one GPU for `numel` local params.

    ZeRO stage 1 shards the optimizer states over the `dp` ranks, stage 2 the gradients too, stage 3 the
    parameters too (ZeRO §5). Gradients are held in the reduce dtype (`reduce_bytes`): with 16-bit ones, as
    DeepSpeed and Megatron's fp16 engine hold them (`BF16_MIXED_16BIT_GRADS`), 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and
    16Ψ/N bytes with mixed-precision Adam, the ZeRO paper's figures. autoshard's runtime (FSDP2 with
    `MixedPrecisionPolicy(reduce_dtype=float32)`, runtime/precision.py) holds them in fp32: the full sum across
    micro-batches at stages 0-1 (`unsharded_accumulated_grad`, and ZeRO-0's replicated fp32 gradient), the fp32
    shard at 2-3: 18Ψ, 6Ψ + 12Ψ/N, 2Ψ + 16Ψ/N, 18Ψ/N (ZeRO-3 holds no 16-bit shard between uses, so 16Ψ/N
    there; the 2Ψ/N is left in, on the safe side).
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {zero}")
    p = numel * precision.param_bytes
    g = numel * precision.reduce_bytes
    o = numel * (precision.master_bytes + precision.optim_bytes)
    if zero >= 1:
        o /= dp
    if zero >= 2:
        g /= dp
    if zero >= 3:
        p /= dp
    return p, g, o


def tensor_bytes(meta: TensorMeta, precision: Precision, *, samples: float = 1.0) -> float:
    """Bytes of an activation for `samples` samples: floating point at the training precision (a 16-bit model's
    float32 upcasts at 4), the rest as is."""
    if meta.wide:
        per_elem = 4
    else:
        per_elem = precision.act_bytes if meta.dtype.startswith(("float", "bfloat")) else DTYPE_BYTES[meta.dtype]
    batch_scale = samples if meta.batch_dims else 1.0
    return meta.numel * per_elem * batch_scale


def framework_overhead_bytes(num_groups: int) -> float:
    """CUDA context plus NCCL buffers of each process group this rank belongs to."""
    return (CUDA_CONTEXT_GIB + NCCL_PER_GROUP_GIB * max(0, num_groups)) * GIB


def loss_buffer_bytes(logits_numel: float, *, fused: bool = False, act_bytes: int = 2) -> float:
    """Bytes the cross-entropy loss over `logits_numel` logits holds at the start of backward.

    Eager (`torch.nn.functional.cross_entropy` on upcast logits: torchtitan, Hugging Face, autoshard's runtime):
    three fp32 logit-sized tensors, the log-probabilities log_softmax saves, the gradient nll_loss returns and
    the gradient log_softmax returns. Llama 3 8B at 16k tokens per GPU: 23.5 GiB.
    Fused (`fused`: one kernel each way over the `act_bytes` logits, flash-attn's CrossEntropyLoss, which
    llm-foundry runs by default as loss_fn "fused_crossentropy"): the kernel keeps the logits and a log-sum-exp
    per row, and its backward writes the gradient at the logits' precision: two logit-sized tensors
    (flash_attn/ops/triton/cross_entropy.py)."""
    if fused:
        return logits_numel * 2 * act_bytes
    return logits_numel * 3 * 4


def loss_saved_bytes(logits_numel: float, rows: float, *, fused: bool = False) -> float:
    """Bytes the cross-entropy over `logits_numel` logits (`rows` tokens) keeps for its backward from its forward
    on: eager, the fp32 log-probabilities log_softmax saves (nll_loss saves the same tensor, and its fp32
    `total_weight` scalar; the upcast saves nothing: measured to the byte on gloo ranks,
    tests/distributed/test_pipeline.py); fused, a log-sum-exp per row (the kernel's other saved tensor is the
    logits themselves, `evaluate.cached_logits_bytes`)."""
    return rows * 4 if fused else logits_numel * 4 + 4


# Kernels per optimizer step (per chunk of tensors): torch.optim.AdamW's eight passes, or one fused kernel.
OPTIMIZER_PASSES = {False: 8, True: 1}


def optimizer_step_bytes(numel: float, precision: Precision, *, fused: bool = False) -> float:
    """HBM traffic of one AdamW step over `numel` local parameters.

    fused (apex / Transformer Engine FusedAdam: Megatron-LM, Megatron-Core, DeepSpeed): one kernel reads the
    gradient, the 16-bit parameter, the master copy and both moments and writes all but the gradient.

    Otherwise torch.optim.AdamW as it runs by default, which is what autoshard's runtime (measure/step.py) and
    torchtitan step with: `_multi_tensor_adam` on GPUs, `_single_tensor_adam` on CPUs, the same eight passes
    (torch/optim/adam.py, the non-capturable path): the weight decay's mul_ on the parameter (read, write),
    lerp_ of the first moment towards the gradient (3), mul_ of the second moment (2), its addcmul_ with the
    gradient (3, the gradient read once), sqrt of it into a temporary (2), div_ and add_ of the temporary (2 + 2)
    and addcdiv_ of the parameter (4): 4 accesses of the parameter (its fp32 master copy where there is one;
    the 16-bit copy is cast again when it is next gathered or used), 2 of the gradient, 3 + 5 of the moments
    and 6 of the temporary, in the moments' dtype. About 2.5x the fused kernel's bytes (80 against 32 per
    parameter in bf16 mixed precision, with the fp32 gradient the fp32 parameter holds)."""
    if fused:
        return numel * (precision.main_grad_bytes + 2 * (precision.param_bytes + precision.master_bytes
                                                          + precision.optim_bytes))
    param = precision.master_bytes or precision.param_bytes
    moment = precision.optim_bytes / 2  # Adam's m and v
    return numel * (4 * param + 2 * precision.main_grad_bytes + (3 + 5 + 6) * moment)
