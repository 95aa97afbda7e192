"""What each rank runs in the pipeline tests: a pipelined model against a single-process copy of itself.

Per case: build the model (same seed on every rank), keep a deep copy as the reference, run the reference on
the whole global batch (loss = mean over it, backward), parallelize the model with a hand-made pipelined plan
and run one `train_step` on this rank's slice. Every parameter this rank holds (under its original name; a
copy of a tied parameter under its own module's name) is compared with the reference's gradient; the loss
with the reference loss. Gradients of sharded parameters are gathered with `full_tensor()`: ranks of one
stage hold the same names in the same order, so the collectives match.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import replace

import torch
import torch.nn.functional as F
from adamw_bound import ATOL, AdamWBound
from dist_checks import full_named
from torch import nn

from autoshard.plans.layouts import MeshSpec
from autoshard.plans.plan import PipelineSpec, Plan

__all__ = ["build_model", "batch", "make_pipeline_plan", "pipeline_cases", "loss_fn"]

VOCAB, SEQ, HIDDEN, HEADS = 64, 8, 32, 4


def build_model(name: str, layers: int, seed: int = 0) -> nn.Module:
    """Tiny Hugging Face / zoo models with `layers` blocks, dropout off, fp32."""
    torch.manual_seed(seed)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=layers, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=SEQ,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                         eos_token_id=0)
        return GPT2LMHeadModel(cfg).train()
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                          num_key_value_heads=HEADS, intermediate_size=64, vocab_size=VOCAB,
                          max_position_embeddings=SEQ, tie_word_embeddings=False, use_cache=False,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
        return LlamaForCausalLM(cfg).train()
    if name == "gqagpt":
        from autoshard.models.small import GQAGPT

        return GQAGPT(layers=layers, hidden=HIDDEN, heads=HEADS, kv_heads=2, ffn=64, vocab=VOCAB, seq=SEQ).train()
    if name == "mlp":
        from autoshard.models.small import MLP

        return MLP(layers=layers, hidden=16, ffn=32).train()
    raise ValueError(name)


def batch(name: str, size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return torch.randn(size, 16, generator=g), torch.randn(size, 16, generator=g)
    return (torch.randint(0, VOCAB, (size, SEQ), generator=g),
            torch.randint(0, VOCAB, (size, SEQ), generator=g))


def loss_fn(out, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over tokens (language models) or mean squared error (the MLP)."""
    logits = out.logits if hasattr(out, "logits") else out
    if logits.dtype.is_floating_point and target.dtype.is_floating_point:
        return F.mse_loss(logits, target)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def make_pipeline_plan(graph, degrees: dict[str, int], family: str, *, global_batch: int, micro_batch: int,
                       schedule: str = "1f1b", virtual_stages: int = 1, zero: int = 0,
                       layered: bool | None = None) -> Plan:
    """A `dist_plans` family plan on a mesh with a pp axis, plus the pipeline: even chunks, loop placement."""
    from dist_plans import make_plan

    from autoshard.plans.plan import even_stage_layers

    mesh = MeshSpec.of(**degrees)
    plan = make_plan(graph, mesh, family, global_batch=global_batch, zero=zero)
    degree = mesh.degree("pp")
    chunks = degree * virtual_stages
    stage_layers = even_stage_layers(graph.num_layers, chunks) if chunks > 1 else ()
    layered = schedule == "looped-bfs" if layered is None else layered
    pipe = PipelineSpec(degree=degree, schedule=schedule, virtual_stages=virtual_stages,
                        stage_layers=stage_layers, layered=layered)
    return replace(plan, pipeline=pipe, micro_batch=micro_batch)


def _parallelize(model: nn.Module, case: dict, x: torch.Tensor) -> nn.Module:
    """Through `apply_pipeline_plan` / `apply_plan`, or (case["public_api"]) through `autoparallel`."""
    from autoshard.runtime.pipeline import apply_pipeline_plan, uses_pipeline

    plan = case["plan"]
    if case.get("public_api"):
        import torch.distributed as dist

        from autoshard import autoparallel

        return autoparallel(model, f"1x{dist.get_world_size()}xcpu", example_inputs=(x[:2],),
                            global_batch=case["batch"], plan=plan, graph=case["graph"], loss_fn=loss_fn)
    if uses_pipeline(plan):
        return apply_pipeline_plan(model, plan, graph=case["graph"], example_inputs=(x[:1],), loss_fn=loss_fn)
    from autoshard.runtime import apply_plan, build_device_mesh
    from autoshard.runtime.pipeline_train import attach_loss_fn

    pm = apply_plan(model, plan, graph=case["graph"], mesh=build_device_mesh(plan.mesh))
    attach_loss_fn(pm, loss_fn)
    return pm


def _max_diff(got: dict, want: dict) -> tuple[float, str]:
    worst, where = 0.0, ""
    for name, g in got.items():
        w = want[name]
        d = float("inf") if g is None or g.shape != w.shape else (g - w).abs().max().item()
        if d > worst:
            worst, where = d, name
    return worst, where


def _errors(pm: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[str]:
    """What a user gets for calling a pipelined model directly or with a batch of the wrong size (raised
    before any collective, so every rank fails alike)."""
    from autoshard.errors import ConfigurationError
    from autoshard.runtime.pipeline_train import train_step

    messages = []
    for call in (lambda: pm(x), lambda: train_step(pm, (x[:1],), y[:1])):
        try:
            call()
            messages.append("")
        except ConfigurationError as exc:
            messages.append(str(exc))
    return messages


def _grads_case(case: dict) -> dict:
    from autoshard.runtime.pipeline_train import train_step

    name = case["model"]
    model = build_model(name, case["layers"])
    ref = copy.deepcopy(model)
    x, y = batch(name, case["batch"])
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    steps = case.get("steps", 1)  # train_step accumulates into .grad like backward(): k steps, k x gradient
    ref_grads = {n: steps * p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    pm = _parallelize(model, case, x)
    lx, ly = pm.shard_inputs((x, y))
    step = pm.train_step if case.get("public_api") else lambda *a: train_step(pm, *a)
    losses = [step((lx,), ly) for _ in range(steps)]
    local_names = [n for n, _ in pm.named_parameters(remove_duplicate=False)]
    names = [n for n in ref_grads if n in set(local_names)]
    got = {n: g.detach() for n, g in full_named(pm, names, grads=True).items()}
    grad_diff, worst = _max_diff(got, ref_grads)
    out = {"case": case["id"], "loss_diff": max(abs(t.item() - ref_loss.item()) for t in losses),
           "loss_is_0dim": all(t.dim() == 0 for t in losses), "grad_diff": grad_diff, "grad_worst": worst,
           "names": names, "unknown_names": sorted(set(local_names) - set(ref_grads)),
           "all_names": sorted(ref_grads), "errors": _errors(pm, lx, ly) if case.get("errors") else []}
    if case.get("adamw"):
        out |= _adamw_steps(ref, pm, step, (x, y), (lx, ly), steps, names)
    return out


def _adamw_steps(ref, pm, step, batch_, local, steps: int, names: list[str]) -> dict:
    """Three AdamW steps on both (the gradients of the steps above first), every parameter compared after;
    the bytes this rank sends to other stages in the third step's forward and backward, and its stage."""
    from autoshard.measure.comm_check import measure_step_comm

    (x, y), (lx, ly) = batch_, local
    for p in ref.parameters():  # the parallel model accumulated `steps` steps' gradients
        p.grad = steps * p.grad
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    bound = AdamWBound(opt_ref, dict(ref.named_parameters(remove_duplicate=False)), atol=ATOL)
    comm = {}
    for i in range(3):
        if i:
            loss_fn(ref(x), y).backward()
            if i == 2:
                comm = measure_step_comm(lambda: step((lx,), ly))
            else:
                step((lx,), ly)
        opt_ref.step()
        bound.after_step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    ref_params = {n: p.detach() for n, p in ref.named_parameters(remove_duplicate=False)}
    got = {n: p.detach() for n, p in full_named(pm, names, grads=False).items()}
    param_diff, param_worst = _max_diff(got, ref_params)
    excess, excess_at = bound.excess(got, ref_params)
    pp_rank = pm.mesh.get_local_rank("pp") if "pp" in (pm.mesh.mesh_dim_names or ()) else 0
    return {"param_diff": param_diff, "param_worst": param_worst, "param_excess": excess,
            "param_excess_at": excess_at, "p2p_bytes": comm.get("p2p", 0), "stage": pp_rank}


def _gathers_case(case: dict) -> dict:
    """{collective: bytes} of a second train_step (FSDP initializes lazily in the first)."""
    from autoshard.measure.comm_check import measure_step_comm
    from autoshard.runtime.pipeline_train import train_step

    x, y = batch(case["model"], case["batch"])
    pm = _parallelize(build_model(case["model"], case["layers"]), case, x)
    lx, ly = pm.shard_inputs((x, y))
    train_step(pm, (lx,), ly)
    pm.zero_grad()
    stage = pm.mesh.get_local_rank("pp") if "pp" in (pm.mesh.mesh_dim_names or ()) else 0
    return {"case": case["id"], "comm": measure_step_comm(lambda: train_step(pm, (lx,), ly)), "stage": stage}


def _held_case(case: dict) -> dict:
    """Bytes of the chunk outputs torch.distributed.pipelining's stages keep for backward (`fwd_cache`), at
    their most during a second train_step, the last chunk's (the logits) apart: distinct storages, so a slice
    that keeps its whole base counts whole. Likewise the floating-point tensors the loss saves for backward
    (saved-tensor hooks around the schedule's loss), alive at once at their most."""
    from autoshard.runtime.pipeline_train import train_step

    x, y = batch(case["model"], case["batch"])
    pm = _parallelize(build_model(case["model"], case["layers"]), case, x)
    lx, ly = pm.shard_inputs((x, y))
    train_step(pm, (lx,), ly)
    pm.zero_grad()
    stages, peak, peak_logits = pm._autoshard_pipeline.stages, [0], [0]

    def held(last: bool) -> int:
        storages = {}
        for st in stages:
            if st.is_last != last:
                continue  # the last chunk's outputs (the logits) apart: cost_models/evaluate.py `cached_logits_bytes`
            for out, _ in st.fwd_cache.values():
                for t in out:
                    if isinstance(t, torch.Tensor):
                        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    for st in stages:
        def forward_one_chunk(*a, _orig=st.forward_one_chunk, **k):
            out = _orig(*a, **k)
            peak[0], peak_logits[0] = max(peak[0], held(False)), max(peak_logits[0], held(True))
            return out
        st.forward_one_chunk = forward_one_chunk
    schedule = pm._autoshard_pipeline.schedule
    loss_live, peak_loss = {}, [0]  # storage -> [bytes, saved tensors alive]; the most alive at once

    def release(ptr):
        entry = loss_live[ptr]
        entry[1] -= 1
        if not entry[1]:
            del loss_live[ptr]

    def pack(t):  # a floating-point tensor the loss saves for backward, alive until autograd drops it
        if t.is_floating_point():
            ptr = t.untyped_storage().data_ptr()
            loss_live.setdefault(ptr, [t.untyped_storage().nbytes(), 0])[1] += 1
            weakref.finalize(t, release, ptr)
            peak_loss[0] = max(peak_loss[0], sum(b for b, _ in loss_live.values()))
        return t

    def loss_fn(*a, _orig=schedule._loss_fn, **k):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return _orig(*a, **k)
    schedule._loss_fn = loss_fn
    train_step(pm, (lx,), ly)
    buffers = {}  # the receive buffers the stages allocated for every micro-batch, activations and gradients
    for st in stages:
        for infos in (*st.args_recv_info.values(), *st.grad_recv_info.values()):
            for info in infos:
                b = getattr(info, "buffer", None)
                if isinstance(b, torch.Tensor):
                    buffers[b.untyped_storage().data_ptr()] = b.untyped_storage().nbytes()
    return {"case": case["id"], "held_bytes": peak[0], "held_logits_bytes": peak_logits[0],
            "held_loss_bytes": peak_loss[0], "recv_buffer_bytes": sum(buffers.values()),
            "stage": pm.mesh.get_local_rank("pp")}


def pipeline_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Run every case on this rank (all ranks run the same cases in the same order)."""
    run = {"gathers": _gathers_case, "held": _held_case}
    return [run.get(c.get("kind"), _grads_case)(c) for c in cases]
