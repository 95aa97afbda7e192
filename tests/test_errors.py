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
from autoshard.plans.plan import Plan

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


# -- issue 17: every argument is checked before the model is captured -------------------------------------------
TINY = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"
EARLY_CASES = [  # (argv, fragment): each must fail before capture
    (["plan", TINY, "--cluster", "1x2xA100-80GB", "--global-batch", "-8"], "--global-batch must be a positive integer"),
    (["plan", TINY, "--cluster", "1x2xA100-80GB", "--seq", "0"], "--seq must be a positive integer"),
    (["plan", TINY, "--cluster", "1x2xA100-80GB", "--memory-cap", "0"], "--memory-cap must be a positive number"),
    (["plan", TINY, "--cluster", "1x2xA100-80GB", "--time-limit", "0"], "--time-limit must be a positive number"),
    (["plan", TINY, "--cluster", "1x2xA100-80GB", "--space", "dp,magic"], "--space 'dp,magic': unknown families"),
    (["plan", TINY, "--cluster", "1x2xB200"], "unknown GPU 'B200'"),
    (["plan", TINY, "--cluster", "1x2xA100-80GB", "-o", "{d}/a_file/sub/plan.json"], "cannot create directory"),
    (["plan", TINY, "--cluster", "1x2xA100-80GB", "--plot", "{d}/plan.jpg"], "--plot '"),
    (["plan", TINY, "--cluster", "1x2xA100-80GB", "--plot", "{d}/a_file/plan.png"], "cannot create directory"),
    (["estimate", TINY, "--cluster", "1x2xA100-80GB", "--global-batch", "-8"], "--global-batch must be a positive"),
    (["estimate", TINY, "--cluster", "1x2xA100-80GB", "--global-batch", "8", "--micro-batch", "0"],
     "--micro-batch must be a positive integer"),
    (["estimate", TINY, "--cluster", "1x2xA100-80GB", "--global-batch", "8", "--tp", "0"], "--tp must be a positive"),
    (["estimate", TINY, "--cluster", "1x2xA100-80GB", "--global-batch", "8", "--pp", "-1"], "--pp must be a positive"),
    (["estimate", TINY, "--cluster", "1x2xA100-80GB", "--global-batch", "8", "--dp", "0"], "--dp must be a positive"),
    (["estimate", TINY, "--cluster", "1x2xA100-80GB", "--global-batch", "8", "--virtual-stages", "0"],
     "--virtual-stages must be a positive"),
    (["estimate", TINY, "--cluster", "1x2xA100-80GB", "--global-batch", "8", "--virtual-stages", "2"],
     "--virtual-stages > 1 needs --pp > 1"),
    (["estimate", TINY, "--cluster", "1x2xA100-80GB", "--global-batch", "8", "--seq", "0"], "--seq must be a positive"),
    (["estimate", TINY, "--cluster", "garbage", "--global-batch", "8"], "expected NODESxGPUSxGPU[@NETWORK]"),
    (["estimate", TINY, "--cluster", "1x2xA100-80GB", "--global-batch", "8", "-o", "{d}/a_file/p.json"],
     "-o/--output '"),
    (["inspect", TINY, "--seq", "0"], "--seq must be a positive integer"),
    (["inspect", TINY, "--batch", "0"], "--batch must be a positive integer"),
    (["profile", "-o", "{d}/a_file/cluster.yaml"], "cannot create directory"),
]


@pytest.fixture
def no_capture(monkeypatch):
    """Capture (10-30 s on a real model) fails the test: every argument check has to come first."""
    import autoshard.api

    def captured(*args, **kwargs):
        pytest.fail("the model was loaded or captured before the arguments were checked")

    monkeypatch.setattr(autoshard.api, "capture_ref", captured)


@pytest.mark.parametrize("argv,fragment", EARLY_CASES,
                         ids=[" ".join(a[:1] + a[4:] if len(a) > 4 else a) for a, _ in EARLY_CASES])
def test_cli_rejects_bad_arguments_before_capture_in_one_line(argv, fragment, tmp_path, capsys, no_capture):
    (tmp_path / "a_file").write_text("not a directory")
    code = main([a.replace("{d}", str(tmp_path)) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("autoshard: error: ") and "Traceback" not in err, err
    assert fragment in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing written


def test_python_api_errors_name_parameters_not_flags():
    from autoshard.planner.search import parse_space

    with pytest.raises(ConfigurationError, match="^micro_batch must be a positive integer, got 0$"):
        estimate_config(TINY, "1x2xA100-80GB", micro_batch=0, global_batch=8)
    with pytest.raises(ConfigurationError, match="^virtual_stages > 1 needs pp > 1$"):
        estimate_config(TINY, "1x2xA100-80GB", virtual_stages=2, global_batch=8)
    with pytest.raises(ConfigurationError, match=r"^space='dp,magic': unknown families magic") as info:
        parse_space("dp,magic")
    assert "--" not in str(info.value) and info.value.params == ("space",)


def test_plan_json_stdout_is_only_json_and_o_creates_its_directory(tmp_path, capsys):
    out_file = tmp_path / "new" / "dir" / "plan.json"
    code = main(["plan", TINY, "--cluster", "1x2xA100-80GB", "--json", "-o", str(out_file)])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out)
    assert data["plan_file"] == str(out_file) and out_file.is_file()
    assert data["search"]["optimal"] is True


def test_plan_json_through_a_pipe_parses_with_the_solver_installed(tmp_path):
    """A real stdout file descriptor: HiGHS writes its banner from C++ to fd 1, not through sys.stdout."""
    run = subprocess.run([sys.executable, "-m", "autoshard.cli", "plan", TINY, "--cluster", "1x2xA100-80GB",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["model"]


def test_a_time_limited_search_warns_once_and_says_it_is_not_optimal(monkeypatch, caplog):
    """Every ILP stopped at its time limit: one warning for the search, and the plan marked as the incumbent."""
    import dataclasses

    import autoshard.planner.search as search_mod
    from autoshard.api import load_graph
    from autoshard.hardware_profiles import ClusterSpec as Cluster

    real_solve = search_mod.solve

    def stopped_at_the_limit(problem, *, time_limit_s):
        sol = real_solve(problem, time_limit_s=time_limit_s)
        return dataclasses.replace(sol, status="time_limit") if sol.status == "optimal" else sol

    monkeypatch.setattr(search_mod, "solve", stopped_at_the_limit)
    progress = []
    with caplog.at_level("WARNING", logger="autoshard.planner.search"):
        result = search_mod.search(load_graph(TINY), Cluster.parse("1x2xA100-80GB"), global_batch=8,
                                   time_limit_s=1.0, progress=progress.append)
    assert result.optimal is False and result.solved >= 1
    warnings = [r for r in caplog.records if "time limit" in r.getMessage()]
    assert len(warnings) == 1 and "not proven optimal" in warnings[0].getMessage()
    assert not any(m.startswith("searched 0 configurations") for m in progress)  # no line per candidate


def test_measuring_a_gpu_plan_on_a_machine_without_cuda_is_one_runtime_setup_error(tmp_path):
    """No traceback from deep inside torch ("Torch not compiled with CUDA enabled"): the error says what to do."""
    import torch

    from autoshard.api import estimate_config
    from autoshard.errors import RuntimeSetupError
    from autoshard.measure.step import measure_plan

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    plan, _ = estimate_config("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128", "1x1xH100-80GB", global_batch=2)
    with pytest.raises(RuntimeSetupError, match="no CUDA device.*--cluster 1xNxcpu"):
        measure_plan(plan)
