"""No silent hangs: a failure on one rank becomes an error naming that rank on every rank (issue 7).

A failed collective only tells a rank that a peer's socket closed or that the group's timeout passed; it does
not say which rank failed or why. autoshard's own distributed work (`autoparallel`, `train_step`,
`save_checkpoint`, `load_checkpoint`) therefore runs inside

    with distributed_phase("save_checkpoint"):
        ...

Every rank numbers the phases it enters (1, 2, ...); SPMD code enters the same phases in the same order on
every rank, so the number names the same phase everywhere. On an exception in phase number n:

- the rank's own error (anything but a failed collective) is recorded in the default group's store (the
  TCPStore of torchrun's rendezvous, or whatever store the group was initialized with) as
  `rank r failed in <phase>: <Type>: <first line>`, once per phase number, and re-raised unchanged;
- a failed collective (a peer's socket closed, or the group's timeout passed) becomes `RankFailedError`: the
  first failure recorded for a phase after the last one this rank saw fail (so a failure that was caught and
  handled earlier in the job is not blamed again), waiting up to `grace_s` for it. With none, the heartbeats
  say which ranks stopped (the process died or was killed: a daemon thread bumps `autoshard/heartbeat/<r>`
  every `HEARTBEAT_S` seconds); one rank, the first to ask, reads them and shares the answer, so the store
  serves O(world) reads, not O(world^2). If no rank stopped either, the error says so.

A rank fails within its group's timeout at the latest: peers of a process that exits see its sockets close
at once, the others wait for the timeout. `align_group_timeouts` makes that hold for every group: DeviceMesh
and `new_group` create sub-groups with the backend's default timeout (30 minutes for gloo, 10 for NCCL), not
the default group's; a phase aligns them when it starts and ends, `autoparallel` right after building the
mesh. Nested phases report once (the innermost). Without a process group a phase does nothing.

Collectives outside the phases (a forward pass the user runs, `loss.backward()` outside `train_step`) still
end within the timeout, but with the backend's own error, which names no rank.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.checkpoint.api import CheckpointException

from autoshard.errors import AutoshardError, RuntimeSetupError

__all__ = ["distributed_phase", "RankFailedError", "align_group_timeouts", "is_collective_failure",
           "HEARTBEAT_S"]

log = logging.getLogger(__name__)

# A heartbeat is one store write per rank: 2 s keeps a 10k-rank job at 5k writes/s on the store; a rank whose
# heartbeat does not move for 2.5 beats (5 s, read only after a collective failed) is reported as stopped.
HEARTBEAT_S = 2.0
_PREFIX = "autoshard/"
# What gloo and NCCL say when a peer went away or a collective timed out (plain RuntimeErrors), e.g. gloo's
# "Read error [127.0.0.1]:12517: Connection reset by peer" and "Timed out waiting 5000ms for recv operation".
_COLLECTIVE_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "broken pipe",
                       "processgroup", "socket")
_HANDLED = "_autoshard_phase_reported"


class RankFailedError(RuntimeSetupError):
    """Another rank failed (or stopped) while this one waited for it in a collective."""

    def __init__(self, message: str, *, failed_ranks: tuple[int, ...] = (), reason: str = "") -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks
        self.reason = reason


@contextlib.contextmanager
def distributed_phase(phase: str, *, grace_s: float = 2.0) -> Iterator[None]:
    """Run a distributed phase of autoshard so that a failure names its rank on every rank (module docstring).

    `grace_s`: how long a rank whose collective failed waits for the failed rank's record."""
    if not dist.is_initialized():
        yield
        return
    rank = _Rank.of_current_group()
    rank.entered += 1
    number = rank.entered
    align_group_timeouts()  # groups made since the last phase (a user's own DeviceMesh)
    try:
        yield
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        if getattr(exc, _HANDLED, False):
            raise
        setattr(exc, _HANDLED, True)
        seen_before, rank.last_failed = rank.last_failed, number
        if not is_collective_failure(exc):
            # a user's error (every rank raises the same, and the CLI prints it once) is recorded, not logged
            _record(rank.store, number, f"rank {rank.rank} failed in {phase}: {_describe(exc)}",
                    log_it=not isinstance(exc, AutoshardError))
            raise
        error = _peer_error(rank, phase, exc, after=seen_before, number=number, grace_s=grace_s)
        setattr(error, _HANDLED, True)
        raise error from exc
    align_group_timeouts()  # groups made inside the phase (sub-meshes, pipeline groups)


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a collective that failed because of a peer or the timeout."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, dist.DistError):
            return True
        if isinstance(e, RuntimeError) and any(m in str(e).lower() for m in _COLLECTIVE_MARKERS):
            return True
        if isinstance(e, CheckpointException):  # {rank: (exception, traceback)} of each failed rank
            stack.extend(v[0] for v in e.failures.values() if isinstance(v, tuple) and v)
        stack += [e.__cause__, e.__context__]
    return False


def align_group_timeouts() -> None:
    """Give every process group of this rank no longer a timeout than the default group's (module docstring).
    Call after creating groups (`autoparallel` does, after building the mesh)."""
    if not dist.is_initialized():
        return
    default = c10d._get_default_group()
    timeout = _timeout_of(default)
    if timeout is None:
        return
    for group in list(c10d._world.pg_map):
        if group is default or c10d._rank_not_in_group(group):
            continue
        current = _timeout_of(group)
        if current is not None and current > timeout:
            c10d._set_pg_timeout(timeout, group)
            log.debug("group %s: timeout %s -> %s", group.group_name, current, timeout)


def _timeout_of(group: dist.ProcessGroup) -> timedelta | None:
    """The group's timeout (its gloo or NCCL backend's); None for a backend without one."""
    for device in ("cpu", "cuda"):
        with contextlib.suppress(Exception):  # no backend for the device, or one without options
            if torch.device(device) in group._device_types:
                return group._get_backend(torch.device(device)).options._timeout
    return None


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:500] if text else ''}"


def _safe(fn, *args):
    """A store operation that may fail (the store's host, rank 0, may be gone); None then."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - the store is best effort: the original error matters more
        return None


def _record(store, number: int, text: str, *, log_it: bool = True) -> None:
    """Record `text` as the failure of phase `number` unless a rank did already: entry i of the job's list."""
    if log_it:
        log.error("%s", text)
    if _safe(store.add, f"{_PREFIX}failed/{number}", 1) == 1:
        index = _safe(store.add, f"{_PREFIX}failures", 1)
        if index is not None:
            _safe(store.set, f"{_PREFIX}failure/{index}", f"{number}|{text}")


def _first_failure(store, *, after: int, grace_s: float) -> str | None:
    """The first failure recorded for a phase numbered above `after`, waiting up to `grace_s` for one."""
    deadline = time.monotonic() + grace_s
    while True:
        count = _safe(store.add, f"{_PREFIX}failures", 0) or 0
        for index in range(1, count + 1):
            key = f"{_PREFIX}failure/{index}"
            if _safe(store.check, [key]):
                number, _, text = (_safe(store.get, key) or b"0|").decode().partition("|")
                if int(number) > after:
                    return text
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _stopped_ranks(store, world: int) -> str | None:
    """'rank r, ...': the ranks whose heartbeat did not move over 2.5 beats (or never started; "" for none);
    None when the store is unreachable."""
    keys = [f"{_PREFIX}heartbeat/{r}" for r in range(world)]
    before = [_safe(store.add, k, 0) for k in keys]  # add 0: read a counter (0 if it never beat)
    if any(b is None for b in before):
        return None
    time.sleep(2.5 * HEARTBEAT_S)
    after = [_safe(store.add, k, 0) for k in keys]
    return ", ".join(f"rank {r}" for r, (b, a) in enumerate(zip(before, after, strict=True)) if a == b)


def _shared_stopped_ranks(store, number: int, world: int, wait_s: float) -> str | None:
    """`_stopped_ranks`, read by the first rank to ask for phase `number` and shared through the store."""
    key = f"{_PREFIX}stopped/{number}"
    if _safe(store.add, f"{_PREFIX}scan/{number}", 1) == 1:
        found = _stopped_ranks(store, world)
        _safe(store.set, key, "?" if found is None else found)
    deadline = time.monotonic() + wait_s
    while not _safe(store.check, [key]):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    value = (_safe(store.get, key) or b"?").decode()
    return None if value == "?" else value


def _peer_error(rank: _Rank, phase: str, exc: BaseException, *, after: int, number: int,
                grace_s: float) -> RankFailedError:
    store = rank.store
    here = f"rank {rank.rank} stopped in {phase} waiting for it ({_describe(exc)})"
    first = _first_failure(store, after=after, grace_s=grace_s)
    if first is not None:
        failed = first.split()[1] if first.startswith("rank ") else ""
        return RankFailedError(f"{first}; {here}", failed_ranks=(int(failed),) if failed.isdigit() else (),
                               reason=first)
    stopped = _shared_stopped_ranks(store, number, dist.get_world_size(), wait_s=3 * HEARTBEAT_S + grace_s)
    if stopped is None:
        reason = "no failure could be read: the store is unreachable (rank 0 hosts it and may have died)"
        return RankFailedError(f"{reason}; {here}", reason=reason)
    if stopped:
        ranks = tuple(int(part.split()[1]) for part in stopped.split(", "))
        reason = f"{stopped} stopped responding: the process died or was killed"
        return RankFailedError(f"{reason}; {here}", failed_ranks=ranks, reason=reason)
    reason = ("no rank reported an error and every rank is alive: a rank may be stuck outside autoshard's "
              "code, or ranks issued different collectives")
    return RankFailedError(f"{reason}; {here}", reason=reason)


class _Rank:
    """This process's part in the current process group: its phase numbers and its heartbeat thread, which
    bumps the counter `autoshard/heartbeat/<rank>` every `HEARTBEAT_S` while the group exists."""

    current: _Rank | None = None

    def __init__(self, store, rank: int) -> None:
        self.store, self.rank, self.key = store, rank, f"{_PREFIX}heartbeat/{rank}"
        self.entered = self.last_failed = 0  # numbers of the last phase entered, and seen failing
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="autoshard-heartbeat", daemon=True)

    @classmethod
    def of_current_group(cls) -> _Rank:
        """The current default group's `_Rank`, a new one (and numbering from 1) after a group change."""
        store, current = c10d._get_default_store(), cls.current
        if current is not None and current.store is store and current.thread.is_alive():
            return current
        if current is not None:
            current.stop.set()
        cls.current = new = cls(store, dist.get_rank())
        new.beat()  # before the first phase starts: a rank without a heartbeat never got this far
        new.thread.start()
        return new

    def beat(self) -> bool:
        """Bump the heartbeat; False when the store is gone."""
        try:
            self.store.add(self.key, 1)
        except Exception:  # noqa: BLE001 - the store's host (rank 0) is gone: nothing left to tell
            return False
        return True

    def _run(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            if not dist.is_initialized() or not self.beat():
                return


@atexit.register
def _stop_heartbeat() -> None:  # no store calls from a daemon thread while the interpreter shuts down
    current = _Rank.current
    if current is not None:
        current.stop.set()
        current.thread.join(timeout=2 * HEARTBEAT_S)
