"""`autoshard measure PLAN.json`: run a plan on the ranks of this job and time its training steps.

Every rank builds the plan's model with random weights (seed 0; dropout off, since the synthetic data is not
learned and the runtime keeps models with dropout on DTensors), applies the plan with `autoparallel`, and runs
`warmup` untimed then `steps` timed steps of synthetic data: token ids for language models, pixels or features
otherwise, a fresh global batch per step (the same on every rank; each rank takes its slice). A step is what a
training loop does: `train_step` (forward, loss and backward of the plan's micro-batches), `optimizer.step()`
(AdamW, as the cost model's optimizer step assumes) and `zero_grad()`.

Timing: a barrier, then the step on every rank with a wall clock around it (CUDA synchronized on GPUs); the
step's time is the slowest rank's (all ranks finish the step before the next barrier anyway). The result is
the median over the timed steps, with min / max / interquartile range so a noisy machine shows as such, beside
the plan's own prediction and its breakdown.

`trace`: one more step under torch.profiler after the timed ones, summarized into a JSON file: the step's wall
time, the host time PyTorch recorded, the device kernels (how many, their summed time, so how busy the device
was) and the ops and kernels that took longest, on host and device. A step whose device is far from busy is
bound by its host: the question the summary answers first.

Memory (GPUs): the caching allocator's peak allocated and peak reserved bytes over the whole run, the largest
over the ranks, beside the plan's predicted peak. Reserved is what an out-of-memory error sees: allocated plus
the allocator's cached and fragmented blocks.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoshard.errors import ConfigurationError, RuntimeSetupError
from autoshard.plans.plan import Plan

__all__ = ["StepTimes", "MeasuredPlan", "measure_plan", "model_ref", "synthetic_batch", "training_loss",
           "trace_summary"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class StepTimes:
    """Seconds of each timed step (the slowest rank's), in order."""

    steps_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.steps_s:
            raise ValueError("StepTimes needs at least one timed step")

    @property
    def median_s(self) -> float:
        return statistics.median(self.steps_s)

    @property
    def iqr_s(self) -> float:
        if len(self.steps_s) < 4:
            return max(self.steps_s) - min(self.steps_s)
        q = statistics.quantiles(self.steps_s, n=4)
        return q[2] - q[0]

    def to_json(self) -> dict:
        return {"median_s": self.median_s, "min_s": min(self.steps_s), "max_s": max(self.steps_s),
                "iqr_s": self.iqr_s, "steps_s": list(self.steps_s)}


@dataclass(frozen=True, kw_only=True)
class MeasuredPlan:
    """A plan's measured step beside its prediction. `train_step` and `optimizer` split the step."""

    model: str
    cluster: str
    mesh: str
    world_size: int
    step: StepTimes
    train_step: StepTimes  # forward + loss + backward of every micro-batch (incl. its communication)
    optimizer: StepTimes  # optimizer.step() + zero_grad()
    predicted_s: float | None
    predicted_breakdown_s: dict[str, float] | None
    # expert parallelism: the busiest ep rank's routed rows over the mean, averaged over the MoE layers' calls in
    # the timed steps (runtime/expert_parallel.py `routing_imbalance`); None without EP
    routing_imbalance: float | None = None
    # GPUs: the allocator's peaks over the run, the largest rank's; None on CPU ranks
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    predicted_memory_bytes: float | None = None
    # the training loss of every step, warm-up included (the mean over the job's ranks): a float8 plan's against
    # its 16-bit twin's (validation/gpu_check.py)
    losses: tuple[float, ...] = ()

    @property
    def error_pct(self) -> float | None:
        """(predicted - measured) / measured, in percent: negative when the prediction is too fast."""
        if self.predicted_s is None:
            return None
        return (self.predicted_s - self.step.median_s) / self.step.median_s * 100

    def to_json(self) -> dict:
        d = asdict(self)
        for key in ("step", "train_step", "optimizer"):
            d[key] = getattr(self, key).to_json()
        d["error_pct"] = self.error_pct
        return d


def model_ref(plan: Plan) -> tuple[str, int | None]:
    """(model reference load_model takes, sequence override) of a plan: `name@seqN` names a zoo or spec model
    captured at another sequence length."""
    ref, _, seq = plan.model.partition("@seq")
    return ref, (int(seq) if seq.isdigit() else None)


def synthetic_batch(loaded, global_batch: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one global batch, the same on every rank: random token ids (targets: other random
    ids) for language models, standard-normal pixels or features (targets: standard normal) otherwise."""
    g = torch.Generator().manual_seed(1000 + step)
    (example,) = loaded.example_inputs(global_batch, device="cpu")[:1]
    if example.dtype == torch.long:
        vocab = loaded.spec.vocab if loaded.spec is not None else int(loaded.module.config.vocab_size)
        x = torch.randint(0, vocab, tuple(example.shape), generator=g, device="cpu")
        y = torch.randint(0, vocab, tuple(example.shape), generator=g, device="cpu")
    else:
        x = torch.randn(tuple(example.shape), generator=g, device="cpu")
        y = torch.randn(tuple(example.shape[:1]), generator=g, device="cpu")
    return x.to(device), y.to(device)


def training_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits against token ids; for other outputs the mean square against the target's rows
    (a synthetic loss: what matters for timing is one backward through every output)."""
    logits = output.logits if hasattr(output, "logits") else output
    if isinstance(logits, tuple):
        logits = logits[0]
    if target.dtype == torch.long and logits.dim() == target.dim() + 1:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
    return (logits.float().flatten(1).mean(1) - target.float()).pow(2).mean()


def _build(plan: Plan, device: torch.device, seed: int):
    from autoshard.models import load_model

    ref, seq = model_ref(plan)
    torch.manual_seed(seed)
    loaded = load_model(ref, seq=seq, device=str(device))
    for module in loaded.module.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(loaded.module, "config", None)
    for attr in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout_prob",
                 "attention_probs_dropout_prob", "hidden_dropout", "dropout"):
        if config is not None and isinstance(getattr(config, attr, None), float):
            setattr(config, attr, 0.0)
    return loaded


def _cluster_of(plan: Plan, cluster):
    """The job's cluster: the one given, else the plan's; a plan made on a cluster file that is not at hand
    (its text names the file's GPU and links) runs as CPU ranks or GPUs, whichever this job has."""
    from autoshard.errors import ClusterSpecError
    from autoshard.hardware_profiles import ClusterSpec

    if isinstance(cluster, ClusterSpec):
        return cluster
    try:
        return ClusterSpec.parse(cluster or plan.cluster)
    except ClusterSpecError:
        if cluster is not None:
            raise
        world = dist.get_world_size() if dist.is_initialized() else plan.mesh.size
        return ClusterSpec.parse(f"1x{world}xcpu") if not torch.cuda.is_available() else \
            ClusterSpec.parse(f"1x{world}xH100-80GB")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(times: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def _memory_peaks(device: torch.device) -> tuple[int | None, int | None]:
    """(peak allocated, peak reserved) bytes of the CUDA caching allocator, the largest over the ranks."""
    if device.type != "cuda":
        return None, None
    peaks = [float(torch.cuda.max_memory_allocated(device)), float(torch.cuda.max_memory_reserved(device))]
    return tuple(int(v) for v in _slowest(peaks, device))


def _device_for(spec) -> torch.device:
    if spec.gpu.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeSetupError(f"the plan runs on {spec.gpu.name} GPUs but this machine has no CUDA device "
                                f"(torch {torch.__version__}); run it on GPUs, or on CPU ranks with "
                                "--cluster 1xNxcpu (N = the plan's ranks)")
    return torch.device("cuda", torch.cuda.current_device())


def measure_plan(plan: Plan, *, cluster=None, steps: int = 10, warmup: int = 3, seed: int = 0,
                 progress=None, trace=None) -> MeasuredPlan:
    """Apply `plan` on this job's ranks and time `steps` training steps after `warmup` (module docstring).
    Call on every rank under torchrun; every rank returns the same result. `cluster` defaults to the plan's.
    `trace`: a path rank 0 writes one more step's profiler summary to (`trace_summary`)."""
    from autoshard.runtime.entry import autoparallel
    from autoshard.runtime.expert_parallel import reset_routing_counts, routing_imbalance

    if steps < 1 or warmup < 0:
        raise ConfigurationError(f"measure needs steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    spec = _cluster_of(plan, cluster)
    device = _device_for(spec)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    loaded = _build(plan, device, seed)
    example = tuple(x.to(device) for x in loaded.example_inputs(2, device="cpu"))
    pm = autoparallel(loaded.module, spec, example_inputs=example, global_batch=plan.global_batch, plan=plan,
                      loss_fn=training_loss)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    step_t, fb_t, opt_t, losses = [], [], [], []
    for i in range(warmup + steps):
        inputs, target = pm.shard_inputs(synthetic_batch(loaded, plan.global_batch, i, device))
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        loss = pm.train_step((inputs,), target)
        _sync(device)
        t1 = time.perf_counter()
        losses.append(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        t2 = time.perf_counter()
        if i + 1 == warmup:
            reset_routing_counts(pm)
        if i >= warmup:
            step_t.append(t2 - t0)
            fb_t.append(t1 - t0)
            opt_t.append(t2 - t1)
        if progress is not None:
            progress(i + 1, warmup + steps)
    if trace is not None:
        summary = _traced_step(pm, opt, synthetic_batch(loaded, plan.global_batch, warmup + steps, device), device)
        if dist.get_rank() == 0:
            import json
            from pathlib import Path

            Path(trace).write_text(json.dumps(summary, indent=1) + "\n")
    pred = plan.prediction
    imbalance = routing_imbalance(pm) if plan.ep > 1 else None
    allocated, reserved = _memory_peaks(device)
    return MeasuredPlan(model=plan.model, cluster=str(spec), mesh=str(plan.mesh), world_size=dist.get_world_size(),
                        step=StepTimes(steps_s=tuple(_slowest(step_t, device))),
                        train_step=StepTimes(steps_s=tuple(_slowest(fb_t, device))),
                        optimizer=StepTimes(steps_s=tuple(_slowest(opt_t, device))),
                        predicted_s=pred.iteration_time_s if pred else None,
                        predicted_breakdown_s=pred.time.seconds() if pred else None, routing_imbalance=imbalance,
                        peak_allocated_bytes=allocated, peak_reserved_bytes=reserved,
                        predicted_memory_bytes=pred.memory.total_bytes if pred else None,
                        losses=tuple(float(x) for x in losses))  # read after timing: .item() syncs


TRACE_TOP = 25  # ops and kernels listed in a trace summary, each by host and by device time


def _traced_step(pm, opt, batch, device: torch.device) -> dict:
    """One training step under torch.profiler (CPU, and CUDA on GPUs), summarized (`trace_summary`)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    inputs, target = pm.shard_inputs(batch)
    dist.barrier()
    _sync(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        pm.train_step((inputs,), target)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        wall = time.perf_counter() - t0
    return trace_summary(prof, wall)


def trace_summary(prof, wall_s: float) -> dict:
    """What a profiled step spent: wall seconds; the device's kernels (count, summed seconds, busy fraction of the
    wall); the top ops by host time (self) and the top kernels by device time."""
    kernels = [e for e in prof.events() if e.device_type != torch.autograd.DeviceType.CPU]
    device_s = sum(e.device_time for e in kernels) * 1e-6  # microseconds
    by_key = prof.key_averages()
    host = sorted(by_key, key=lambda e: e.self_cpu_time_total, reverse=True)[:TRACE_TOP]
    kernel_totals: dict[str, list[float]] = {}
    for e in kernels:
        entry = kernel_totals.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.device_time * 1e-6
    top_kernels = sorted(kernel_totals.items(), key=lambda kv: kv[1][1], reverse=True)[:TRACE_TOP]
    return {"wall_s": wall_s, "device_kernels": len(kernels), "device_kernel_s": device_s,
            "device_busy_fraction": device_s / wall_s if kernels else None,
            "host_events": sum(e.count for e in by_key),  # ops at every nesting level, as the profiler records
            "top_host_ops": [{"name": e.key, "calls": e.count, "self_host_s": e.self_cpu_time_total * 1e-6}
                             for e in host],
            "top_kernels": [{"name": name[:200], "calls": n, "device_s": t} for name, (n, t) in top_kernels]}
