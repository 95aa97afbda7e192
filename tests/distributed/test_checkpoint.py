"""Checkpoints across plans and world sizes, bit for bit, and atomic saves (issue 7).

Tiny GPT-2 (2 layers, hidden 64, tied LM head) trained two AdamW steps, then:
(a) saved under Megatron 1D TP on 4 ranks, loaded under ZeRO-3 on 2 ranks;
(b) saved under DP on 2 ranks, loaded under Optimus 2D (tp_r x tp_c = 2 x 2) on 4 ranks, after a second save
    to the same path failed on rank 1 mid-write;
(c) saved under context parallel 2 with ZeRO-3 on 2 ranks, loaded under dp 2 x cp 2 on 4 ranks (issue 16);
(d) a tiny Mixtral saved under expert parallel 2 over dp 4 with ZeRO-3 on 4 ranks (each expert's weights in
    two FSDP shards), loaded under ep 2 = dp 2 and under plain data parallelism (no EP) on 2 ranks, and under
    dp 2 x ep 2 x tp 2 on 4 ranks (the experts replicated on tp);
(e) the same Mixtral saved under dp 2 x ep 2 x tp 2 (every tp rank holds its ep block: saved once), loaded
    under ep 2 = dp 2 on 2 ranks.
The loading runs build the model with other weights, so only the checkpoint can make them equal. Three
worlds (4, 2, then 4 ranks) run in sequence; the single-process tests below need no process group.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from dist_ckpt import BATCH, run_cases
from dist_harness import run_world
from dist_models import SEQ, build, example_batch
from dist_plans import make_cp_plan, make_ep_plan, make_plan

from autoshard.errors import CheckpointError
from autoshard.plans.layouts import MeshSpec
from autoshard.runtime.checkpoint import export_state_dict, load_checkpoint, save_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

MODEL = "gpt2"
ADAM_STATE = ["exp_avg", "exp_avg_sq", "step"]


@functools.cache
def _graph(seq: int = SEQ):
    from autoshard.capture import capture

    x, _ = example_batch(MODEL, 2)
    return capture(build(MODEL), (x[:, :seq],))


def _cp_plan(dp: int, cp: int, zero: int = 0):
    return make_cp_plan(_graph(), _graph(SEQ // cp), dp=dp, cp=cp, family="replicate", global_batch=BATCH, zero=zero)


@functools.cache
def _moe_graph():
    from autoshard.capture import capture

    x, _ = example_batch("mixtral", 2)
    return capture(build("mixtral"), (x,))


def _ep_tp_plan():
    """dp 2 x ep 2 x tp 2 as `estimate --dp 2 --ep 2 --tp 2` writes it."""
    from autoshard.hardware_profiles.cluster import ClusterSpec
    from autoshard.planner.estimate import HandConfig, estimate

    plan, _ = estimate(_moe_graph(), ClusterSpec.parse("1x4xcpu"),
                       HandConfig(global_batch=BATCH, micro_batch=1, dp=2, ep=2, tp=2))
    return plan


def _plan(family: str, zero: int = 0, **degrees: int):
    return make_plan(_graph(), MeshSpec.of(**degrees), family, global_batch=BATCH, zero=zero)


@functools.cache
def _runs(tmp: str) -> dict:
    """Per case: rank 0's result. (a) 4 -> 2 ranks, (b) 2 -> 4 ranks, in three worlds."""
    tp4, dp2, cp2 = os.path.join(tmp, "tp4"), os.path.join(tmp, "dp2"), os.path.join(tmp, "cp2")
    base = {"model": MODEL, "steps": 2}
    a_save = {**base, "check": "save", "plan": _plan("megatron", tp=4), "path": tp4}
    a_load = {**base, "check": "load", "plan": _plan("replicate", zero=3, dp=2), "path": tp4}
    b_save = {**base, "check": "interrupted", "plan": _plan("replicate", dp=2), "path": dp2, "failing_rank": 1}
    b_load = {**base, "check": "load", "plan": _plan("2d", tp_r=2, tp_c=2), "path": dp2}
    c_save = {**base, "check": "save", "plan": _cp_plan(1, 2, zero=3), "path": cp2}
    c_load = {**base, "check": "load", "plan": _cp_plan(2, 2), "path": cp2}
    ep2 = os.path.join(tmp, "ep2")
    moe = {"model": "mixtral", "steps": 2, "path": ep2}
    d_save = {**moe, "check": "save", "plan": make_ep_plan(_moe_graph(), dp=4, ep=2, global_batch=BATCH, zero=3)}
    d_load_ep = {**moe, "check": "load", "plan": make_ep_plan(_moe_graph(), dp=2, ep=2, global_batch=BATCH)}
    d_load_dp = {**moe, "check": "load", "plan": make_ep_plan(_moe_graph(), dp=2, ep=1, global_batch=BATCH)}
    d_load_tp = {**moe, "check": "load", "plan": _ep_tp_plan()}
    ep2tp2 = {"model": "mixtral", "steps": 2, "path": os.path.join(tmp, "ep2tp2")}
    e_save = {**ep2tp2, "check": "save", "plan": _ep_tp_plan()}
    e_load = {**ep2tp2, "check": "load", "plan": make_ep_plan(_moe_graph(), dp=2, ep=2, global_batch=BATCH)}
    (a_saved, d_saved, e_saved), *_ = run_world(run_cases, 4, [a_save, d_save, e_save], timeout_s=300)
    (a_loaded, b_interrupted, c_saved, d_loaded_ep, d_loaded_dp, e_loaded), *others = run_world(
        run_cases, 2, [a_load, b_save, c_save, d_load_ep, d_load_dp, e_load], timeout_s=300)
    (b_loaded, c_loaded, d_loaded_tp), *_ = run_world(run_cases, 4, [b_load, c_load, d_load_tp], timeout_s=300)
    return {"a_saved": a_saved, "a_loaded": a_loaded, "b": b_interrupted, "b_rank1": others[0][1],
            "b_loaded": b_loaded, "tp4": tp4, "dp2": dp2, "c_saved": c_saved, "c_loaded": c_loaded,
            "d_saved": d_saved, "d_loaded_ep": d_loaded_ep, "d_loaded_dp": d_loaded_dp,
            "d_loaded_tp": d_loaded_tp, "e_saved": e_saved, "e_loaded": e_loaded}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return _runs(str(tmp_path_factory.mktemp("ckpt")))


def _assert_bitwise_equal(got: dict, want: dict) -> None:
    assert sorted(got["params"]) == sorted(want["params"])
    for name, tensor in want["params"].items():
        assert torch.equal(got["params"][name], tensor), name
    assert sorted(got["optim"]) == sorted(want["params"])  # every parameter has AdamW state
    for name, state in want["optim"].items():
        assert sorted(state) == ADAM_STATE
        for key in ADAM_STATE:
            assert torch.equal(got["optim"][name][key], state[key]), (name, key)


@pytest.mark.timeout(420)
def test_megatron_tp4_checkpoint_loads_bitwise_under_zero3_on_two_ranks(runs):
    saved, loaded = runs["a_saved"], runs["a_loaded"]
    assert saved["optim"]["transformer.wte.weight"]["step"].item() == 2
    assert not torch.equal(loaded["before"]["params"]["transformer.wte.weight"],
                           saved["params"]["transformer.wte.weight"])
    _assert_bitwise_equal(loaded["after"], saved)


@pytest.mark.timeout(420)
def test_dp_checkpoint_loads_bitwise_under_2d_on_four_ranks(runs):
    saved = runs["b"]["saved"]
    assert not torch.equal(runs["b_loaded"]["before"]["params"]["transformer.h.0.mlp.c_fc.weight"],
                           saved["params"]["transformer.h.0.mlp.c_fc.weight"])
    _assert_bitwise_equal(runs["b_loaded"]["after"], saved)


@pytest.mark.timeout(420)
def test_context_parallel_checkpoint_loads_bitwise_under_another_cp_and_dp(runs):
    saved, loaded = runs["c_saved"], runs["c_loaded"]
    assert saved["optim"]["transformer.wte.weight"]["step"].item() == 2
    assert not torch.equal(loaded["before"]["params"]["transformer.h.0.mlp.c_fc.weight"],
                           saved["params"]["transformer.h.0.mlp.c_fc.weight"])
    _assert_bitwise_equal(loaded["after"], saved)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("saved, loaded", [("d_saved", "d_loaded_ep"), ("d_saved", "d_loaded_dp"),
                                           ("d_saved", "d_loaded_tp"), ("e_saved", "e_loaded")])
def test_expert_parallel_checkpoint_loads_bitwise_under_another_ep_with_or_without_tp(runs, saved, loaded):
    saved, after = runs[saved], runs[loaded]
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert saved["params"][name].shape[0] == 4  # all four experts, gathered from two ep ranks' blocks
    assert saved["optim"][name]["step"].item() == 2
    assert not torch.equal(after["before"]["params"][name], saved["params"][name])
    _assert_bitwise_equal(after["after"], saved)


@pytest.mark.timeout(420)
def test_save_failing_on_one_rank_mid_write_leaves_the_previous_checkpoint_loadable(runs):
    for result in (runs["b"], runs["b_rank1"]):
        assert result["error"].startswith(f"saving checkpoint {runs['dp2']} failed on rank 1 (OSError: [Errno 28] "
                                          "No space left on device (simulated))")
        assert result["link_kept"]
        assert len(result["leftovers"]) == 1 and result["leftovers"][0].startswith("dp2.tmp-")
        assert "is not a complete autoshard checkpoint" in result["junk_error"]
    _assert_bitwise_equal(runs["b"]["loaded"], runs["b"]["saved"])


@pytest.mark.timeout(420)
def test_export_gives_a_plain_state_dict_the_unparallelized_model_loads(runs):
    state = export_state_dict(runs["tp4"])
    model = build(MODEL, seed=7)
    assert sorted(state) == sorted(model.state_dict())  # both names of the tied embedding / LM head
    model.load_state_dict(state)
    for name, param in model.named_parameters():
        assert torch.equal(param, runs["a_saved"]["params"][name]), name


# -- single process: no process group --------------------------------------------------------------------


def _tiny(seed: int):
    model = build("mlp", seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = example_batch("mlp", 2)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    return model, optimizer


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failing_call", [("replace", 1), ("symlink", 1), ("replace", 2)])
def test_crash_at_each_step_of_publishing_leaves_the_previous_checkpoint(tmp_path, monkeypatch, failing_call):
    # publishing renames path.tmp-<id> to path.ckpt-<id> (replace 1), links path.link-<id> to it (symlink 1)
    # and renames the link over `path` (replace 2): a crash before the last leaves the old checkpoint in place
    import autoshard.runtime.checkpoint as ckpt

    path = tmp_path / "ckpt"
    old, old_optimizer = _tiny(seed=0)
    save_checkpoint(old, old_optimizer, path)
    changed, changed_optimizer = _tiny(seed=1)
    name, nth = failing_call
    calls = []
    real = getattr(os, name)

    def crash(*args):
        calls.append(args)
        if len(calls) == nth:
            raise OSError("simulated crash")
        return real(*args)

    monkeypatch.setattr(ckpt.os, name, crash)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(changed, changed_optimizer, path)
    monkeypatch.undo()
    fresh, fresh_optimizer = _tiny(seed=2)
    load_checkpoint(fresh, fresh_optimizer, path)
    assert all(torch.equal(fresh_optimizer.state[p]["exp_avg"], old_optimizer.state[q]["exp_avg"])
               for p, q in zip(fresh.parameters(), old.parameters(), strict=True))
    assert all(torch.equal(t, _weights(old)[n]) for n, t in _weights(fresh).items())
    save_checkpoint(changed, changed_optimizer, path)  # the next save works and clears what the crash left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", os.readlink(path)]
    assert all(torch.equal(t, _weights(changed)[n]) for n, t in export_state_dict(path).items())


@pytest.mark.timeout(60)
def test_loading_a_missing_checkpoint_names_the_path_and_incomplete_saves_beside_it(tmp_path):
    (tmp_path / "run.tmp-0123456789ab").mkdir()
    model, optimizer = _tiny(seed=0)
    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path}/run does not exist "
                                              r"\(run.tmp-0123456789ab are incomplete saves"):
        load_checkpoint(model, optimizer, tmp_path / "run")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["metadata", "shard", "autoshard.json"])
def test_loading_a_corrupt_checkpoint_raises_checkpoint_error(tmp_path, damage):
    model, optimizer = _tiny(seed=0)
    path = tmp_path / "ckpt"
    save_checkpoint(model, optimizer, path)
    target = {"metadata": ".metadata", "shard": "__0_0.distcp", "autoshard.json": "autoshard.json"}[damage]
    data = (path / target).read_bytes()
    (path / target).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="ckpt"):
        load_checkpoint(*_tiny(seed=1), path)


@pytest.mark.timeout(60)
def test_saving_over_a_directory_not_made_by_save_checkpoint_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    with pytest.raises(CheckpointError, match="exists and is not a checkpoint link made by save_checkpoint"):
        save_checkpoint(*_tiny(seed=0), tmp_path / "data")
    assert list((tmp_path / "data").iterdir()) == []


@pytest.mark.timeout(60)
def test_loading_a_model_only_checkpoint_with_an_optimizer_says_to_pass_none(tmp_path):
    model, _ = _tiny(seed=0)
    save_checkpoint(model, None, tmp_path / "weights")
    with pytest.raises(CheckpointError, match="holds no optimizer state .* load it with optimizer=None"):
        load_checkpoint(*_tiny(seed=1), tmp_path / "weights")
    fresh, _ = _tiny(seed=1)
    load_checkpoint(fresh, None, tmp_path / "weights")
    assert all(torch.equal(t, _weights(model)[n]) for n, t in _weights(fresh).items())
