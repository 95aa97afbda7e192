import logging
import os

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="session")
def gpt3_graph():
    from autoshard.capture import capture_model
    from autoshard.models import load_model

    return capture_model(load_model("gpt3-175b"))
