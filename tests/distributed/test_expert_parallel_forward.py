"""Expert parallelism on real gloo ranks equals one process, and its all-to-alls move the bytes they should.

A tiny Mixtral (2 layers, 4 experts, top-2, fp32) with its experts split over the world (ep = world = 2 and 4,
`apply_expert_parallel`): each rank runs its own slice of the global batch, takes the mean loss over its
tokens and runs the backward; the gradients of the parameters outside the experts are then averaged over the
ranks with a plain all-reduce (standing in for the data-parallel wrapper). Against a single-process copy on the
whole batch (transformers' own experts implementation): the loss averaged over the ranks, every non-expert
gradient, and this rank's block of every expert gradient (atol 1e-5). A third case on 4 ranks keeps layer 0's
router off the last expert (in both copies), so that expert, and the whole last rank, gets no rows in that
layer and some ranks send nothing to some others: zero-row splits and a zero-row expert.

Bytes, summed over all ranks, of the all-to-alls of one forward and backward (`CollectiveRecorder`, which
counts an all-to-all's input): per MoE layer the (token, slot) rows cross four times (dispatch and combine,
forward and backward), T·k rows of H fp32 values each, plus one count exchange per rank in the forward
(E int64 values): 4·T·k·H·4·layers + ep·E·8·layers. `routing_imbalance` (the busiest rank's received rows over
the mean, averaged over the layers) against the same figure counted from the reference's routing of the batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist_harness import run_world

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning")]

ATOL = 1e-5
BATCH, SEQ, VOCAB, HIDDEN, LAYERS, EXPERTS, TOP_K = 4, 8, 128, 32, 2, 4, 2


def _tiny_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, vocab_size=VOCAB, num_local_experts=EXPERTS,
                        num_experts_per_tok=TOP_K, max_position_embeddings=SEQ, tie_word_embeddings=False,
                        use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0, dtype=torch.float32)
    return MixtralForCausalLM(cfg).float().train()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _starve_last_expert(model) -> None:
    """Layer 0's router sends what it routes to the last expert to expert 0 instead: that expert (and on 4
    ranks its whole rank) receives no rows, and some ranks send none to some others."""
    def hook(module, args, out):
        logits, weights, index = out
        return logits, weights, index.masked_fill(index == EXPERTS - 1, 0)

    model.model.layers[0].mlp.gate.register_forward_hook(hook)


def _ep_step(rank: int, world: int, starve: bool) -> dict:
    """One forward and backward with the experts split over the world; diffs against one process."""
    import torch.distributed as dist

    from autoshard.measure.comm_check import CollectiveRecorder, bytes_by_collective
    from autoshard.runtime.expert_parallel import (
        EP_EXPERTS_NAME,
        apply_expert_parallel,
        expert_modules,
        routing_imbalance,
    )

    model = _tiny_mixtral()
    ref = copy.deepcopy(model)
    if starve:
        _starve_last_expert(model)
        _starve_last_expert(ref)
    routed = []  # the reference's routing of the whole batch, per layer: what the ep ranks receive between them
    for layer in ref.model.layers:
        layer.mlp.gate.register_forward_hook(lambda module, args, out: routed.append(out[2].reshape(-1)))
    x, y = _batch()
    ref_loss = _loss(ref, x, y)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    apply_expert_parallel(model, dist.group.WORLD, ep=world, ep_rank=rank)
    assert model.config._experts_implementation == EP_EXPERTS_NAME
    assert ref.config._experts_implementation != EP_EXPERTS_NAME
    expert_names = {f"{path}.{n}" for path, m in expert_modules(model) for n, _ in m.named_parameters()}
    assert len(expert_names) == 2 * LAYERS

    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    with CollectiveRecorder() as rec:
        loss = _loss(model, x[rows], y[rows])
        loss.backward()
    for n, p in model.named_parameters():  # the data-parallel wrapper's job, outside the experts
        if n not in expert_names:
            dist.all_reduce(p.grad)
            p.grad /= world
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)

    lo, hi = rank * EXPERTS // world, (rank + 1) * EXPERTS // world
    grad_diff, worst = 0.0, ""
    for n, p in model.named_parameters():
        want = ref_grads[n][lo:hi] if n in expert_names else ref_grads[n]
        assert p.shape == want.shape, (n, p.shape, want.shape)
        d = (p.grad - want).abs().max().item()
        if d > grad_diff:
            grad_diff, worst = d, n
    calls = [c for c in rec.calls if c.kind == "all_to_all"]
    per_rank = [torch.bincount(index, minlength=EXPERTS).reshape(world, -1).sum(1).double() for index in routed]
    want_imbalance = sum(float(c.max() / c.mean()) for c in per_rank) / len(per_rank)
    return {"loss_diff": abs(mean_loss.item() / world - ref_loss.item()), "grad_diff": grad_diff, "worst": worst,
            "a2a_bytes": bytes_by_collective(rec.calls).get("all_to_all", 0), "a2a_calls": len(calls),
            "other_kinds": sorted({c.kind for c in rec.calls} - {"all_to_all"}),
            "expert_shapes": sorted({tuple(m.gate_up_proj.shape) for _, m in expert_modules(model)}),
            "last_expert_grad_layer0": model.model.layers[0].mlp.experts.gate_up_proj.grad[-1].abs().max().item(),
            "imbalance": routing_imbalance(model), "want_imbalance": want_imbalance}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("ep", "starve"), [(2, False), (4, False), (4, True)], ids=["ep2", "ep4", "ep4-starved"])
def test_expert_parallel_loss_gradients_and_all_to_all_bytes_match_single_process(ep, starve):
    results = run_world(_ep_step, ep, starve, timeout_s=240)
    tokens = BATCH * SEQ
    want_bytes = 4 * tokens * TOP_K * HIDDEN * 4 * LAYERS + ep * EXPERTS * 8 * LAYERS
    for rank, r in enumerate(results):
        print(f"ep={ep} rank {rank}: loss {r['loss_diff']:.1e} grad {r['grad_diff']:.1e} ({r['worst']}) "
              f"all_to_all {r['a2a_bytes']} B in {r['a2a_calls']} calls")
        assert r["loss_diff"] <= ATOL
        assert r["grad_diff"] <= ATOL, r["worst"]
        assert r["expert_shapes"] == [(EXPERTS // ep, 2 * 64, HIDDEN)]
        assert r["a2a_calls"] == 5 * LAYERS  # per layer: counts, dispatch and combine, and their two backwards
        assert r["other_kinds"] == []
        # the busiest rank's received rows over the mean, per layer, averaged: from the reference's routing
        assert r["imbalance"] == pytest.approx(r["want_imbalance"]), (r["imbalance"], r["want_imbalance"])
        assert 1.0 <= r["imbalance"] <= ep
    if starve:  # the last rank holds the last expert, which ran on zero rows: a zero gradient, not None
        assert results[-1]["last_expert_grad_layer0"] == 0.0
    assert sum(r["a2a_bytes"] for r in results) == want_bytes


def test_expert_parallel_refuses_what_it_cannot_split():
    from transformers import LlamaConfig, LlamaForCausalLM

    from autoshard.errors import RuntimeSetupError
    from autoshard.runtime.expert_parallel import (
        apply_expert_parallel,
        expert_modules,
        expert_parallel_blocker,
    )

    model = _tiny_mixtral()
    assert [p for p, _ in expert_modules(model)] == [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
    assert expert_parallel_blocker(model, 2) is None
    assert "do not split evenly over 3 ranks" in expert_parallel_blocker(model, 3)
    with pytest.raises(RuntimeSetupError, match="plan with ep=1"):
        apply_expert_parallel(model, None, ep=3, ep_rank=0)
    dense = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=HIDDEN, num_attention_heads=4,
                                         intermediate_size=64, vocab_size=VOCAB))
    assert "no mixture-of-experts layer" in expert_parallel_blocker(dense, 2)
