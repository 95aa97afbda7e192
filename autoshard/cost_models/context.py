"""PlanContext: the fixed surroundings one plan is priced in (mesh on a cluster, micro-batch, precision).

It also answers, once per axis set, where a communication group sits on the cluster (how many of its ranks
share a node), which is what the communication cost depends on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autoshard.cost_models.comm import (
    GroupPlacement,
    collective_time_s,
    group_placement,
    p2p_time_s,
    redistribute_time_s,
)
from autoshard.cost_models.context_parallel import CP_ATTENTION
from autoshard.cost_models.float8 import FLOAT8_RECIPES
from autoshard.cost_models.memory import ALLOCATOR_FRAGMENTATION, BF16_MIXED, FP32, Precision
from autoshard.cost_models.zero_impl import ZERO_IMPLS
from autoshard.plans.layouts import MeshSpec

__all__ = ["PlanContext", "default_precision", "TP_OVERLAP"]

TP_OVERLAP = ("", "backward", "all")


def default_precision(cluster) -> Precision:
    """bf16 mixed precision on GPUs; fp32 on CPU ranks (gloo)."""
    return FP32 if cluster.gpu.device == "cpu" else BF16_MIXED


@dataclass(frozen=True, kw_only=True)
class PlanContext:
    mesh: MeshSpec
    cluster: object  # ClusterSpec (duck-typed: gpu, intra, inter, gpus_per_node, num_nodes)
    micro_batch: int
    num_microbatches: int = 1
    precision: Precision = BF16_MIXED
    recompute: str = "none"
    seq: int | None = None
    # tensor-parallel collectives overlap compute (TP_OVERLAP): "" never (the runtime's); "backward": the
    # backward ones each column-parallel linear's weight-gradient GEMM (Megatron-LM's asynchronous
    # tensor-parallel communication); "all": all of them all compute (Megatron-Core --tp-comm-overlap)
    tp_overlap: str = ""
    # pointwise ops as one fused kernel each (Megatron-LM's fused kernels, torch.compile), and the optimizer
    # step as one (FusedAdam); False: eager PyTorch, one kernel per ATen op, and torch.optim.AdamW's passes (the
    # runtime's own execution; cost_models/memory.py optimizer_step_bytes)
    fused_pointwise: bool = False
    # the cross-entropy as one fused kernel each way over 16-bit logits (flash-attn's CrossEntropyLoss,
    # llm-foundry's default); False: eager torch cross_entropy on upcast logits (the runtime's)
    fused_loss: bool = False
    # vocabulary-parallel cross-entropy: a head's output sharded over the vocabulary on tensor-parallel axes
    # stays so, and each rank computes the loss on its shard (Megatron-LM, torchtitan's loss_parallel; estimate
    # only); False: the outputs are gathered whole for the caller's loss (the runtime's)
    loss_parallel: bool = False
    # how ZeRO-3 moves parameters (cost_models/zero_impl.py ZERO_IMPLS): "fsdp2" (the runtime's) or
    # "deepspeed-2021" (DeepSpeed before its mid-2021 rewrite; estimate only)
    zero_impl: str = "fsdp2"
    # every repeated block `torch.compile`d (torchtitan's `--compile`, the runtime's `compile=True`): its
    # pointwise ops as fused kernels, its host cost per compiled graph and kernel (cost_models/host.py)
    compile: bool = False
    # pipeline stages free a chunk output once sent (True), keep it until its backward (False); None: as the
    # engine the other fields describe (`pipeline_keeps_outputs`)
    deallocate_pipeline_outputs: bool | None = None
    # float8 training of the block Linears: "" none, "tensorwise" or "rowwise" (cost_models/float8.py)
    float8: str = ""
    allocator: str = "expandable"  # PyTorch CUDA allocator mode (cost_models/memory.py ALLOCATOR_FRAGMENTATION)
    # context parallelism: `mesh` is the plan's mesh with cp folded into dp (MeshSpec.folded_cp), the graph the
    # rank-local one (seq / cp tokens), and attention's own traffic runs on the cp group, cp ranks at the
    # stride of the tensor-parallel group, by `cp_attention` (cost_models/context_parallel.py)
    cp: int = 1
    cp_attention: str = "allgather"
    cp_kv_fraction: float = 1.0  # the attention kernel's K/V the model holds (contract.kv_head_fraction)
    # expert parallelism: the experts of each MoE layer over ep consecutive ranks of the dp group; their
    # weights' data parallelism runs over the dp / ep ranks holding the same experts, and the busiest rank's
    # share of routed rows is `ep_imbalance` times the mean (None: `ep_load_imbalance` of ep and the layer's
    # experts; cost_models/expert_parallel.py)
    ep: int = 1
    ep_imbalance: float | None = None
    _cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {self.micro_batch}")
        if self.tp_overlap not in TP_OVERLAP:
            raise ValueError(f"unknown tp_overlap {self.tp_overlap!r}; use one of {TP_OVERLAP}")
        if self.zero_impl not in ZERO_IMPLS:
            raise ValueError(f"unknown zero_impl {self.zero_impl!r}; use one of {', '.join(ZERO_IMPLS)}")
        if self.allocator not in ALLOCATOR_FRAGMENTATION:
            raise ValueError(f"unknown allocator {self.allocator!r}; use one of {', '.join(ALLOCATOR_FRAGMENTATION)}")
        if self.cp < 1 or self.cp_attention not in CP_ATTENTION:
            raise ValueError(f"cp must be >= 1 and cp_attention one of {CP_ATTENTION}, got {self.cp}, "
                             f"{self.cp_attention!r}")
        if self.ep < 1 or self.mesh.degree("dp") % self.ep or (self.ep_imbalance or 1.0) < 1.0:
            raise ValueError(f"ep must divide the dp degree {self.mesh.degree('dp')} and ep_imbalance be >= 1, got "
                             f"ep={self.ep}, ep_imbalance={self.ep_imbalance}")
        if self.float8 and self.float8 not in FLOAT8_RECIPES:
            raise ValueError(f"unknown float8 recipe {self.float8!r}; use one of {', '.join(FLOAT8_RECIPES)}")
        if self.mesh.size > self.cluster.num_gpus:
            raise ValueError(f"mesh {self.mesh} needs {self.mesh.size} GPUs; the cluster has {self.cluster.num_gpus}")

    @property
    def gpu(self):
        return self.cluster.gpu

    @property
    def fragmentation(self) -> float:
        """Fraction of the memory allocated every step that the allocator holds but cannot hand out."""
        return ALLOCATOR_FRAGMENTATION[self.allocator]

    @property
    def autoshards_engine(self) -> bool:
        """The step runs on autoshard's runtime (or torchtitan's, the same parts: FSDP2 with DTensor parameters,
        DTensor tensor parallelism, torch.optim.AdamW), not on another engine's kernels that `estimate`
        prices (Megatron's fused kernels, a fused loss, DeepSpeed's ZeRO-3, overlapped tensor-parallel
        communication, ring attention): whose DTensor dispatch cost cost_models/host.py charges (FSDP's hooks and
        the optimizer's host work follow `torch_fsdp_and_optimizer`)."""
        return not (self.fused_pointwise or self.fused_loss or self.zero_impl != "fsdp2" or self.tp_overlap
                    or self.cp_attention == "ring")

    @property
    def grads_reduced_per_step(self) -> bool:
        """ZeRO-2 and -3 reduce the gradients once per step, not per micro-batch, and hold them whole in
        between: in a pipeline (degree > 1) torch.distributed.pipelining runs each stage's backward with
        `set_requires_gradient_sync(False)` and `set_reshard_after_backward(False)` and reduces only in its
        REDUCE_GRAD action after the last micro-batch (torch/distributed/pipelining/stage.py
        `backward_maybe_with_nosync`, `perform_reduce_grad`); autoshard's runtime and torchtitan stage FSDP2
        modules so. Neither reshards a stage's parameters after each forward (runtime/pipeline.py
        `_gather_once_per_step`, torchtitan's `reshard_after_forward = not pp_enabled`): ZeRO-3 gathers them
        once per step, as ZeRO-2. Measured on gloo ranks (pp 2 x dp 2, GPT-2 and Llama): one reduce-scatter
        and one all-gather per step at ZeRO-2 and -3 (tests/distributed/test_pipeline.py)."""
        return self.mesh.degree("pp") > 1

    @property
    def pipeline_keeps_outputs(self) -> bool:
        """A pipeline stage keeps each in-flight micro-batch's chunk output until its backward: torch.distributed.
        pipelining (autoshard's runtime, torchtitan; stage.py `fwd_cache`), measured (evaluate.
        `cached_chunk_outputs_bytes`). Not Megatron's schedules (`megatron_engine`): `deallocate_output_tensor`
        replaces an output's data by a scalar once it is sent, keeping only its autograd graph (Megatron-LM
        pipeline_parallel/schedules.py). `deallocate_pipeline_outputs` says it outright."""
        if self.deallocate_pipeline_outputs is not None:
            return not self.deallocate_pipeline_outputs
        return not self.megatron_engine

    @property
    def megatron_engine(self) -> bool:
        """The other fields describe Megatron's engine: its fused kernels (`--fused-kernels`) or its overlapped
        tensor-parallel collectives (`--tp-comm-overlap`), without compiled blocks (torchtitan's async TP runs
        compiled; Megatron compiles none)."""
        return (self.fused_pointwise or bool(self.tp_overlap)) and not self.compile

    def compiled(self, op) -> bool:
        """Whether `op` runs inside a compiled block (a repeated block's op under `compile`)."""
        return self.compile and op.layer is not None

    def fused(self, op) -> bool:
        """Whether `op`'s pointwise work runs as one fused kernel: Megatron's fused kernels, or a compiled block."""
        return self.fused_pointwise or self.compiled(op)

    @property
    def torch_fsdp_and_optimizer(self) -> bool:
        """The step runs PyTorch's FSDP (hooks on every module holding parameters) and a torch optimizer stepping
        tensor by tensor: autoshard's runtime, torchtitan, and engines `estimate` prices that only swap a kernel
        (llm-foundry's fused loss, on FSDP and Composer's AdamW); not Megatron's engines (their own DDP and fused
        Adam: fused kernels, overlapped tensor-parallel communication) or DeepSpeed's ZeRO-3 of 2021."""
        return not (self.fused_pointwise or self.zero_impl != "fsdp2" or self.tp_overlap)

    @property
    def on_dtensors(self) -> bool:
        """The runtime runs the ops on DTensors: with tensor-parallel axes, and in pipeline stages that span
        more than one rank (runtime/pipeline.py applies each stage in SPMD mode): `MeshSpec.on_dtensors`."""
        return self.mesh.on_dtensors

    def group(self, axes: tuple[str, ...]) -> GroupPlacement:
        """Placement of a group along `axes` (ranks row-major over the mesh, tensor-parallel innermost)."""
        key = ("group", axes)
        if key not in self._cache:
            spec = [(self.mesh.stride(a), self.mesh.degree(a)) for a in axes]
            self._cache[key] = group_placement(spec, self.cluster.gpus_per_node)
        return self._cache[key]

    def collective_s(self, collective: str, nbytes: float, axes: tuple[str, ...]) -> float:
        """Seconds of one collective over the group spanned by `axes` (memoized: the ILP asks often)."""
        return self._comm_s(collective_time_s, collective, nbytes, axes)

    def redistribute_s(self, collective: str, nbytes: float, axes: tuple[str, ...]) -> float:
        """Seconds of one tensor-parallel collective over `axes`, issued as the runtime does, through DTensor's
        `redistribute` (cost_models/comm.py `redistribute_time_s`; memoized)."""
        return self._comm_s(redistribute_time_s, collective, nbytes, axes)

    def _comm_s(self, time_s, collective: str, nbytes: float, axes: tuple[str, ...]) -> float:
        if not axes or nbytes <= 0:
            return 0.0
        key = (time_s.__name__, collective, float(nbytes), axes)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = time_s(collective, nbytes, self.group(axes), self.cluster)
        return hit

    @property
    def cp_group(self) -> GroupPlacement:
        """Placement of a cp group: cp ranks spaced by the tensor-parallel degree (cp sits just inside dp)."""
        key = ("cp_group", self.cp)
        if key not in self._cache:
            self._cache[key] = group_placement([(self.mesh.tp_degree, self.cp)], self.cluster.gpus_per_node)
        return self._cache[key]

    def cp_collective_s(self, collective: str, nbytes: float) -> float:
        """Seconds of one collective over the cp group (memoized)."""
        if self.cp == 1 or nbytes <= 0:
            return 0.0
        key = ("cp", self.cp, collective, float(nbytes))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = collective_time_s(collective, nbytes, self.cp_group, self.cluster)
        return hit

    def ep_group(self, outer: bool = False) -> GroupPlacement:
        """Placement of an ep group (ep consecutive dp ranks, at dp's stride), or with `outer` of the dp / ep
        ranks holding the same experts (at ep times dp's stride)."""
        key = ("ep_group", self.ep, outer)
        if key not in self._cache:
            stride = self.mesh.stride("dp") if "dp" in self.mesh.names else 1
            axis = (stride * self.ep, self.mesh.degree("dp") // self.ep) if outer else (stride, self.ep)
            self._cache[key] = group_placement([axis], self.cluster.gpus_per_node)
        return self._cache[key]

    def ep_collective_s(self, collective: str, nbytes: float, *, outer: bool = False) -> float:
        """Seconds of one collective over the ep group, or with `outer` over the dp / ep ranks holding the
        same experts (their weights' data parallelism; memoized)."""
        group = self.ep_group(outer)
        if group.size == 1 or nbytes <= 0:
            return 0.0
        key = ("ep", self.ep, outer, collective, float(nbytes))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = collective_time_s(collective, nbytes, group, self.cluster)
        return hit

    def cp_p2p_s(self, nbytes: float) -> float:
        """One ring step's send to the next cp rank: across nodes when the ring leaves a node."""
        same = self.mesh.tp_degree * self.cp <= self.cluster.gpus_per_node
        return p2p_time_s(nbytes, self.cluster, same_node=same)

    def p2p_s(self, nbytes: float) -> float:
        """Send between neighbouring pipeline stages (same node when pp's stride fits in one node)."""
        same = "pp" in self.mesh.names and self.mesh.stride("pp") < self.cluster.gpus_per_node
        return p2p_time_s(nbytes, self.cluster, same_node=same)

