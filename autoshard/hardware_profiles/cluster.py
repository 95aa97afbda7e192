"""ClusterSpec: how many nodes, how many GPUs per node, which GPU, which intra-node link and which network.

Accepted by `ClusterSpec.parse`:

    16x8xA100-80GB                 16 nodes x 8 GPUs; links of the GPU's usual node (DGX A100: nvswitch-a100,
                                   ib-hdr-8x200)
    64x8xA100-80GB@ib-hdr-4x200    the same GPU on another network
    2x16xV100-32GB                 more than 8 V100 per node is a DGX-2: nvswitch-v100, ib-edr-8x100
    1x4xcpu                        4 local CPU ranks (gloo over loopback)
    my_cluster.yaml                a custom cluster: GPU and links by name or inline (see cluster_file.py),
                                   e.g. what `autoshard profile -o my_cluster.yaml` measured
    16x8@my_cluster.yaml           the same GPU and links, 16 nodes of 8

Names match case-insensitively. Every mistake raises `ClusterSpecError` (a ValueError) whose one line says
what was given, what is allowed and how to fix it. `text` is the canonical NODESxGPUSxGPU@NETWORK form; for a
YAML cluster with custom parts it only names them, and `to_json` is the faithful record (it carries every
profile number, so a saved plan does not depend on the profile files of the machine that reads it).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from autoshard.errors import ClusterSpecError
from autoshard.hardware_profiles.cluster_file import read_cluster_file
from autoshard.hardware_profiles.names import (
    MAX_GPUS_ON_LINK,
    default_link_names,
    one_line,
    resolve_gpu_name,
    resolve_network_name,
)
from autoshard.hardware_profiles.profiles import (
    GPUProfile,
    LinkProfile,
    link_names,
    load_gpu,
    load_link,
)

__all__ = ["ClusterSpec", "CLUSTER_JSON_VERSION", "MAX_GPUS_PER_NODE"]

CLUSTER_JSON_VERSION = 1

# The largest single-fabric nodes of the supported GPUs hold 16 (DGX-2 / HGX-2: 16 V100 on NVSwitch,
# Megatron-LM 2019; 10- and 16-slot PCIe servers exist too). Nothing we model has more.
MAX_GPUS_PER_NODE = 16

_SCALED_FILE_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*@\s*(\S+\.ya?ml)\s*$", re.IGNORECASE)
_SPEC_RE = re.compile(r"^\s*([+-]?\d+)\s*[xX]\s*([+-]?\d+)\s*[xX]\s*([^@\s]+)\s*(?:@\s*(\S+))?\s*$")
_FORM = "NODESxGPUSxGPU[@NETWORK] such as 16x8xA100-80GB or 64x8xA100-80GB@ib-hdr-4x200, or a .yaml file"


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    num_nodes: int
    gpus_per_node: int
    gpu: GPUProfile
    intra: LinkProfile
    inter: LinkProfile
    text: str  # canonical spec, e.g. "16x8xA100-80GB@ib-hdr-8x200"
    memory_gib: float | None = None  # None: the GPU profile's memory; a YAML cluster may set less

    def __post_init__(self) -> None:
        for name in ("num_nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ClusterSpecError(
                    f"cluster {self.text!r}: {name} must be a positive whole number, got {value!r}; "
                    f"write e.g. 2x8x{_gpu_name(self.gpu)}"
                )
        if not isinstance(self.text, str) or not self.text.strip():
            raise ClusterSpecError(f"cluster text must be a non-empty spec string, got {self.text!r}")
        if not isinstance(self.gpu, GPUProfile):
            raise ClusterSpecError(
                f"cluster {self.text!r}: gpu must be a GPUProfile, got {type(self.gpu).__name__}"
            )
        for name, scope in (("intra", "intra"), ("inter", "inter")):
            link = getattr(self, name)
            if not isinstance(link, LinkProfile) or link.scope != scope:
                raise ClusterSpecError(
                    f"cluster {self.text!r}: {name} must be a LinkProfile of scope {scope!r}, got {_describe(link)}; "
                    f"known {scope}-node links: {', '.join(link_names(scope))}"
                )
        if self.memory_gib is not None and (
            isinstance(self.memory_gib, bool)
            or not isinstance(self.memory_gib, (int, float))
            or self.memory_gib <= 0
        ):
            raise ClusterSpecError(
                f"cluster {self.text!r}: memory_gib must be a positive number of GiB or left out, got {self.memory_gib!r}"
            )
        self._check_node_size()
        self._check_network()

    def _check_node_size(self) -> None:
        limit = MAX_GPUS_ON_LINK.get(self.intra.name, MAX_GPUS_PER_NODE)
        if self.gpus_per_node <= limit:
            return
        where = (
            f"a node of {self.gpu.name} on {self.intra.name}"
            if self.intra.name in MAX_GPUS_ON_LINK
            else "any supported node"
        )
        nodes = math.ceil(self.num_gpus / limit)
        raise ClusterSpecError(
            f"cluster {self.text!r}: {self.gpus_per_node} GPUs per node is more than {where} holds ({limit}); "
            f"use at most {limit} GPUs per node, e.g. {nodes}x{limit}x{self.gpu.name}"
        )

    def _check_network(self) -> None:
        allowed = self.gpu.allowed_networks
        if not allowed or self.inter.name in allowed or self.inter.name not in link_names("inter"):
            return  # custom (inline) networks are the user's call
        example = self.gpu.inter_node if self.gpu.inter_node in allowed else allowed[0]
        raise ClusterSpecError(
            f"cluster {self.text!r}: nodes of {self.gpu.name} cannot drive network {self.inter.name!r}; "
            f"networks allowed for {self.gpu.name}: {', '.join(allowed)} (e.g. "
            f"{self.num_nodes}x{self.gpus_per_node}x{self.gpu.name}@{example})"
        )

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def device_memory_bytes(self) -> float:
        gib = self.gpu.memory_gib if self.memory_gib is None else self.memory_gib
        return float(gib) * 2**30

    @property
    def device_memory_text(self) -> str:
        """Usable memory per GPU as printed beside a need in GiB: to the hundredth where it is not whole (an H100's
        79.65, which rounded to 80 would read as room for a 79.9 GiB configuration it rejects)."""
        return f"{self.device_memory_bytes / 2**30:.2f}".rstrip("0").rstrip(".") + " GiB"

    def __str__(self) -> str:
        return self.text

    @classmethod
    def parse(cls, text: str | os.PathLike) -> ClusterSpec:
        """A spec string NODESxGPUSxGPU[@NETWORK] or the path of a .yaml cluster file (see the module doc)."""
        scaled = _SCALED_FILE_RE.match(text) if isinstance(text, str) else None
        if scaled:
            return build_cluster(*read_cluster_file(Path(scaled[3]), nodes=int(scaled[1]),
                                                    gpus_per_node=int(scaled[2])))
        if isinstance(text, os.PathLike) or (
            isinstance(text, str) and text.strip().lower().endswith((".yaml", ".yml"))
        ):
            return build_cluster(*read_cluster_file(Path(text)))
        if not isinstance(text, str):
            raise ClusterSpecError(
                f"cluster spec must be a string or a path, got {type(text).__name__}; expected {_FORM}"
            )
        match = _SPEC_RE.match(text)
        if match is None:
            raise ClusterSpecError(f"malformed cluster spec {text!r}; expected {_FORM}")
        num_nodes, gpus_per_node = int(match[1]), int(match[2])
        for name, value in (("nodes", num_nodes), ("GPUs per node", gpus_per_node)):
            if value < 1:
                raise ClusterSpecError(
                    f"cluster spec {text!r} asks for {value} {name}; both counts must be at "
                    f"least 1, e.g. 2x8x{match[3]}"
                )
        gpu = load_gpu(resolve_gpu_name(match[3], f"cluster spec {text!r}"))
        intra_name, inter_name = default_link_names(gpu, gpus_per_node)
        if match[4]:
            inter_name = resolve_network_name(match[4], f"cluster spec {text!r}")
        return build_cluster(
            num_nodes, gpus_per_node, gpu, load_link(intra_name), load_link(inter_name), None
        )

    def to_json(self) -> dict:
        """Versioned, self-contained record: every profile number travels with it."""
        return {
            "version": CLUSTER_JSON_VERSION,
            "text": self.text,
            "num_nodes": self.num_nodes,
            "gpus_per_node": self.gpus_per_node,
            "memory_gib": self.memory_gib,
            "gpu": _profile_json(self.gpu),
            "intra": _profile_json(self.intra),
            "inter": _profile_json(self.inter),
        }

    @classmethod
    def from_json(cls, data: dict) -> ClusterSpec:
        if not isinstance(data, dict):
            raise ClusterSpecError(
                f"cluster JSON must be an object, got {type(data).__name__}; "
                f"write it with ClusterSpec.to_json()"
            )
        version = data.get("version")
        if version != CLUSTER_JSON_VERSION:
            raise ClusterSpecError(
                f"cluster JSON version {version!r} is not supported (this autoshard reads "
                f"version {CLUSTER_JSON_VERSION}); re-create it with ClusterSpec.parse(...).to_json()"
            )
        try:
            return cls(
                num_nodes=data["num_nodes"],
                gpus_per_node=data["gpus_per_node"],
                gpu=GPUProfile(**data["gpu"]),
                intra=LinkProfile(**data["intra"]),
                inter=LinkProfile(**data["inter"]),
                text=data["text"],
                memory_gib=data.get("memory_gib"),
            )
        except ClusterSpecError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ClusterSpecError(
                f"corrupt cluster JSON ({one_line(exc)}); write it with ClusterSpec.to_json()"
            ) from exc


def build_cluster(
    num_nodes: int,
    gpus_per_node: int,
    gpu: GPUProfile,
    intra: LinkProfile,
    inter: LinkProfile,
    memory_gib: float | None,
) -> ClusterSpec:
    text = f"{num_nodes}x{gpus_per_node}x{gpu.name}@{inter.name}"
    return ClusterSpec(
        num_nodes=num_nodes,
        gpus_per_node=gpus_per_node,
        gpu=gpu,
        intra=intra,
        inter=inter,
        text=text,
        memory_gib=memory_gib,
    )


# --- helpers -----------------------------------------------------------------------------------------------


def _profile_json(profile: GPUProfile | LinkProfile) -> dict:
    data = dataclasses.asdict(profile)
    if "allowed_networks" in data:
        data["allowed_networks"] = list(data["allowed_networks"])
    return data


def _gpu_name(gpu: object) -> str:
    return gpu.name if isinstance(gpu, GPUProfile) else "A100-80GB"


def _describe(link: object) -> str:
    if isinstance(link, LinkProfile):
        return f"{link.name!r} of scope {link.scope!r}"
    return type(link).__name__
