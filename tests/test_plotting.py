"""`--plot`: one readable PNG of a plan, written atomically, headless; errors for people, not tracebacks."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from autoshard import plotting
from autoshard.api import estimate_config, plan_with_baselines
from autoshard.errors import ConfigurationError
from autoshard.plans.breakdown import MemoryBreakdown, TimeBreakdown
from autoshard.plans.layouts import Layout, MeshSpec
from autoshard.plans.plan import OpPlan, OpStrategy, Plan, Prediction

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HEIGHT_PX, WIDTH_PX = round(plotting.FIGSIZE_IN[1] * plotting.DPI), round(plotting.FIGSIZE_IN[0] * plotting.DPI)
SMALL_GPT = "gpt:layers=2,hidden=128,heads=4,seq=128"


@pytest.fixture(scope="module")
def small_plan():
    """A dp=2 x tp=2 plan on four CPU ranks with every baseline; tp2d/tp3d do not fit (about 10 s)."""
    plan, _, baselines, _, cluster = plan_with_baselines(SMALL_GPT, "2x2xcpu", global_batch=8)
    return plan, baselines, cluster


def hand_plan() -> Plan:
    """A two-block plan written by hand: no capture, no solver, so the error paths test in milliseconds."""
    def op(name: str, layer: int | None, strategy: str, zero: int = 0) -> OpPlan:
        return OpPlan(op=name, module=name, kind="linear", layer=layer,
                      strategy=OpStrategy(name=strategy, inputs=(Layout(),), output=Layout(), zero=zero))

    blocks = [op(f"h.{i}.{name}", i, st, zero) for i in range(2)
              for name, st, zero in (("ln", "tp:S(seq)", 0), ("fc", "col+sp", 2), ("proj", "row", 3))]
    pred = Prediction(iteration_time_s=1.0, tokens_per_s=1024.0, mfu=0.5, model_tflops_per_gpu=1.0,
                      memory=MemoryBreakdown(params_bytes=2**30, activations_bytes=2**31),
                      time=TimeBreakdown(compute_s=0.8, exposed_comm_s=0.2))
    return Plan(model="hand", fingerprint="0", cluster="1x4xcpu", mesh=MeshSpec.of(dp=2, tp=2), global_batch=8,
                micro_batch=1, seq=16, ops=(op("wte", None, "vocab", 2), *blocks, op("head", None, "col", 2)),
                prediction=pred)


def read_png(path) -> np.ndarray:
    assert path.read_bytes()[:8] == PNG_MAGIC
    return imread(path)  # (H, W, 4) floats in [0, 1]


def rgb_pixels(image: np.ndarray) -> set[tuple[int, int, int]]:
    return set(map(tuple, np.round(image[..., :3] * 255).astype(int).reshape(-1, 3)))


def test_plot_plan_writes_a_png_of_the_figure_size_with_every_strategy_colour(tmp_path, small_plan):
    plan, baselines, cluster = small_plan
    assert plan.mesh.size == 4 and any(b.prediction is None for b in baselines.values())
    path = tmp_path / "plan.png"
    plotting.plot_plan(plan, baselines, cluster, path)
    image = read_png(path)
    assert image.shape == (HEIGHT_PX, WIDTH_PX, 4)
    pixels = rgb_pixels(image)
    assert len(pixels) > 200 and image[..., :3].std() > 0.1  # a drawing, not a blank page
    for name, color in plotting._color_map(plan).items():
        assert tuple(round(c * 255) for c in to_rgb(color)) in pixels, f"strategy {name} is not drawn"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.png"]  # no temporary file left behind


def test_plot_plan_draws_pipeline_plans_without_baselines_or_cluster(tmp_path):
    plan, _ = estimate_config("gpt:layers=4,hidden=128,heads=4,seq=128", "1x4xcpu", tp=2, pp=2, global_batch=8,
                              micro_batch=1, sequence_parallel=True)
    assert plan.pipeline.stage_layers == ((0, 2), (2, 4))
    path = tmp_path / "pipeline.png"
    plotting.plot_plan(plan, {}, None, path)
    assert read_png(path).shape == (HEIGHT_PX, WIDTH_PX, 4)


def test_plot_into_a_missing_directory_is_a_configuration_error_and_writes_nothing(tmp_path):
    with pytest.raises(ConfigurationError, match="does not exist"):
        plotting.plot_plan(hand_plan(), {}, None, tmp_path / "no-such-dir" / "plan.png")
    assert not (tmp_path / "no-such-dir").exists()


def test_plot_to_a_non_png_name_is_a_configuration_error(tmp_path):
    with pytest.raises(ConfigurationError, match=r"\.png"):
        plotting.plot_plan(hand_plan(), {}, None, tmp_path / "plan.pdf")


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import raise ImportError
    with pytest.raises(ConfigurationError, match=r"pip install 'autoshard\[plot\]'"):
        plotting.plot_plan(hand_plan(), {}, None, tmp_path / "plan.png")


def test_a_failed_write_keeps_the_previous_image_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "plan.png"
    path.write_bytes(b"previous")

    def half_write(self, f, **kwargs):
        f.write(PNG_MAGIC)
        raise OSError("disk full")

    monkeypatch.setattr("matplotlib.figure.Figure.savefig", half_write)
    with pytest.raises(OSError, match="disk full"):
        plotting.plot_plan(hand_plan(), {}, None, path)
    assert path.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["plan.png"]


def test_hand_plan_draws_its_blocks_zero_levels_and_outside_ops(tmp_path):
    path = tmp_path / "hand.png"
    plotting.plot_plan(hand_plan(), {}, None, path)
    pixels = rgb_pixels(read_png(path))
    for color in plotting._color_map(hand_plan()).values():
        assert tuple(round(c * 255) for c in to_rgb(color)) in pixels


def test_a_plan_on_one_gpu_without_a_prediction_still_draws(tmp_path):
    plan = dataclasses.replace(hand_plan(), mesh=MeshSpec(axes=()), prediction=None)
    plotting.plot_plan(plan, {}, None, tmp_path / "one.png")
    assert read_png(tmp_path / "one.png").shape == (HEIGHT_PX, WIDTH_PX, 4)


def test_block_rows_are_op_names_after_the_block_index():
    st = OpStrategy(name="row", inputs=(Layout(),), output=Layout())
    op = OpPlan(op="transformer.h.7.attn.c_proj", module="transformer.h.7.attn.c_proj", kind="linear", layer=7,
                strategy=st)
    assert plotting._relative_name(op) == "attn.c_proj"


def test_explain_plot_via_the_cli_writes_the_png_and_exits_0(tmp_path, small_plan):
    small_plan[0].save(tmp_path / "plan.json")  # a real plan file, as `autoshard plan -o` writes it
    out = subprocess.run([sys.executable, "-m", "autoshard.cli", "explain", str(tmp_path / "plan.json"), "--plot",
                          str(tmp_path / "x.png")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert read_png(tmp_path / "x.png").shape == (HEIGHT_PX, WIDTH_PX, 4)


def test_explain_plot_under_a_file_is_one_line_on_stderr_with_exit_code_2(tmp_path):
    # a missing directory is created (as for -o); one that cannot be, because a file is in the way, is an error
    hand_plan().save(tmp_path / "plan.json")
    (tmp_path / "a_file").write_text("not a directory")
    out = subprocess.run([sys.executable, "-m", "autoshard.cli", "explain", str(tmp_path / "plan.json"), "--plot",
                          str(tmp_path / "a_file" / "x.png")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and out.stdout == ""
    assert not (tmp_path / "a_file" / "x.png").exists()


def test_explain_plot_into_a_missing_directory_creates_it(tmp_path):
    hand_plan().save(tmp_path / "plan.json")
    out = subprocess.run([sys.executable, "-m", "autoshard.cli", "explain", str(tmp_path / "plan.json"), "--plot",
                          str(tmp_path / "missing" / "x.png")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "missing" / "x.png").stat().st_size > 0
