import logging
import os
import tempfile

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# captured graphs are cached per test session, never in the user's ~/.cache (autoshard/capture/disk_cache.py)
os.environ.setdefault("AUTOSHARD_CACHE_DIR", tempfile.mkdtemp(prefix="autoshard-test-graphs-"))
logging.getLogger("transformers").setLevel(logging.ERROR)


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
