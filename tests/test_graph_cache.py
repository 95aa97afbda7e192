"""The on-disk graph cache: a repeated capture of a spec model comes from disk, equal to a fresh one."""

from __future__ import annotations

import autoshard.capture.trace as capture_pkg
from autoshard.capture import capture_model, disk_cache
from autoshard.models import load_model

SPEC = "gpt:layers=3,hidden=64,heads=4,seq=32,vocab=128"


def _no_capture(*args, **kwargs):
    raise AssertionError("captured again although the graph was cached")


def test_second_capture_of_a_spec_model_reads_the_cache_and_equals_a_fresh_capture(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path))
    fresh = capture_model(load_model(SPEC))
    assert len(list(tmp_path.glob("*.pkl"))) == 1
    monkeypatch.setattr(capture_pkg, "capture", _no_capture)
    monkeypatch.setattr(capture_pkg, "_capture_spec", _no_capture)
    cached = capture_model(load_model(SPEC))
    assert cached is not fresh
    assert cached.fingerprint() == fresh.fingerprint()
    assert cached.ops == fresh.ops and cached.model_name == fresh.model_name


def test_the_key_changes_with_the_sequence_length_and_the_attention_kernel():
    plain = load_model(SPEC)
    longer = load_model(SPEC, seq=64)
    flash = load_model(SPEC, attn="flash")
    keys = {disk_cache.cache_key(m.spec, m.name) for m in (plain, longer, flash)}
    assert len(keys) == 3


def test_a_corrupt_entry_is_a_miss_and_is_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path))
    loaded = load_model(SPEC)
    path = tmp_path / f"{disk_cache.cache_key(loaded.spec, loaded.name)}.pkl"
    path.write_bytes(b"not a pickle")
    graph = capture_model(loaded)
    assert disk_cache.load_cached(path.stem).fingerprint() == graph.fingerprint()
    assert not list(tmp_path.glob(".*.tmp")), "a temporary file was left behind"


def test_no_cache_captures_again_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AUTOSHARD_NO_CACHE", "1")
    capture_model(load_model(SPEC))
    assert not list(tmp_path.iterdir())


def test_an_estimate_whose_graph_is_cached_never_imports_torch(tmp_path):
    # the cache's point is a fast what-if: importing torch alone takes about a second
    import os
    import subprocess
    import sys

    env = {**os.environ, "AUTOSHARD_CACHE_DIR": str(tmp_path)}
    argv = ["estimate", SPEC, "--cluster", "1x8xA100-80GB", "--global-batch", "16", "--tp", "2", "--json"]
    subprocess.run([sys.executable, "-m", "autoshard", *argv], env=env, check=True, capture_output=True, timeout=300)
    blocked = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
               f"from autoshard.cli import main; sys.exit(main({argv!r}))")
    run = subprocess.run([sys.executable, "-c", blocked], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert '"tokens_per_s"' in run.stdout
