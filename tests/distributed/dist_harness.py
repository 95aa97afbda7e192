"""Run a function on N real gloo ranks on this machine, with a hard deadline and results back in the parent.

Ranks are started through a forkserver that has already imported torch and transformers, so a rank starts in
milliseconds instead of re-importing for seconds (the CI machines have 2 cores). Each rank joins a gloo group
through a file store with a short collective timeout, runs `fn(rank, world_size, *args)`, and pickles what it
returns. If any rank fails, the others are stopped and the first traceback is raised in the parent; if the
world does not finish by the deadline every rank is killed and `TimeoutError` says which ranks were alive.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from pathlib import Path

__all__ = ["run_world", "COLLECTIVE_TIMEOUT_S"]

COLLECTIVE_TIMEOUT_S = 90  # a collective reached by only some ranks fails after this instead of hanging
# transformers imports model classes lazily: without them here every rank imports its model's module itself
# (seconds each, times the number of ranks sharing 2 cores)
_PRELOAD = ["torch", "torch.distributed.tensor", "torch.distributed.fsdp", "transformers",
            "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
            "transformers.models.qwen2.modeling_qwen2", "transformers.models.gpt_neox.modeling_gpt_neox",
            "autoshard.runtime", "autoshard.capture", "autoshard.planner.search", "autoshard.api"]
_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = multiprocessing.get_context("forkserver")
        _ctx.set_forkserver_preload(_PRELOAD)
    return _ctx


def _rank_main(fn, rank: int, world: int, store: str, out_dir: str, args: tuple) -> None:
    import logging

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share 2 cores
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    result: object
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    tmp_path = Path(out_dir, f"{rank}.pkl.tmp")
    tmp_path.write_bytes(pickle.dumps(result))
    tmp_path.replace(Path(out_dir, f"{rank}.pkl"))  # atomic: the parent never reads half a result


def run_world(fn, world_size: int, *args, timeout_s: float = 240.0) -> list:
    """`fn(rank, world_size, *args)` on `world_size` gloo ranks; returns the per-rank results in rank order."""
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="autoshard-world-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, store, tmp, args), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            _wait(procs, tmp, deadline)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
        return _collect(tmp, world_size)


def _wait(procs, tmp: str, deadline: float) -> None:
    while any(p.is_alive() for p in procs):
        failed = [r for r in range(len(procs)) if _status(tmp, r) == "error"]
        if failed:  # the others would only wait for the failed rank's collectives
            time.sleep(1.0)
            return
        if time.monotonic() > deadline:
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            raise TimeoutError(f"ranks {alive} of {len(procs)} still running after the deadline; killed")
        time.sleep(0.05)


def _status(tmp: str, rank: int) -> str | None:
    path = Path(tmp, f"{rank}.pkl")
    return pickle.loads(path.read_bytes())[0] if path.exists() else None


def _collect(tmp: str, world: int) -> list:
    found = {r: pickle.loads(Path(tmp, f"{r}.pkl").read_bytes()) for r in range(world)
             if Path(tmp, f"{r}.pkl").exists()}
    for r, (status, value) in sorted(found.items()):
        if status == "error":  # the first failure in full, and how every rank ended (a rank that timed out in
            # a collective leaves, and its peers then fail with "connection reset": the first error is not always
            # the cause)
            raise RuntimeError(f"rank {r} failed:\n{value}\nevery rank: {_summary(found, world)}")
    missing = sorted(set(range(world)) - set(found))
    if missing:
        raise RuntimeError(f"ranks {missing} exited without a result (killed, or crashed in native code)")
    return [found[r][1] for r in range(world)]


def _summary(found: dict, world: int) -> str:
    """How each rank ended, one clause each: ok, the last line of its error, or no result."""
    def one(r: int) -> str:
        if r not in found:
            return f"rank {r} no result (killed, or crashed in native code)"
        status, value = found[r]
        return f"rank {r} ok" if status == "ok" else f"rank {r} {(value.strip().splitlines() or ['error'])[-1]}"
    return "; ".join(one(r) for r in range(world))
