"""Captured graphs on disk, so that a repeated `estimate` or `plan` of the same model starts from the graph.

Only zoo and spec models are cached: their `ModelSpec` (with the sequence length and attention kernel) fully
determines the module. The key also holds the versions of autoshard, torch and transformers and a hash of the
capture and model-building source, so that a change to any of them captures afresh. A `module:factory` or an
nn.Module is captured every time (its code can change under the same name).

Files live in `$AUTOSHARD_CACHE_DIR`, else `$XDG_CACHE_HOME/autoshard/graphs`, else `~/.cache/autoshard/graphs`.
Writes go to a temporary file in the same directory and are renamed into place, so concurrent runs never read
a half-written graph; an unreadable entry is ignored and rewritten. `AUTOSHARD_NO_CACHE=1` or `--no-cache`
bypasses the cache.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import pickle
import tempfile
from pathlib import Path

from autoshard.capture.ir import OpGraph

__all__ = ["cache_dir", "cache_key", "cached_graph", "load_cached", "store", "cache_enabled"]

log = logging.getLogger(__name__)
_FORMAT = 1


def cache_enabled() -> bool:
    return os.environ.get("AUTOSHARD_NO_CACHE", "").strip().lower() not in ("1", "true", "yes")


def cache_dir() -> Path:
    if os.environ.get("AUTOSHARD_CACHE_DIR"):
        return Path(os.environ["AUTOSHARD_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autoshard" / "graphs"


@functools.lru_cache(maxsize=1)
def _code_and_versions() -> str:
    """Versions of what a captured graph depends on, and a hash of autoshard's capture and model code."""
    from autoshard.version import __version__

    # the installed versions, without importing torch or transformers (a second or more each): a command
    # whose graph is cached never loads them
    versions = []
    for package in ("torch", "transformers"):
        try:
            versions.append(importlib.metadata.version(package))
        except importlib.metadata.PackageNotFoundError:
            versions.append("none")
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for sub in ("capture", "models"):
        for path in sorted((root / sub).glob("*.py")):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return f"{__version__}|{'|'.join(versions)}|{h.hexdigest()}|{_FORMAT}"


def cache_key(spec, name: str) -> str:
    """A file-name-safe key for a spec model captured under `name`."""
    return hashlib.sha256(f"{spec!r}|{name}|{_code_and_versions()}".encode()).hexdigest()[:32]


def cached_graph(ref, *, seq: int | None = None, attn: str | None = None) -> OpGraph | None:
    """The cached graph of zoo name or spec string `ref` (with `seq`, `attn` applied), or None: not a zoo or
    spec model, the cache is off, or the model was never captured. Imports neither torch nor transformers."""
    from autoshard.models.names import is_zoo_or_spec, spec_and_name

    if not is_zoo_or_spec(ref) or not cache_enabled():
        return None
    spec, name = spec_and_name(ref, seq=seq, attn=attn)
    return load_cached(cache_key(spec, name))


def load_cached(key: str) -> OpGraph | None:
    path = cache_dir() / f"{key}.pkl"
    try:
        with open(path, "rb") as f:
            graph = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign entry is a miss, never an error
        log.info("ignoring unreadable cached graph %s (%s: %s)", path, type(exc).__name__, exc)
        return None
    return graph if isinstance(graph, OpGraph) else None


def store(key: str, graph: OpGraph) -> None:
    """Write `graph` atomically; a cache that cannot be written is skipped with a log line."""
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(graph, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, directory / f"{key}.pkl")
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        log.info("graph cache not written in %s (%s)", directory, exc)
