"""Data flows one way: models -> capture -> hardware_profiles -> plans -> cost_models -> planner -> runtime /
measure; only the runtime and measure import torch.distributed (STYLE.md rule 1)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "autoshard"
ORDER = ["errors", "models", "capture", "hardware_profiles", "plans", "cost_models", "planner", "runtime", "measure"]
# what each layer may import from the package (besides itself, errors and version)
ALLOWED = {
    "models": set(),
    "capture": {"models"},
    "hardware_profiles": set(),
    "plans": {"models", "capture", "hardware_profiles"},
    "cost_models": {"capture", "hardware_profiles", "plans"},
    "planner": {"models", "capture", "hardware_profiles", "plans", "cost_models"},
    # the runtime applies plans: it reads the plan vocabulary and imports no planner code (a plan is made on
    # rank 0 by a function the caller passes: api.autoparallel passes the planner's)
    "runtime": {"models", "capture", "hardware_profiles", "plans", "cost_models"},
    "measure": {"models", "capture", "hardware_profiles", "plans", "cost_models", "runtime"},
}
# the top: the command line, the entry points and the validation checks may use every part; no part imports them
TOP = ("cli", "cli_runtime", "api", "check", "validation")


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_layers_import_only_upstream_layers():
    bad = []
    for layer, allowed in ALLOWED.items():
        for path in (PKG / layer).rglob("*.py"):
            for name in imports_of(path):
                if not name.startswith("autoshard."):
                    continue
                target = name.split(".")[1]
                if target not in (layer, "errors", "version") and target not in allowed:
                    bad.append(f"{path.relative_to(PKG)} imports {name}")
    assert not bad, bad


def test_no_part_imports_the_top_layer():
    bad = [f"{path.relative_to(PKG)} imports {name}" for layer in ALLOWED for path in (PKG / layer).rglob("*.py")
           for name in imports_of(path) if name.split(".")[:2] in (["autoshard", t] for t in TOP)]
    assert not bad, bad


def test_only_the_runtime_measure_and_validation_import_torch_distributed():
    bad = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if not {"runtime", "measure", "validation"} & set(p.parts)
           and any(n.startswith("torch.distributed") for n in imports_of(p))]
    assert not bad, bad


def test_cost_models_do_not_import_torch():
    bad = [str(p.relative_to(PKG)) for p in (PKG / "cost_models").rglob("*.py")
           if any(n == "torch" or n.startswith("torch.") for n in imports_of(p))]
    assert not bad, bad


def _module_of(name: str) -> str | None:
    """The module file an import names (a module, or the package `__init__`), None outside autoshard."""
    if not name.startswith("autoshard"):
        return None
    path = PKG.parent / name.replace(".", "/")
    if path.with_suffix(".py").exists():
        return name
    if (path / "__init__.py").exists():
        return name + ".__init__"
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the autoshard modules it imports, anywhere in it (top level, functions, TYPE_CHECKING): a
    `from a.b import c` names module a.b.c where that is a module, else a.b."""
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(_module_of(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    targets.add(_module_of(f"{node.module}.{a.name}") or _module_of(node.module))
        graph[name] = {t for t in targets if t and t != name}
    return graph


def test_no_module_imports_itself_through_others():
    """No import circle, reading every import statement (the circles capture/build_ops <-> coarsen,
    cluster <-> cluster_file and data_parallel -> tensor_parallel -> parallel_module -> pipeline_train ->
    data_parallel were broken: a module's helpers moved to the module both use)."""
    graph = import_graph()
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, [" -> ".join(c) for c in cycles]


def test_estimating_applying_and_measuring_need_no_solver():
    """GPU images ship no PuLP/HiGHS: `estimate_config`, the runtime and measure import and price a hand
    configuration with the solver's modules blocked; only planning needs it."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['pulp'] = None; sys.modules['highspy'] = None\n"
            "import autoshard.runtime.entry, autoshard.measure.step, autoshard.validation.gpu_check\n"
            "from autoshard.api import estimate_config\n"
            "plan, _ = estimate_config('gpt:layers=1,hidden=32,heads=2,seq=16,vocab=64', '1x1xH200-141GB', "
            "global_batch=2)\n"
            "print(plan.prediction.iteration_time_s > 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=PKG.parent)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-2000:]
