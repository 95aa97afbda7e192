"""Names of GPUs, links and networks as users write them: resolved case-insensitively against the built-in
profiles, with a suggestion when they are misspelled; and the links a node of some size has by default."""

from __future__ import annotations

import difflib

from autoshard.errors import ClusterSpecError
from autoshard.hardware_profiles.profiles import GPUProfile, gpu_names, link_names

__all__ = ["MAX_GPUS_ON_LINK", "resolve_gpu_name", "resolve_network_name", "resolve_link_name",
           "default_link_names", "one_line"]

# GPU baseboards whose fabric ends at 8 GPUs: DGX-1V hybrid cube-mesh, HGX A100 / H100 / H200 8-GPU boards
# (NVIDIA DGX-1, DGX A100 and DGX H100 datasheets); the DGX-2 NVSwitch fabric joins 16.
MAX_GPUS_ON_LINK = {
    "nvlink-v100-cube": 8,
    "nvswitch-a100": 8,
    "nvswitch-h100": 8,
    "nvswitch-h200": 8,
    "nvswitch-v100": 16,
}
# A V100 node of more than 8 GPUs is a DGX-2(H): NVSwitch inside, 8 EDR InfiniBand adapters out
# (Megatron-LM 2019: 300 GB/s GPU-to-GPU, 100 GB/s per server over 8 IB adapters; REFERENCES.md §3).
_CUBE_MESH = "nvlink-v100-cube"
_DGX2_LINKS = ("nvswitch-v100", "ib-edr-8x100")



def _resolve(given: str, known: list[str]) -> str | None:
    by_lower = {name.lower(): name for name in known}
    return by_lower.get(given.strip().lower())


def _suggest(given: str, known: list[str]) -> str:
    by_lower = {name.lower(): name for name in known}
    close = difflib.get_close_matches(given.strip().lower(), list(by_lower), n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(by_lower[c] for c in close)}?" if close else ""


def resolve_gpu_name(given: str, where: str) -> str:
    known = gpu_names()
    name = _resolve(given, known)
    if name is None:
        raise ClusterSpecError(
            f"unknown GPU {given!r} in {where}; known GPUs: {', '.join(known)}{_suggest(given, known)}"
        )
    return name


def resolve_network_name(given: str, where: str) -> str:
    networks = link_names("inter")
    name = _resolve(given, networks)
    if name is not None:
        return name
    if _resolve(given, link_names("intra")) is not None:
        raise ClusterSpecError(
            f"{given!r} in {where} is an intra-node link, not a network; "
            f"known networks: {', '.join(networks)}"
        )
    raise ClusterSpecError(
        f"unknown network {given!r} in {where}; known networks: "
        f"{', '.join(networks)}{_suggest(given, networks)}"
    )


def resolve_link_name(given: str, scope: str, where: str) -> str:
    if scope == "inter":
        return resolve_network_name(given, where)
    known = link_names("intra")
    name = _resolve(given, known)
    if name is None:
        raise ClusterSpecError(
            f"unknown intra-node link {given!r} in {where}; known intra-node links: "
            f"{', '.join(known)}{_suggest(given, known)}"
        )
    return name


def default_link_names(gpu: GPUProfile, gpus_per_node: int) -> tuple[str, str]:
    if gpu.intra_node == _CUBE_MESH and gpus_per_node > MAX_GPUS_ON_LINK[_CUBE_MESH]:
        return _DGX2_LINKS
    return gpu.intra_node, gpu.inter_node



def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
