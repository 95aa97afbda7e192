"""Plain-data reports the CLI prints (and `--json` emits): zoo listing, graph summaries."""

from __future__ import annotations

from autoshard.capture.ir import OpGraph

__all__ = ["zoo_rows", "inspect_report"]


def zoo_rows() -> list[dict]:
    """Name, family and exact parameter count of every zoo model (built on the meta device)."""
    from autoshard.models import ZOO, build_module

    rows = []
    for name, spec in ZOO.items():
        module = build_module(spec)
        seen: set[int] = set()
        params = 0
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params += p.numel()
        rows.append({"name": name, "family": spec.family, "params": params, "layers": spec.layers,
                     "hidden": spec.hidden, "heads": spec.heads, "seq": spec.seq or None})
    return rows


def inspect_report(graph: OpGraph, *, batch: int = 1, capture_s: float | None = None) -> dict:
    tokens = graph.seq_len or 1
    return {
        "model": graph.model_name,
        "params": graph.num_params,
        "layers": graph.num_layers,
        "blocks": [f"{b.count} x {b.module_type} ({b.ops_per_block} ops)" for b in graph.blocks],
        "seq": graph.seq_len,
        "batch": batch,
        "flops_per_token": graph.matmul_flops_per_sample / tokens,
        "flops_per_token_all": graph.fwd_flops_per_sample / tokens,
        "fwd_flops_per_batch": graph.matmul_flops_per_sample * batch,
        "num_ops": len(graph.ops),
        "ops_by_kind": graph.ops_by_kind(),
        "unknown_ops": list(graph.unknown_ops),
        "fingerprint": graph.fingerprint(),
        "capture_s": capture_s if capture_s is not None else graph.capture_s,
    }
