"""`autoshard plan|explain --plot plan.png`: one picture of a plan, drawn with matplotlib (Agg, no display).

    +----------------+-----------------+----------------+--------------------------+
    | device mesh    | memory per GPU  | step time      | tokens/s: plan vs        |
    | (nested boxes) | (stacked, cap)  | (stacked)      | baselines                |
    +------+---------+-----------------+----------------+--------------------+-----+
    | pre  | strategy of every block operator (rows) over the layers (columns) | post|
    +------+---------------------------------------------------------------------+-----+
    legend: strategy colours, ZeRO hatching

The figure is built on `matplotlib.figure.Figure` directly (not pyplot), so no GUI backend and no global figure
state are involved, and written atomically (temporary file + `os.replace`).
"""

from __future__ import annotations

import os
import tempfile
import textwrap
from pathlib import Path

from autoshard.errors import ConfigurationError
from autoshard.planner.explain import batch_label
from autoshard.plans.breakdown import GIB
from autoshard.plans.plan import OpPlan, Plan, Prediction

__all__ = ["plot_plan", "FIGSIZE_IN", "DPI"]

FIGSIZE_IN = (16.0, 10.0)
DPI = 110

# Strategy families (autoshard/plans/strategies.py); follow-op layout names ("tp:S(seq)") get _FOLLOW_COLORS.
_FAMILY_COLORS = {"replicate": "#d0d0d0", "col": "#1f77b4", "col+sp": "#17becf", "row": "#ff7f0e",
                  "vocab": "#9467bd", "2d": "#2ca02c", "3d-yz": "#d62728", "3d-zy": "#e377c2"}
_FAMILY_NOTES = {"replicate": "no tensor parallelism", "col": "column-parallel", "col+sp": "column + sequence par.",
                 "row": "row-parallel", "vocab": "vocab-parallel", "2d": "2D (Optimus)", "3d-yz": "3D, y-z",
                 "3d-zy": "3D, z-y"}
# Follow ops (norms, activations, dropout, adds) are most cells: pale, so the Linear strategies stand out.
_FOLLOW_COLORS = ("#ecd9b0", "#cfc8ec", "#c7e9c0", "#fcc5e0", "#e5e59a", "#c6dbef", "#d9c3bd", "#b8e3e9",
                  "#fdd0a2", "#e0e0e0")
_ZERO_HATCH = {0: "", 1: "..", 2: "///", 3: "xxx"}
_ZERO_NOTES = {0: "ZeRO-0: all replicated over dp", 1: "ZeRO-1: optimizer sharded over dp",
               2: "ZeRO-2: + gradients sharded", 3: "ZeRO-3: + parameters sharded"}
_MEMORY_KINDS = (("params_bytes", "params", "#4c72b0"), ("grads_bytes", "grads", "#55a868"),
                 ("optimizer_bytes", "optimizer", "#c44e52"), ("activations_bytes", "activations", "#8172b2"),
                 ("transient_bytes", "transient", "#ccb974"), ("other_bytes", "other", "#8c8c8c"))
_TIME_KINDS = (("compute_s", "compute", "#4c72b0"), ("host_bound_s", "waiting for the host", "#8172b2"),
               ("exposed_comm_s", "exposed comm", "#c44e52"),
               ("bubble_s", "pipeline bubble", "#ccb974"), ("optimizer_s", "optimizer", "#55a868"),
               ("overhead_s", "overhead", "#8c8c8c"))
_NODE_COLORS = ("#fde0c5", "#c9e4f5", "#d9f0d3", "#eadcf2")
_MESH_AXES_WIDTH_IN = 4.2  # the mesh panel's width on the 16 in figure, to size rank numbers


def plot_plan(plan: Plan, baselines: dict, cluster, path: str | os.PathLike) -> None:
    """Render `plan` (and the `baselines`, name -> Baseline, beside it) as one PNG at `path`.

    `cluster` (a ClusterSpec, or None when only the plan file is known) adds the memory capacity line and
    colours the mesh diagram's ranks by node.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigurationError("a plot needs matplotlib: pip install 'autoshard[plot]'") from exc
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ConfigurationError(f"path={str(path)!r}: only PNG is written; give a file name ending in .png",
                                 params=("path",))
    if not path.parent.is_dir():
        raise ConfigurationError(f"path={str(path)!r}: directory {path.parent} does not exist; create it first",
                                 params=("path",))
    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    _draw(fig, plan, baselines, cluster)
    _save_atomically(fig, path)


def _save_atomically(fig, path: Path) -> None:
    fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=DPI)
        os.chmod(scratch, 0o644)  # mkstemp makes it 0600; an image is for sharing
        os.replace(scratch, path)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise


def _draw(fig, plan: Plan, baselines: dict, cluster) -> None:
    fig.suptitle(_title(plan, cluster), fontsize=12)
    top, bottom = fig.subfigures(2, 1, height_ratios=(1.0, 1.15))
    ax_mesh, ax_mem, ax_time, ax_tok = top.subplots(1, 4, width_ratios=(1.35, 0.9, 0.9, 1.45))
    rows = [("plan", plan.prediction, _plan_config(plan))]
    rows += [(name, b.prediction, b.config or b.note) for name, b in baselines.items()]
    _draw_mesh(ax_mesh, plan, cluster)
    fitting = [(name, pred) for name, pred, _ in rows if pred is not None]
    cap = cluster.device_memory_bytes if cluster is not None else None
    _draw_stacked(ax_mem, fitting, _MEMORY_KINDS, lambda p: p.memory, scale=1 / GIB, unit="GiB", cap=cap,
                  title="memory per GPU (most loaded)")
    _draw_stacked(ax_time, fitting, _TIME_KINDS, lambda p: p.time, scale=1.0, unit="s", cap=None,
                  title="predicted time per iteration")
    _draw_throughput(ax_tok, rows)
    _draw_strategies(bottom, plan)


def _title(plan: Plan, cluster) -> str:
    head = f"{plan.model} on {cluster if cluster is not None else plan.cluster} — global batch {plan.global_batch}"
    head += f", seq {plan.seq}" if plan.seq else ""
    pred = plan.prediction
    if pred is not None:
        head += f" — predicted {pred.tokens_per_s:,.0f} tokens/s, MFU {pred.mfu:.1%}"
    return f"{head}\n{_plan_config(plan)}"


def _plan_config(plan: Plan) -> str:
    pipe = plan.pipeline
    text = (f"mesh {str(plan.mesh) or 'one GPU'}, micro-batch {batch_label(plan.micro_batch, plan.num_microbatches)}, "
            f"recompute {plan.recompute}")
    if pipe.degree > 1:
        text += f", {pipe.schedule}" + (f" x{pipe.virtual_stages}" if pipe.virtual_stages > 1 else "")
    return text


# -- device mesh ------------------------------------------------------------------------------------------
def _draw_mesh(ax, plan: Plan, cluster) -> None:
    """Nested boxes, outermost axis first (pp, dp, then the tensor-parallel axes); cells are ranks."""
    mesh = plan.mesh
    ax.set_axis_off()
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title(f"device mesh\n{str(mesh) or 'one GPU'} ({mesh.size:,} GPU{'s' if mesh.size > 1 else ''})",
                 fontsize=10)
    gpn = cluster.gpus_per_node if cluster is not None else None
    _mesh_box(ax, mesh, mesh.axes, (), (0.0, 0.12, 1.0, 0.86), 0, gpn)
    note = f"cells: GPUs by global rank along {mesh.axes[-1][0]}" if mesh.axes else "cell: the GPU"
    if cluster is not None:
        note += f"; colour = node ({gpn} GPUs each)\ncluster {cluster}"
    ax.text(0.5, 0.0, note, ha="center", va="bottom", fontsize=8, transform=ax.transAxes)


def _shown(degree: int, max_slots: int) -> list[int | None]:
    """Indices drawn along an axis: all of them, or the first few, an ellipsis (None) and the last."""
    if degree <= max_slots:
        return list(range(degree))
    return [*range(max_slots - 2), None, degree - 1]


def _mesh_box(ax, mesh, axes, coords, box, depth, gpn) -> None:
    """One level of boxes along `axes[0]`, split horizontally at even depths and vertically at odd ones."""
    from matplotlib.patches import Rectangle

    if len(axes) <= 1:
        _mesh_leaves(ax, mesh, axes, coords, box, depth % 2 == 0, gpn)
        return
    x, y, w, h = box
    (name, degree), rest = axes[0], axes[1:]
    slots = _shown(degree, 4)
    horizontal = depth % 2 == 0
    gap = 0.02
    step = (w if horizontal else h) / len(slots)
    for k, idx in enumerate(slots if horizontal else slots[::-1]):
        sx, sy = (x + k * step, y) if horizontal else (x, y + k * step)
        sw, sh = (step - gap, h) if horizontal else (w, step - gap)
        if idx is None:
            mark = "…" if horizontal else "⋮ "
            ax.text(sx + sw / 2, sy + sh / 2, f"{mark}{degree - len(slots) + 1} more", ha="center", va="center",
                    fontsize=7)
            continue
        ax.add_patch(Rectangle((sx, sy), sw, sh, facecolor="none", edgecolor="0.45", linewidth=0.8))
        ax.text(sx + 0.008, sy + sh - 0.004, f"{name}={idx}", ha="left", va="top", fontsize=max(6, 9 - depth))
        head, pad = min(0.045, sh * 0.25), min(0.012, sw * 0.06)
        inner = (sx + pad, sy + pad, sw - 2 * pad, sh - head - 2 * pad)
        _mesh_box(ax, mesh, rest, (*coords, (name, idx)), inner, depth + 1, gpn)


def _mesh_leaves(ax, mesh, axes, coords, box, horizontal: bool, gpn) -> None:
    """The innermost axis: one square cell per rank, numbered when the number fits, else the rank range."""
    from matplotlib.patches import Rectangle

    x, y, w, h = box
    name, degree = axes[0] if axes else ("", 1)
    slots = _shown(degree, 8)
    step = (w if horizontal else h) / len(slots)
    side = min(step * 0.92, h if horizontal else w, 0.16)
    base = sum(i * mesh.stride(a) for a, i in coords)  # the leaf axis has stride 1: its ranks are contiguous
    # one font size for every cell: the widest rank number of the mesh must fit
    fontsize = min(7.0, side * _MESH_AXES_WIDTH_IN * 72 / (0.65 * len(str(mesh.size - 1))))
    for k, idx in enumerate(slots if horizontal else slots[::-1]):
        cx, cy = (x + (k + 0.5) * step, y + h / 2) if horizontal else (x + w / 2, y + (k + 0.5) * step)
        if idx is None:
            ax.text(cx, cy, "…" if horizontal else "⋮", ha="center", va="center", fontsize=7)
            continue
        rank = base + idx
        color = _NODE_COLORS[(rank // gpn) % len(_NODE_COLORS)] if gpn else "#e8e8e8"
        ax.add_patch(Rectangle((cx - side / 2, cy - side / 2), side, side, facecolor=color, edgecolor="0.25",
                               linewidth=0.6))
        if fontsize >= 5:
            ax.text(cx, cy, str(rank), ha="center", va="center", fontsize=fontsize)
    if fontsize < 5:
        ax.text(x + w / 2, y + h / 2, f"ranks {base}–{base + degree - 1}", ha="center", va="center", fontsize=6.5,
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1})


# -- memory, time, throughput -----------------------------------------------------------------------------
def _draw_stacked(ax, rows: list[tuple[str, Prediction]], kinds, part, *, scale: float, unit: str, cap, title):
    ax.set_title(title + "\n", fontsize=10)
    if not rows:
        ax.text(0.5, 0.5, "no prediction", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    names = [name for name, _ in rows]
    bottoms = [0.0] * len(rows)
    for field, label, color in kinds:
        heights = [getattr(part(pred), field) * scale for _, pred in rows]
        ax.bar(names, heights, bottom=bottoms, color=color, label=label, width=0.65)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    top = max(bottoms)
    if cap is not None:
        ax.axhline(cap * scale, color="crimson", linestyle="--", linewidth=1.2, label=f"capacity {cap * scale:.0f} {unit}")
        top = max(top, cap * scale)
    ax.set_ylim(0, top * 1.45)  # headroom for the legend
    # the plan's total in the title: a label on the bar collides with the capacity line or its neighbours
    of_cap = f" of {cap * scale:.0f}" if cap is not None else ""
    ax.set_title(f"{title}\nplan: {bottoms[0]:.3g}{of_cap} {unit}", fontsize=10)
    ax.set_ylabel(unit, fontsize=9)
    ax.tick_params(axis="x", labelsize=8, rotation=45 if len(rows) > 4 else 0)
    ax.tick_params(axis="y", labelsize=8)
    ax.legend(fontsize=7, ncol=2, loc="upper center", frameon=False, handlelength=1.2, columnspacing=0.8)


def _draw_throughput(ax, rows: list[tuple[str, Prediction | None, str]]) -> None:
    """Horizontal bars of tokens/s, plan on top; each with its configuration, or `does not fit`."""
    ax.set_title("predicted tokens/s" + (": plan vs baselines" if len(rows) > 1 else "") + "\n", fontsize=10)
    fitting = [pred.tokens_per_s for _, pred, _ in rows if pred is not None]
    best = max(fitting, default=1.0)
    ys = list(range(len(rows)))[::-1]
    for y, (name, pred, config) in zip(ys, rows, strict=True):
        wrapped = textwrap.fill(config.removeprefix("does not fit: "), 52, max_lines=2, placeholder=" …")
        if pred is None:
            why = ("no prediction in the plan" if name == "plan" else
                   "does not fit" if config.startswith("does not fit") else "n/a")
            ax.text(0.01 * best, y, f"{why}\n{wrapped}", va="center", fontsize=6.5, color="crimson")
            continue
        ax.barh(y, pred.tokens_per_s, color="#4c72b0" if name == "plan" else "#a6bddb", height=0.8)
        ax.text(0.01 * best, y, f"{pred.tokens_per_s:,.0f} tokens/s  MFU {pred.mfu:.1%}\n{wrapped}",
                va="center", fontsize=6.5)
    ax.set_yticks(ys, [name for name, _, _ in rows], fontsize=8)
    ax.set_xlim(0, best * 1.05)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.tick_params(axis="x", labelsize=8)
    ax.xaxis.set_major_formatter(lambda v, _: _si(v))


def _si(value: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


# -- strategies over the layers ---------------------------------------------------------------------------
def _relative_name(p: OpPlan) -> str:
    """`transformer.h.7.attn.c_proj` -> `attn.c_proj`: the op name after its block index."""
    parts = p.op.split(".")
    if str(p.layer) in parts:
        return ".".join(parts[parts.index(str(p.layer)) + 1:]) or p.op
    return p.op


def _split_ops(plan: Plan) -> tuple[list[OpPlan], list[OpPlan], list[OpPlan], bool]:
    """(ops before the blocks, ops in blocks, ops after them, whether before/after is known), in plan order.

    `plan` lists ops in graph order, so embeddings come before the blocks and the head after; a plan that
    lists every op outside the blocks on one side of them (`estimate` lists the blocks first) cannot say which
    side an op is on, so they are all drawn as "outside blocks".
    """
    in_blocks = [i for i, p in enumerate(plan.ops) if p.layer is not None]
    if not in_blocks:
        return [], [], list(plan.ops), False
    pre = [p for p in plan.ops[:in_blocks[0]] if p.layer is None]
    post = [p for p in plan.ops[in_blocks[0]:] if p.layer is None]
    return pre, [plan.ops[i] for i in in_blocks], post, bool(pre and post)


def _color_map(plan: Plan) -> dict[str, str]:
    names = sorted({p.strategy.name for p in plan.ops})
    others = [n for n in names if n not in _FAMILY_COLORS]
    colors = {n: c for n, c in _FAMILY_COLORS.items() if n in names}
    colors.update({n: _FOLLOW_COLORS[i % len(_FOLLOW_COLORS)] for i, n in enumerate(others)})
    return colors


def _draw_strategies(subfig, plan: Plan) -> None:
    pre, blocks, post, sided = _split_ops(plan)
    colors = _color_map(plan)
    ax_pre, ax_blocks, ax_post = subfig.subplots(1, 3, width_ratios=(0.6, 8.0, 0.6))
    _draw_side(ax_pre, pre, colors, "before blocks", right=False)
    _draw_side(ax_post, post, colors, "after blocks" if sided else "outside blocks", right=True)
    _draw_block_grid(ax_blocks, plan, blocks, colors)
    _legend(subfig, plan, colors)


def _cell(ax, x: float, y: float, width: float, strategy_name: str, zero: int, colors) -> None:
    from matplotlib.patches import Rectangle

    # linewidth 0 hides the border; the edge colour is still the hatch colour
    ax.add_patch(Rectangle((x - 0.5, y - 0.5), width, 1.0, facecolor=colors[strategy_name], edgecolor="0.2",
                           linewidth=0, hatch=_ZERO_HATCH.get(zero, "")))


def _draw_side(ax, ops: list[OpPlan], colors, title: str, *, right: bool) -> None:
    if not ops:
        ax.set_axis_off()
        return
    ax.set_title(title, fontsize=9, pad=16)
    for y, p in enumerate(ops):
        _cell(ax, 0, y, 1.0, p.strategy.name, p.strategy.zero, colors)
    ax.set_xlim(-0.5, 0.5)
    ax.set_ylim(len(ops) - 0.5, -0.5)
    ax.set_xticks([])
    ax.set_yticks(range(len(ops)), [p.op for p in ops], fontsize=8)
    if right:
        ax.yaxis.tick_right()


def _draw_block_grid(ax, plan: Plan, blocks: list[OpPlan], colors) -> None:
    rows: dict[str, int] = {}
    cells: dict[tuple[int, int], OpPlan] = {}
    for p in blocks:
        cells[(rows.setdefault(_relative_name(p), len(rows)), p.layer)] = p
    num_layers = max((p.layer for p in blocks), default=-1) + 1
    for row in rows.values():
        _draw_runs(ax, row, [cells.get((row, layer)) for layer in range(num_layers)], colors)
    ax.set_xlim(-0.5, max(num_layers, 1) - 0.5)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)), list(rows), fontsize=8)
    ax.set_xlabel("layer (block index)", fontsize=9)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.tick_params(axis="x", labelsize=8)
    title = "strategy of each operator of every block"
    if plan.pipeline.degree > 1:
        title += f"; black lines: pipeline chunk boundaries ({plan.pipeline.degree} stages)"
    ax.set_title(title, fontsize=10, pad=16)
    _draw_stage_boundaries(ax, plan)


def _draw_runs(ax, row: int, ops: list[OpPlan | None], colors) -> None:
    """One rectangle per run of layers with the same strategy and ZeRO level (hatching reads better long)."""
    start = 0
    for layer in range(1, len(ops) + 1):
        here, prev = (ops[layer] if layer < len(ops) else None), ops[start]
        same = here is not None and prev is not None and \
            (here.strategy.name, here.strategy.zero) == (prev.strategy.name, prev.strategy.zero)
        if same:
            continue
        if prev is not None:
            _cell(ax, start, row, layer - start, prev.strategy.name, prev.strategy.zero, colors)
        start = layer


def _draw_stage_boundaries(ax, plan: Plan) -> None:
    pipe = plan.pipeline
    chunks = pipe.stage_layers
    if pipe.degree <= 1 or not chunks:
        return
    every = max(1, len(chunks) // 16)  # at most ~16 labels so they never collide
    if len(chunks) > 16:
        ax.text(-0.6, -0.55, "stage", ha="right", va="bottom", fontsize=8)
    for c, (first, last) in enumerate(chunks):
        if first > 0:
            ax.axvline(first - 0.5, color="black", linewidth=1.6)
        if c % every == 0:
            label = f"stage {c % pipe.degree}" if len(chunks) <= 16 else str(c % pipe.degree)
            ax.text((first + last - 1) / 2, -0.55, label, ha="center", va="bottom", fontsize=8)


def _legend(subfig, plan: Plan, colors) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=c, label=f"{n}: {_FAMILY_NOTES[n]}" if n in _FAMILY_NOTES else f"{n} (follows)")
               for n, c in colors.items()]
    zeros = sorted({p.strategy.zero for p in plan.ops})
    handles += [Patch(facecolor="white", edgecolor="0.2", hatch=_ZERO_HATCH[z], label=_ZERO_NOTES[z]) for z in zeros]
    subfig.legend(handles=handles, loc="outside lower center", ncol=min(6, len(handles)), fontsize=8,
                  frameon=False, handleheight=1.4)
