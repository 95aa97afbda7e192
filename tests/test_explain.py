"""`autoshard explain`: every layer covered (identical layers folded, and said so), `--layer`/`--op` filters,
whole names, labels that say which number is the size and which the count."""

import dataclasses
import json
import subprocess
import sys

import pytest

from autoshard.api import estimate_config
from autoshard.errors import PlanFileError
from autoshard.planner.explain import batch_label, block_table, explain_groups, explain_rows, explain_text
from autoshard.plans.plan import Plan

SPEC = "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=128"
LONG_NAME = "transformer.h.*.attn.scaled_dot_product_attention"  # 50 characters: used to be cut to 44 or 46


@pytest.fixture(scope="module")
def plan() -> Plan:
    """Megatron tp=2 on two CPU ranks, 4 micro-batches of 1 sample: every layer gets the same choices."""
    plan, _ = estimate_config(SPEC, "1x2xcpu", tp=2, global_batch=4, micro_batch=1)
    return plan


@pytest.fixture(scope="module")
def plan_file(plan, tmp_path_factory):
    path = tmp_path_factory.mktemp("explain") / "plan.json"
    plan.save(path)
    return path


def with_layer_3_fc_replicated(plan: Plan) -> Plan:
    """The same plan with layer 3's MLP up-projection replicated: layer 3 no longer matches layers 0-2."""
    ops = tuple(dataclasses.replace(p, strategy=dataclasses.replace(p.strategy, name="replicate"))
                if p.op == "transformer.h.3.mlp.c_fc" else p for p in plan.ops)
    return dataclasses.replace(plan, ops=ops)


def run(*args):
    return subprocess.run([sys.executable, "-m", "autoshard.cli", "explain", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def test_identical_layers_fold_into_one_group_spanning_every_layer(plan):
    groups = explain_groups(plan)
    assert [g["title"] for g in groups] == ["outside layers", "layers 0-3 (4 layers, same choices)",
                                            "outside layers"]
    assert groups[1]["layers"] == [0, 1, 2, 3] and len(groups[1]["ops"]) == 12
    assert groups[0]["ops"][0] == "transformer.wte" and groups[2]["ops"] == ["transformer.ln_f", "lm_head"]
    text = explain_text(plan)
    assert "4 layers in 1 group of identical choices; ops outside layers shown once" in text
    assert "layers 0-3 (4 layers, same choices):" in text and "transformer.h.*.mlp.c_fc" in text


def test_rows_keep_their_keys_and_name_the_layers_they_stand_for(plan):
    rows = explain_rows(plan)
    assert len(rows) == 4 + 12 + 2  # embeddings, one folded layer, final norm and head: each op once
    fc = next(r for r in rows if r["name"] == "transformer.h.*.mlp.c_fc")
    assert fc["op"] == "transformer.h.0.mlp.c_fc" and fc["layers"] == [0, 1, 2, 3] and fc["strategy"] == "col"
    assert {"kind", "layer", "inputs", "output", "params", "time_ms", "runner_up", "why"} <= fc.keys()
    assert next(r for r in rows if r["op"] == "lm_head")["layers"] is None


def test_a_layer_with_other_choices_is_its_own_group(plan):
    changed = with_layer_3_fc_replicated(plan)
    titles = [g["title"] for g in explain_groups(changed) if g["layers"]]
    assert titles == ["layers 0-2 (3 layers, same choices)", "layer 3 (1 layer)"]
    assert "4 layers in 2 groups of identical choices" in explain_text(changed)
    table = block_table(changed)
    assert "layers 0-2 (3 layers, same choices):" in table and "layer 3 (1 layer):" in table
    assert any(line.split()[:2] == ["transformer.h.3.mlp.c_fc", "replicate"] for line in table)


def test_layer_and_op_filters_show_only_the_matching_ops(plan):
    rows = explain_rows(plan, layer=2)
    assert len(rows) == 12 and {r["layer"] for r in rows} == {2} and rows[0]["name"] == "transformer.h.2.ln_1"
    assert [r["name"] for r in explain_rows(plan, op="c_fc")] == ["transformer.h.*.mlp.c_fc"]
    assert [r["op"] for r in explain_rows(plan, op="*.attn.*proj")] == ["transformer.h.0.attn.c_proj"]
    assert [r["op"] for r in explain_rows(plan, layer=1, op="mlp.c_*")] == ["transformer.h.1.mlp.c_fc",
                                                                            "transformer.h.1.mlp.c_proj"]
    with pytest.raises(PlanFileError, match="layer 7 is not in the plan .* it has layers 0-3"):
        explain_rows(plan, layer=7)
    with pytest.raises(PlanFileError, match="matches 'nothing-like-this'"):
        explain_rows(plan, op="nothing-like-this")


def test_names_are_printed_whole(plan):
    lines = explain_text(plan).splitlines()
    assert any(line.split()[:1] == [LONG_NAME] for line in lines)
    assert any(line.split()[:1] == [LONG_NAME.replace("*", "0")] for line in explain_text(plan, layer=0).splitlines())
    assert any(line.split()[:2] == [LONG_NAME, "tp:S(feat)"] for line in block_table(plan))


def test_labels_say_samples_per_micro_batch_and_micro_batches_per_replica(plan):
    assert batch_label(1, 64) == "1 sample x 64 micro-batches per replica"
    assert batch_label(4, 1) == "4 samples x 1 micro-batch per replica"
    assert "micro-batch 1 sample x 4 micro-batches per replica" in explain_text(plan).splitlines()[0]


def test_explain_cli_filters_and_carries_the_groups_in_json(plan_file):
    out = run(plan_file, "--json", "--op", "c_proj")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [g["title"] for g in data["layer_groups"]] == ["layers 0-3 (4 layers, same choices)"]
    assert [r["name"] for r in data["ops"]] == ["transformer.h.*.attn.c_proj", "transformer.h.*.mlp.c_proj"]
    text = run(plan_file, "--layer", "3")
    assert text.returncode == 0 and "layer 3 (1 layer):" in text.stdout and "shown: only layer 3" in text.stdout


@pytest.mark.parametrize(("args", "message"), [
    (("--layer", "4"), "layer 4 is not in the plan"),
    (("--op", "nothing-like-this"), "matches 'nothing-like-this'"),
])
def test_an_unknown_layer_or_a_pattern_matching_nothing_is_one_line_with_exit_code_2(plan_file, args, message):
    out = run(plan_file, *args)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_selective_recompute_is_named_for_what_it_recomputes_on_the_attention_kernel():
    """Megatron's and torchtitan's "selective" differ on a fused attention kernel: the printed mode says which."""
    from autoshard.planner.explain import recompute_label

    assert recompute_label("full", "flash") == "full" and recompute_label("none", "eager") == "none"
    assert "Korthikanti" in recompute_label("selective", "eager")
    assert "every other matmul" in recompute_label("selective", "flash")
    assert "every other matmul" in recompute_label("selective", "masked")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoshard.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """`autoshard plan SPEC --json` written to a file, and `-o` the plan file, in one run."""
    where = tmp_path_factory.mktemp("planned")
    out = _cli("plan", SPEC, "--cluster", "1x2xcpu", "--global-batch", "4", "--json", "-o", str(where / "plan.json"))
    assert out.returncode == 0, out.stderr
    (where / "out.json").write_text(out.stdout)
    return where


def test_explain_reads_the_output_of_plan_json_as_it_reads_a_plan_file(planned):
    from_json = _cli("explain", str(planned / "out.json"))
    from_file = _cli("explain", str(planned / "plan.json"))
    assert from_json.returncode == 0, from_json.stderr
    assert from_json.stdout == from_file.stdout


def test_the_plan_file_keeps_the_baselines_plan_printed(planned):
    printed = json.loads((planned / "out.json").read_text())["baselines"]
    kept = Plan.load(planned / "plan.json").baselines
    assert [b.name for b in kept] == list(printed)
    for b in kept:
        if b.prediction is not None:
            assert b.prediction.tokens_per_s == pytest.approx(printed[b.name]["tokens_per_s"])


def test_explain_plot_draws_the_baselines_of_the_plan_file(planned, monkeypatch, tmp_path):
    from autoshard import cli, plotting

    drawn = {}
    monkeypatch.setattr(plotting, "plot_plan", lambda plan, baselines, cluster, path: drawn.update(baselines))
    assert cli.main(["explain", str(planned / "plan.json"), "--plot", str(tmp_path / "p.png")]) == 0
    assert list(drawn) == [b.name for b in Plan.load(planned / "plan.json").baselines] and drawn
