import logging
import os
import tempfile
import time

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# captured graphs are cached per test session, never in the user's ~/.cache (autoshard/capture/disk_cache.py)
os.environ.setdefault("AUTOSHARD_CACHE_DIR", tempfile.mkdtemp(prefix="autoshard-test-graphs-"))
logging.getLogger("transformers").setLevel(logging.ERROR)


def pytest_addoption(parser):
    parser.addoption("--budget-s", type=float, default=None, metavar="S",
                     help="start no test after S seconds of the run; the rest are skipped and named (.ci/run uses "
                          "it to run the long matrix in the time CI has left)")


def pytest_sessionstart(session):
    session.config._autoshard_t0 = time.monotonic()


def pytest_runtest_setup(item):
    budget = item.config.getoption("--budget-s")
    if budget is not None and time.monotonic() - item.config._autoshard_t0 > budget:
        pytest.skip(f"the run's budget of {budget:.0f} s is spent: `python -m pytest -m long` runs the rest")


@pytest.fixture(scope="session")
def gpt3_graph():
    from autoshard.capture import capture_model
    from autoshard.models import load_model

    return capture_model(load_model("gpt3-175b"))


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of one rank (this process) for the test's duration."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
