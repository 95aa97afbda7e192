"""Data flows one way: models -> capture -> hardware_profiles -> plans -> cost_models -> planner -> runtime /
measure; only the runtime and measure import torch.distributed (STYLE.md rule 1)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "autoshard"
ORDER = ["errors", "models", "capture", "hardware_profiles", "plans", "cost_models", "planner", "runtime", "measure"]
# what each layer may import from the package (besides itself and errors)
ALLOWED = {
    "models": set(),
    "capture": {"models"},
    "hardware_profiles": set(),
    "plans": {"models", "capture", "hardware_profiles"},
    "cost_models": {"capture", "hardware_profiles", "plans"},
    "planner": {"models", "capture", "hardware_profiles", "plans", "cost_models"},
    "runtime": {"models", "capture", "hardware_profiles", "plans", "cost_models", "planner"},
    "measure": {"models", "capture", "hardware_profiles", "plans", "cost_models", "planner", "runtime"},
}
# the top: the command line, the entry points and the validation checks may use every part; no part imports them
TOP = ("cli", "cli_runtime", "api", "validation")


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
                if target not in (layer, "errors") and target not in allowed:
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
