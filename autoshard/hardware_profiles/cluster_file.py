"""Custom clusters from a YAML file (the `my_cluster.yaml` form of `ClusterSpec.parse`).

    nodes: 4
    gpus_per_node: 8
    gpu: A100-80GB          # a profile name, or a mapping with the GPUProfile fields
    intra: nvswitch-a100    # optional: a link name or a mapping with the LinkProfile fields
    inter: ib-hdr-4x200     # optional, likewise
    memory_gib: 70          # optional: usable memory per GPU if less than the profile's

An inline GPU mapping may leave out gpus_per_node (taken from the file) and intra_node / inter_node (taken from
the file's intra / inter). Every mistake raises `ClusterSpecError` naming the file, the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from autoshard.errors import ClusterSpecError
from autoshard.hardware_profiles.names import (
    default_link_names,
    one_line,
    resolve_gpu_name,
    resolve_link_name,
)
from autoshard.hardware_profiles.profiles import (
    COLLECTIVES,
    GPUProfile,
    LinkProfile,
    gpu_names,
    link_names,
    load_gpu,
    load_link,
)

__all__ = ["read_cluster_file", "YAML_KEYS"]

YAML_KEYS = ("nodes", "gpus_per_node", "gpu", "intra", "inter", "memory_gib")
_NUMBERS = ("peak_tflops", "fp32_tflops", "hbm_gbps", "memory_gib", "num_sms", "max_gemm_efficiency")
_NUMBERS += ("hbm_efficiency", "kernel_launch_us", "gpus_per_node", "latency_us", "overlap_slowdown",
             "dtensor_us_per_op", "flash_attention_efficiency", "memory_efficient_attention_efficiency",
             "fsdp_us_per_module", "optimizer_us_per_tensor", "sync_us", "transcendental_gelem_per_s", "host_us_per_op",
             "sustained_tensor_fraction")


def read_cluster_file(path: Path, *, nodes: int | None = None, gpus_per_node: int | None = None
                      ) -> tuple[int, int, GPUProfile, LinkProfile, LinkProfile, float | None]:
    """(nodes, GPUs per node, GPU, intra-node link, network, memory GiB or None) of the cluster a YAML file
    describes (`ClusterSpec.parse` builds it); `nodes` / `gpus_per_node` replace its counts (`NxG@FILE`: a
    profile measured on a few nodes, used for another size)."""
    where = f"cluster file {str(path)!r}"
    if not path.is_file():
        raise ClusterSpecError(
            f"{where} not found; give an existing .yaml file or a spec like 16x8xA100-80GB"
        )
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ClusterSpecError(f"{where} is not readable YAML ({one_line(exc)}); fix the file") from exc
    if not isinstance(data, dict):
        raise ClusterSpecError(
            f"{where} must hold a mapping with keys {', '.join(YAML_KEYS)}, got {type(data).__name__}"
        )
    unknown = sorted(str(k) for k in data if k not in YAML_KEYS)
    missing = [k for k in ("nodes", "gpus_per_node", "gpu") if k not in data]
    if unknown or missing:
        problem = f"unknown keys {', '.join(unknown)}" if unknown else f"missing keys {', '.join(missing)}"
        raise ClusterSpecError(
            f"{where} has {problem}; allowed keys: {', '.join(YAML_KEYS)} "
            f"(nodes, gpus_per_node and gpu are required)"
        )
    nodes = nodes or _count(data["nodes"], "nodes", where)
    gpus_per_node = gpus_per_node or _count(data["gpus_per_node"], "gpus_per_node", where)
    gpu = _yaml_gpu(data["gpu"], data, gpus_per_node, where)
    default_intra, default_inter = default_link_names(gpu, gpus_per_node)
    intra = _yaml_link(data.get("intra"), "intra", default_intra, where)
    inter = _yaml_link(data.get("inter"), "inter", default_inter, where)
    memory = data.get("memory_gib")
    if memory is not None and (
        isinstance(memory, bool) or not isinstance(memory, (int, float)) or memory <= 0
    ):
        raise ClusterSpecError(f"{where}: memory_gib must be a positive number of GiB, got {memory!r}")
    return nodes, gpus_per_node, gpu, intra, inter, None if memory is None else float(memory)


def _count(value: object, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterSpecError(f"{where}: {key} must be a whole number of at least 1, got {value!r}")
    return value


def _yaml_gpu(value: object, data: dict, gpus_per_node: int, where: str) -> GPUProfile:
    if isinstance(value, str):
        return load_gpu(resolve_gpu_name(value, where))
    if not isinstance(value, dict):
        raise ClusterSpecError(
            f"{where}: gpu must be a profile name ({', '.join(gpu_names())}) or a mapping "
            f"of GPUProfile fields, got {value!r}"
        )
    fields = dict(value)
    fields.setdefault("gpus_per_node", gpus_per_node)
    for key, link in (("intra_node", data.get("intra")), ("inter_node", data.get("inter"))):
        if isinstance(link, str):
            fields.setdefault(key, link)
        elif isinstance(link, dict) and isinstance(link.get("name"), str):
            fields.setdefault(key, link["name"])
    return _make(GPUProfile, fields, "gpu", where)


def _yaml_link(value: object, scope: str, default: str, where: str) -> LinkProfile:
    if value is None:
        return load_link(resolve_link_name(default, scope, where))
    if isinstance(value, str):
        return load_link(resolve_link_name(value, scope, where))
    if not isinstance(value, dict):
        raise ClusterSpecError(
            f"{where}: {scope} must be a link name ({', '.join(link_names(scope))}) or a "
            f"mapping of LinkProfile fields, got {value!r}"
        )
    fields = dict(value)
    fields.setdefault("scope", scope)
    if fields["scope"] != scope:
        raise ClusterSpecError(
            f"{where}: the {scope} link must have scope {scope!r}, got {fields['scope']!r}"
        )
    return _make(LinkProfile, fields, scope, where)


def _make(cls: type, fields: dict, key: str, where: str):
    names = [f.name for f in dataclasses.fields(cls)]
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    unknown = sorted(str(k) for k in fields if k not in names)
    missing = [k for k in required if k not in fields]
    if unknown or missing:
        problem = (
            f"unknown fields {', '.join(unknown)}" if unknown else f"missing fields {', '.join(missing)}"
        )
        hint = " (intra_node / inter_node may come from the file's intra / inter)" if key == "gpu" else ""
        raise ClusterSpecError(
            f"{where}: inline {key} profile has {problem}; its fields are {', '.join(names)}{hint}"
        )
    numeric = [n for n in _NUMBERS if n in fields]
    numeric += [f"busbw_gbps.{c}" for c in COLLECTIVES if isinstance(fields.get("busbw_gbps"), dict)]
    for name in numeric:
        value = _lookup(fields, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ClusterSpecError(
                f"{where}: inline {key} profile field {name} must be a number, got {value!r}"
            )
    if "busbw_gbps" in fields and not isinstance(fields["busbw_gbps"], dict):
        raise ClusterSpecError(
            f"{where}: inline {key} profile field busbw_gbps must map each of "
            f"{', '.join(COLLECTIVES)} to GB/s, got {fields['busbw_gbps']!r}"
        )
    try:
        return cls(**fields)
    except (AttributeError, TypeError, ValueError) as exc:
        raise ClusterSpecError(f"{where}: inline {key} profile is invalid ({one_line(exc)})") from exc


def _lookup(fields: dict, dotted: str) -> object:
    head, _, tail = dotted.partition(".")
    value = fields.get(head)
    return value.get(tail) if tail and isinstance(value, dict) else value
