"""What each rank runs in the checkpoint and failure tests, and a world runner that lets every rank fail.

Checkpoints: a rank trains a model under one plan and saves it, or builds the model with other weights under
another plan and loads it; either way it returns (on rank 0) the full tensors of every parameter and of the
AdamW state, gathered with `full_tensor()`, for the parent to compare bit for bit.

Failures: `run_outcomes` starts a gloo world with a short collective timeout and, unlike `run_world`, waits
for every rank to end on its own (up to a hard deadline), returning each rank's error and how long it took.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import pickle
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from dist_checks import all_experts, full_named, loss_of
from dist_models import build, example_batch
from torch.distributed.tensor import DTensor

from autoshard.errors import CheckpointError, ConfigurationError
from autoshard.runtime import apply_plan, build_device_mesh, load_checkpoint, save_checkpoint
from autoshard.runtime.pipeline_train import attach_loss_fn, train_step

__all__ = ["save_after_training", "load_under_plan", "interrupted_save", "run_cases", "rank_fails_in_train_step",
           "run_outcomes", "BATCH"]

LR = 1e-3
BATCH = 4


def _parallel(case: dict, *, seed: int):
    model = build(case["model"], seed=seed)
    names = [n for n, _ in model.named_parameters()]
    pmodel = apply_plan(model, case["plan"], mesh=build_device_mesh(case["plan"].mesh))
    return pmodel, torch.optim.AdamW(pmodel.parameters(), lr=LR, weight_decay=0.1), names


def _train(pmodel, optimizer, name: str, steps: int, *, seed: int = 1) -> None:
    x, y = example_batch(name, BATCH, seed=seed)
    lx, ly = pmodel.shard_inputs((x, y))
    for _ in range(steps):
        loss_of(name, pmodel(lx), ly).backward()
        optimizer.step()
        optimizer.zero_grad()


def _full(t):
    """A copy: a replicated DTensor's full_tensor() is its local tensor, which the next step changes."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_state(pmodel, optimizer, names: list[str]) -> dict | None:
    """{"params": {name: tensor}, "optim": {name: {"exp_avg", "exp_avg_sq", "step"}}} on rank 0, None elsewhere
    (every rank gathers: the collectives must match)."""
    params = full_named(pmodel, names, grads=False)
    by_param = dict(pmodel.named_parameters())
    optim = {n: {k: all_experts(pmodel.get_submodule(n.rpartition(".")[0]), _full(v))
                 for k, v in sorted(optimizer.state[by_param[n]].items())} for n in names
             if by_param[n] in optimizer.state}
    if dist.get_rank() != 0:
        return None
    return {"params": {n: t.detach().clone() for n, t in params.items()}, "optim": optim}


def _train_and_save(case: dict):
    pmodel, optimizer, names = _parallel(case, seed=0)
    _train(pmodel, optimizer, case["model"], case["steps"])
    save_checkpoint(pmodel, optimizer, case["path"])
    return pmodel, optimizer, names


def save_after_training(rank: int, world: int, case: dict) -> dict | None:
    """Train `case["steps"]` AdamW steps under `case["plan"]` and save to `case["path"]`; the saved state."""
    return full_state(*_train_and_save(case))


def load_under_plan(rank: int, world: int, case: dict) -> dict | None:
    """Build the model with other weights under `case["plan"]` and load `case["path"]`; the state before and
    after loading."""
    pmodel, optimizer, names = _parallel(case, seed=7)
    before = full_state(pmodel, optimizer, names)
    load_checkpoint(pmodel, optimizer, case["path"])
    after = full_state(pmodel, optimizer, names)
    return None if rank != 0 else {"before": before, "after": after}


def _failing_write(self, *args, **kwargs):
    raise OSError(28, "No space left on device (simulated)")


def interrupted_save(rank: int, world: int, case: dict) -> dict:
    """Save, train one more step, save again to the same path while rank `case["failing_rank"]`'s storage
    writer fails; then load the path into a model with other weights. What every rank saw."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    pmodel, optimizer, names = _train_and_save(case)
    saved = full_state(pmodel, optimizer, names)
    _train(pmodel, optimizer, case["model"], 1, seed=2)
    target = Path(case["path"])
    link_before = os.readlink(target)
    original = FileSystemWriter.write_data
    if rank == case["failing_rank"]:
        FileSystemWriter.write_data = _failing_write
    try:
        save_checkpoint(pmodel, optimizer, target)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    finally:
        FileSystemWriter.write_data = original
    dist.barrier()
    leftovers = sorted(p.name for p in target.parent.iterdir() if ".tmp-" in p.name)
    junk_error = None
    for name in leftovers:  # an incomplete save is never taken for a checkpoint
        try:
            load_checkpoint(pmodel, optimizer, target.parent / name)
        except CheckpointError as exc:
            junk_error = str(exc)
    fresh, fresh_optimizer, _ = _parallel(case, seed=7)
    load_checkpoint(fresh, fresh_optimizer, target)
    loaded = full_state(fresh, fresh_optimizer, names)
    return {"error": error, "link_kept": os.readlink(target) == link_before, "leftovers": leftovers,
            "junk_error": junk_error, "saved": saved, "loaded": loaded}


CASE_FNS = {"save": save_after_training, "load": load_under_plan, "interrupted": interrupted_save}


def run_cases(rank: int, world: int, cases: list[dict]) -> list:
    """Each case's function (by its "check") in order: every rank runs the same cases."""
    return [CASE_FNS[c["check"]](rank, world, c) for c in cases]


# -- failures ------------------------------------------------------------------------------------------------


def _loss(rank: int, failing_rank: int, mode: str, out, target):
    if rank == failing_rank:
        if mode == "killed":
            os._exit(1)  # no Python error, no record: only the heartbeat can tell
        raise ValueError(f"the targets of rank {rank} hold NaN (simulated)")
    return torch.nn.functional.mse_loss(out, target)


def rank_fails_in_train_step(rank: int, world: int, case: dict) -> dict:
    """`train_step` on every rank; rank `case["failing_rank"]`'s loss raises (mode "raise", then it exits;
    "stay": it stays alive for `case["stay_s"]`) or kills the process ("killed"). Through `autoparallel`
    with `case["plan"]` when `case["public_api"]`, else `apply_plan`."""
    from torch.distributed import distributed_c10d as c10d

    from autoshard import autoparallel
    from autoshard.runtime.failure import _timeout_of

    model = build(case["model"], seed=0)
    x, y = example_batch(case["model"], BATCH)
    loss = functools.partial(_loss, rank, case["failing_rank"], case["mode"])
    if case.get("public_api"):
        pmodel = autoparallel(model, f"1x{world}xcpu", example_inputs=(x[:2],), global_batch=BATCH,
                              plan=case["plan"], graph=case["graph"])
        attach_loss_fn(pmodel, loss)
    else:
        pmodel = apply_plan(model, case["plan"], mesh=build_device_mesh(case["plan"].mesh))
        attach_loss_fn(pmodel, None)
        with contextlib.suppress(ConfigurationError):  # a failure every rank has and handles: not to be
            train_step(pmodel, pmodel.shard_inputs(x), pmodel.shard_inputs(y)[0])  # blamed for the next one
        attach_loss_fn(pmodel, loss)
    timeouts = {g.group_name: _timeout_of(g).total_seconds() for g in c10d._world.pg_map}
    (lx, ly) = pmodel.shard_inputs((x, y))
    try:
        train_step(pmodel, (lx,), ly)
    except ValueError:  # RankFailedError is one too (AutoshardError): only the failing rank stays
        if case["mode"] == "stay" and rank == case["failing_rank"]:
            time.sleep(case["stay_s"])
        raise
    return {"timeouts": timeouts}


def _outcome_main(fn, rank: int, world: int, store: str, out_dir: str, timeout_s: float, args: tuple) -> None:
    import logging

    torch.set_num_threads(1)
    logging.getLogger("autoshard").setLevel(logging.CRITICAL)  # the expected errors, once per rank
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    start = time.monotonic()
    try:
        result = {"status": "ok", "value": fn(rank, world, *args)}
    except Exception as exc:  # noqa: BLE001 - every outcome goes back to the parent
        result = {"status": "error", "type": type(exc).__name__, "message": str(exc)}
    result["elapsed_s"] = time.monotonic() - start
    path = Path(out_dir, f"{rank}.pkl")
    path.with_suffix(".tmp").write_bytes(pickle.dumps(result))
    path.with_suffix(".tmp").replace(path)
    dist.destroy_process_group()


def run_outcomes(fn, world: int, *args, collective_timeout_s: float, deadline_s: float) -> list[dict]:
    """`fn(rank, world, *args)` on `world` gloo ranks whose collectives time out after `collective_timeout_s`;
    every rank's outcome ({"status": "ok" | "error" | "no result", "type", "message", "elapsed_s"}), once every
    process ended. Processes still alive after `deadline_s` are killed and reported "hung"."""
    from dist_harness import _context

    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="autoshard-outcomes-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_outcome_main, args=(fn, r, world, store, tmp, collective_timeout_s, args),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + deadline_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join(5)
        outcomes = []
        for r in range(world):
            path = Path(tmp, f"{r}.pkl")
            outcome = pickle.loads(path.read_bytes()) if path.exists() else {"status": "no result"}
            outcomes.append({**outcome, "status": "hung"} if r in hung else outcome)
        return outcomes
