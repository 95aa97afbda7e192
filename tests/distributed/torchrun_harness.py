"""Run an `autoshard` command under torchrun on N local gloo ranks, the way a user launches it, and say why it
failed if it did.

torchrun's own stderr ends in a ChildFailedError summary that names the signal but not the cause, so each
rank's stderr goes to its own log file (`--redirects 2`) and a failure message quotes the end of every rank's
log. Standard output is left on the console: the command's `--json` document comes from rank 0 there.

One retry, and only for a rank killed by SIGABRT: gloo's TCP transport aborts the process when a connection
fails inside its event loop (an uncaught `gloo::IoException`, or `Address::fromPeerName` on a socket its peer
reset while being accepted: pytorch/pytorch#188266, horovod/horovod#2907), which two loaded shared cores can
provoke without anything being wrong in the command. A command that aborts twice fails the test, with both
attempts' logs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["run_torchrun"]

_SIGABRT = -6


def _rank_logs(log_dir: Path, tail_chars: int = 1500) -> str:
    parts = []
    for log in sorted(log_dir.rglob("stderr.log")):
        text = log.read_text(errors="replace").strip()
        parts.append(f"--- {log.relative_to(log_dir)} ---\n{text[-tail_chars:] or '(empty)'}")
    return "\n".join(parts) or f"(no rank logs under {log_dir})"


def _aborted(stderr: str) -> bool:
    return f"exitcode  : {_SIGABRT} " in stderr


def run_torchrun(cli_args: list[str], *, nproc: int, workdir: Path, timeout_s: float = 600,
                 attempts: int = 2) -> tuple[subprocess.CompletedProcess, str]:
    """Run `python -m autoshard.cli *cli_args` on `nproc` ranks (a free rendezvous port: `--standalone`).

    Returns the last attempt's process and every attempt's per-rank stderr, for an assertion message.
    """
    logs = []
    for attempt in range(attempts):
        log_dir = workdir / f"torchrun-logs-{attempt}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "--redirects", "2", "--log-dir", str(log_dir), "-m", "autoshard.cli", *cli_args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        logs.append(f"attempt {attempt + 1}: exit {out.returncode}\n{out.stderr[-600:]}\n{_rank_logs(log_dir)}")
        if out.returncode == 0 or not _aborted(out.stderr):
            break
    return out, "\n".join(logs)
