"""Every bad input gets one line on stderr and exit code 2 from the CLI, and a typed error from the library."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoshard.api import estimate_config, plan
from autoshard.cli import main
from autoshard.errors import (
    CaptureError,
    ClusterSpecError,
    ConfigurationError,
    InfeasiblePlanError,
    ModelSpecError,
    PlanFileError,
)
from autoshard.hardware_profiles import ClusterSpec
from autoshard.planner.plan import Plan

HERE = Path(__file__).resolve().parent
BAD_MODEL = '''import torch
class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return x
def build():
    return DataDependent(), (torch.randn(2, 4),)
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "corrupt.json").write_text('{"version": 1')
    (d / "v99.json").write_text(json.dumps({"version": 99, "ops": []}))
    (d / "bad_model.py").write_text(BAD_MODEL)
    (d / "cluster.yaml").write_text("nodes: 2\ngpus_per_node: [8\n")
    return d


CASES = [  # (argv, fragment of the one-line message)
    (["plan", "gpt2", "--cluster", "0x8xA100-80GB"], "0 nodes"),
    (["plan", "gpt2", "--cluster", "1x8xB200"], "unknown GPU 'B200'"),
    (["plan", "gpt2", "--cluster", "1x8xA100-80GB@ib-ndr-8x400"], "cannot drive network 'ib-ndr-8x400'"),
    (["plan", "gpt2", "--cluster", "garbage"], "expected NODESxGPUSxGPU[@NETWORK]"),
    (["plan", "gpt2", "--cluster", "{d}/missing.yaml"], "not found"),
    (["plan", "gpt2", "--cluster", "{d}/cluster.yaml"], "cluster.yaml"),
    (["plan", "gtp2", "--cluster", "1x8xA100-80GB"], "did you mean gpt2"),
    (["plan", "gpt:layers=2,hidden=65,heads=4,seq=32", "--cluster", "1x8xA100-80GB"], "not divisible by heads"),
    (["plan", "gpt:layers=2,hidden=64,seq=32", "--cluster", "1x8xA100-80GB"], "missing heads"),
    (["plan", "gpt2", "--cluster", "1x8xA100-80GB", "--global-batch", "0"], "--global-batch must be a positive"),
    (["plan", "gpt2", "--cluster", "1x8xA100-80GB", "--memory-cap", "-1"], "--memory-cap must be a positive"),
    (["plan", "gpt2-xl", "--cluster", "1x2xA100-80GB", "--global-batch", "8", "--memory-cap", "0.5"],
     "the smallest plan needs"),
    (["plan", "gpt2", "--cluster", "1x8xA100-80GB", "--space", "dp,magic"], "unknown families magic"),
    (["estimate", "gpt2", "--cluster", "1x8xA100-80GB", "--tp", "3", "--dp", "1", "--global-batch", "8"],
     "tp x pp x dp = 3 x 1 x 1 = 3"),
    (["estimate", "gpt:layers=2,hidden=48,heads=6,seq=32,vocab=64", "--cluster", "1x8xA100-80GB", "--tp", "8",
      "--global-batch", "8"], "does not divide the 6 attention heads"),
    (["estimate", "gpt2", "--cluster", "1x8xA100-80GB", "--dp", "8", "--micro-batch", "2", "--global-batch", "12"],
     "not a multiple of dp x micro-batch"),
    (["estimate", "gpt2", "--cluster", "1x8xA100-80GB", "--micro-batch", "0", "--global-batch", "8"],
     "--micro-batch must be a positive"),
    (["estimate", "gpt2", "--cluster", "1x8xA100-80GB", "--recompute", "sometimes", "--global-batch", "8"],
     "invalid choice: 'sometimes'"),
    (["explain", "{d}/missing.json"], "does not exist"),
    (["explain", "{d}/corrupt.json"], "not valid JSON"),
    (["explain", "{d}/v99.json"], "plan version 99"),
    (["inspect", "factory_models:raises"], "raised RuntimeError: checkpoint not found"),
    (["inspect", "factory_models:not_a_module"], "not an nn.Module"),
    (["inspect", "bad_model:build"], "bad_model.py:7 in forward"),
]


@pytest.mark.parametrize("argv,fragment", CASES, ids=[" ".join(a[:2]) + f" #{i}" for i, (a, _) in enumerate(CASES)])
def test_cli_reports_bad_input_in_one_line_with_exit_code_2(argv, fragment, files, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(files))
    monkeypatch.syspath_prepend(str(HERE))
    argv = [a.replace("{d}", str(files)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert fragment in err


def test_cli_subprocess_prints_no_traceback_for_an_unknown_gpu():
    out = subprocess.run([sys.executable, "-m", "autoshard.cli", "plan", "gpt2", "--cluster", "1x8xB200"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("autoshard: error:") and out.stderr.count("\n") == 1


@pytest.mark.parametrize("call,error,fragment", [
    (lambda: ClusterSpec.parse("1x8xB200"), ClusterSpecError, "unknown GPU"),
    (lambda: plan("gtp2", "1x8xA100-80GB"), ModelSpecError, "did you mean gpt2"),
    (lambda: plan("gpt2-xl", "1x2xA100-80GB", global_batch=8, memory_cap=0.5), InfeasiblePlanError, "smallest"),
    (lambda: estimate_config("gpt2", "1x8xA100-80GB", tp=3, dp=1, global_batch=8), ConfigurationError, "3 x 1 x 1"),
    (lambda: Plan.load("/nonexistent/plan.json"), PlanFileError, "does not exist"),
])
def test_library_raises_typed_errors_with_the_same_messages(call, error, fragment):
    with pytest.raises(error, match=fragment):
        call()


def test_untraceable_model_raises_capture_error(files, monkeypatch):
    monkeypatch.syspath_prepend(str(files))
    from autoshard.capture import capture_model
    from autoshard.models import load_model

    with pytest.raises(CaptureError, match="in forward"):
        capture_model(load_model("bad_model:build"))


def test_failed_plan_writes_no_file(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", "gpt2-xl", "--cluster", "1x2xA100-80GB", "--global-batch", "8", "--memory-cap", "0.5",
                 "-o", str(out)])
    assert code == 2 and not out.exists() and not list(tmp_path.iterdir())
