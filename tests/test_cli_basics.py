import json
import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "autoshard.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_inspect_json_reports_params_layers_flops_and_kinds():
    out = run("inspect", "gpt2", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["layers"] == 12 and abs(data["params"] - 124.44e6) / 124.44e6 < 0.005
    assert data["ops_by_kind"]["linear"] == 49 and data["flops_per_token"] > 0


def test_unknown_model_is_one_line_on_stderr_with_exit_code_2():
    out = run("inspect", "gtp2")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "did you mean gpt2" in out.stderr and "Traceback" not in out.stderr


def test_plan_json_stdout_is_only_json_with_warnings_even_when_the_solver_prints():
    out = run("plan", "gpt2", "--cluster", "1x8xA100-80GB", "--global-batch", "64", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)  # HiGHS prints a banner on fd 1 when loaded: it must land on stderr
    assert isinstance(data["warnings"], list) and data["predicted"]["mfu"] > 0
