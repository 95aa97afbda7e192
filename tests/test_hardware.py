"""Hardware profiles and ClusterSpec: every profile loads with a source per number; specs parse, round-trip and
fail with one clear line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from autoshard.errors import ClusterSpecError
from autoshard.hardware_profiles import (
    ClusterSpec,
    GPUProfile,
    LinkProfile,
    gpu_names,
    hardware_table,
    link_names,
    load_gpu,
    load_link,
)
from autoshard.hardware_profiles.profiles import COLLECTIVES

GPUS = [
    "V100-16GB",
    "V100-32GB",
    "A100-40GB",
    "A100-80GB",
    "A100-40GB-PCIe",
    "H100-80GB",
    "H200-141GB",
    "RTX5000-16GB",
    "cpu",
]
INTRA = [
    "nvswitch-a100",
    "nvswitch-h100",
    "nvswitch-h200",
    "nvlink-v100-cube",
    "nvswitch-v100",
    "pcie3",
    "pcie4",
    "loopback",
]
INTER = [
    "ib-edr-4x100",
    "ib-edr-8x100",
    "ib-hdr100-1x100",
    "ib-hdr-4x200",
    "ib-hdr-8x200",
    "ib-ndr-8x400",
    "eth-100g",
    "loopback-net",
]
GPU_NUMBERS = (
    "peak_tflops",
    "fp32_tflops",
    "hbm_gbps",
    "memory_gib",
    "num_sms",
    "max_gemm_efficiency",
    "hbm_efficiency",
    "kernel_launch_us",
    "gpus_per_node",
)


# --- profiles ----------------------------------------------------------------------------------------------


def test_every_requested_profile_exists_and_nothing_else():
    assert gpu_names() == sorted(GPUS)
    assert link_names("intra") == sorted(INTRA)
    assert link_names("inter") == sorted(INTER)


@pytest.mark.parametrize("name", GPUS)
def test_gpu_profile_loads_with_a_source_for_every_number(name):
    gpu = load_gpu(name)
    assert gpu.name == name
    for field in GPU_NUMBERS:
        assert getattr(gpu, field) > 0, field
        assert gpu.sources.get(field, "").strip(), f"{name}.{field} has no source"
    assert gpu.intra_node in link_names("intra")
    assert gpu.inter_node in link_names("inter")
    assert gpu.inter_node in gpu.allowed_networks
    assert set(gpu.allowed_networks) <= set(link_names("inter"))


@pytest.mark.parametrize("name", INTRA + INTER)
def test_link_profile_loads_with_a_source_for_every_collective_and_latency(name):
    link = load_link(name)
    assert link.name == name
    for collective in COLLECTIVES:
        assert link.busbw_gbps[collective] > 0
        assert link.sources.get(f"busbw_gbps.{collective}", "").strip(), f"{name}.{collective} has no source"
    assert link.latency_us > 0 and link.sources.get("latency_us", "").strip()


def test_key_numbers_match_references():
    # REFERENCES.md §2 / §3 (datasheets, ml-engineering MAMF, nccl-tests issues).
    assert load_gpu("A100-80GB").peak_tflops == 312.0 and load_gpu("A100-80GB").max_gemm_efficiency == 0.859
    assert load_gpu("H100-80GB").peak_tflops == 989.4 and load_gpu("H100-80GB").max_gemm_efficiency == 0.801
    assert load_gpu("A100-80GB").memory_gib == 80.0  # nvidia-smi: 81920 MiB
    assert load_link("nvswitch-a100").busbw_gbps["all_reduce"] == 230.0
    assert load_link("ib-hdr-8x200").busbw_gbps["all_reduce"] == 192.0
    assert load_link("ib-ndr-8x400").busbw_gbps["all_gather"] == 8 * 48.0


def test_only_pcie_gen5_gpus_may_use_ndr_400g():
    with_ndr = sorted(n for n in GPUS if "ib-ndr-8x400" in load_gpu(n).allowed_networks)
    assert with_ndr == ["H100-80GB", "H200-141GB"]
    assert load_gpu("cpu").allowed_networks == ("loopback-net",)


def test_gpu_profile_stores_allowed_networks_as_a_tuple():
    fields = dataclasses.asdict(load_gpu("A100-80GB"))
    fields["allowed_networks"] = ["ib-hdr-8x200"]
    assert GPUProfile(**fields).allowed_networks == ("ib-hdr-8x200",)


def test_hardware_table_lists_every_gpu_and_link_as_plain_json():
    table = hardware_table()
    assert [row["name"] for row in table["gpus"]] == sorted(GPUS)
    assert {row["name"] for row in table["links"]} == set(INTRA + INTER)
    a100 = next(row for row in table["gpus"] if row["name"] == "A100-80GB")
    assert a100 == {
        "name": "A100-80GB",
        "peak_tflops": 312.0,
        "gemm_tflops_sustained": 256.5,  # Azure's best A100 GEMM after 10,000 warm-ups
        "hbm_gbps": 2039.0,
        "memory_gib": 80.0,
        "gpus_per_node": 8,
        "intra_node": "nvswitch-a100",
        "inter_node": "ib-hdr-8x200",
    }
    hdr = next(row for row in table["links"] if row["name"] == "ib-hdr-8x200")
    assert hdr == {
        "name": "ib-hdr-8x200",
        "scope": "inter",
        "all_reduce_busbw_gbps": 192.0,
        "latency_us": 8.0,
    }
    json.dumps(table)


# --- parsing -----------------------------------------------------------------------------------------------


def test_dgx_a100_spec_defaults_to_nvswitch_and_hdr_8x200():
    spec = ClusterSpec.parse("16x8xA100-80GB")
    assert (spec.num_nodes, spec.gpus_per_node, spec.num_gpus) == (16, 8, 128)
    assert spec.gpu == load_gpu("A100-80GB")
    assert spec.intra.name == "nvswitch-a100" and spec.inter.name == "ib-hdr-8x200"
    assert spec.text == str(spec) == "16x8xA100-80GB@ib-hdr-8x200"
    assert spec.device_memory_bytes == 80 * 2**30


def test_network_suffix_overrides_the_default_network():
    spec = ClusterSpec.parse("64x8xA100-80GB@ib-hdr-4x200")
    assert spec.inter == load_link("ib-hdr-4x200") and spec.intra.name == "nvswitch-a100"
    assert spec.text == "64x8xA100-80GB@ib-hdr-4x200"


def test_dgx_h100_and_h200_default_to_ndr_8x400():
    for gpu, intra in (("H100-80GB", "nvswitch-h100"), ("H200-141GB", "nvswitch-h200")):
        spec = ClusterSpec.parse(f"2x8x{gpu}")
        assert (spec.intra.name, spec.inter.name) == (intra, "ib-ndr-8x400")


def test_names_match_case_insensitively_and_come_back_canonical():
    spec = ClusterSpec.parse(" 2X8xa100-80gb@IB-HDR-4x200 ")
    assert spec.text == "2x8xA100-80GB@ib-hdr-4x200"
    assert spec.gpu.name == "A100-80GB"


def test_one_node_of_four_cpu_ranks_uses_loopback():
    spec = ClusterSpec.parse("1x4xcpu")
    assert spec.num_gpus == 4 and spec.gpu.name == "cpu"
    assert (spec.intra.name, spec.inter.name) == ("loopback", "loopback-net")
    assert spec.text == "1x4xcpu@loopback-net"


def test_v100_node_of_16_is_a_dgx2_and_of_8_a_dgx1():
    assert (ClusterSpec.parse("4x8xV100-32GB").intra.name, ClusterSpec.parse("4x8xV100-32GB").inter.name) == (
        "nvlink-v100-cube",
        "ib-edr-4x100",
    )
    dgx2 = ClusterSpec.parse("32x16xV100-32GB")
    assert (dgx2.intra.name, dgx2.inter.name) == ("nvswitch-v100", "ib-edr-8x100")


def test_frontera_rtx_nodes_are_pcie3_with_one_100g_port():
    spec = ClusterSpec.parse("16x4xRTX5000-16GB")
    assert (spec.num_gpus, spec.intra.name, spec.inter.name) == (64, "pcie3", "ib-hdr100-1x100")


def test_spec_round_trips_through_json_text():
    for text in ("16x8xA100-80GB", "64x8xA100-80GB@ib-hdr-4x200", "1x4xcpu", "32x16xV100-32GB"):
        spec = ClusterSpec.parse(text)
        data = json.loads(json.dumps(spec.to_json()))
        assert data["version"] == 1
        assert ClusterSpec.from_json(data) == spec
        assert ClusterSpec.parse(spec.text) == spec


# --- YAML clusters -----------------------------------------------------------------------------------------


def _write(tmp_path, data, name="cluster.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_yaml_cluster_with_names_equals_the_spec_string(tmp_path):
    path = _write(tmp_path, {"nodes": 4, "gpus_per_node": 8, "gpu": "a100-80gb", "inter": "ib-hdr-4x200"})
    assert ClusterSpec.parse(str(path)) == ClusterSpec.parse("4x8xA100-80GB@ib-hdr-4x200")
    assert ClusterSpec.parse(path).text == "4x8xA100-80GB@ib-hdr-4x200"  # a Path works too


def test_yaml_cluster_with_inline_profiles_and_memory_cap_round_trips(tmp_path):
    gpu = {
        k: v
        for k, v in dataclasses.asdict(load_gpu("H100-80GB")).items()
        if k not in ("gpus_per_node", "intra_node", "inter_node", "allowed_networks", "sources")
    }
    gpu.update(name="H100-custom", peak_tflops=900.0)
    inter = {"name": "roce-8x400", "busbw_gbps": {c: 350.0 for c in COLLECTIVES}, "latency_us": 9.0}
    path = _write(
        tmp_path,
        {
            "nodes": 2,
            "gpus_per_node": 8,
            "gpu": gpu,
            "intra": "nvswitch-h100",
            "inter": inter,
            "memory_gib": 70,
        },
    )
    spec = ClusterSpec.parse(str(path))
    assert spec.gpu.name == "H100-custom" and spec.gpu.peak_tflops == 900.0 and spec.gpu.gpus_per_node == 8
    assert spec.gpu.intra_node == "nvswitch-h100" and spec.gpu.inter_node == "roce-8x400"
    assert spec.inter == LinkProfile(
        name="roce-8x400", scope="inter", busbw_gbps=inter["busbw_gbps"], latency_us=9.0
    )
    assert spec.memory_gib == 70.0 and spec.device_memory_bytes == 70 * 2**30
    assert spec.text == "2x8xH100-custom@roce-8x400"
    assert ClusterSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


# --- errors ------------------------------------------------------------------------------------------------


def _error(text) -> str:
    with pytest.raises(ClusterSpecError) as info:
        ClusterSpec.parse(text)
    message = str(info.value)
    assert "\n" not in message
    assert isinstance(info.value, ValueError)
    return message


@pytest.mark.parametrize("text", ["16by8", "16x8", "x8xA100-80GB", "16x8xA100-80GB@", "", "1.5x8xA100-80GB"])
def test_malformed_spec_shows_the_expected_form_with_an_example(text):
    message = _error(text)
    assert repr(text) in message and "NODESxGPUSxGPU[@NETWORK]" in message and "16x8xA100-80GB" in message


@pytest.mark.parametrize(
    "text, bad",
    [("0x8xA100-80GB", "0 nodes"), ("2x0xA100-80GB", "0 GPUs per node"), ("-1x8xA100-80GB", "-1 nodes")],
)
def test_zero_or_negative_counts_are_rejected(text, bad):
    message = _error(text)
    assert bad in message and "at least 1" in message


def test_unknown_gpu_lists_known_gpus_and_close_matches():
    message = _error("16x8xA100-80")
    assert "'A100-80'" in message and "known GPUs: " + ", ".join(sorted(GPUS)) in message
    assert "did you mean A100-80GB" in message


def test_unknown_network_lists_known_networks():
    message = _error("16x8xA100-80GB@ib-hdr-8x400")
    assert "'ib-hdr-8x400'" in message and "known networks: " + ", ".join(sorted(INTER)) in message
    assert "did you mean" in message


def test_intra_node_link_is_not_a_network():
    message = _error("1x8xA100-80GB@nvswitch-a100")
    assert "intra-node link, not a network" in message and "ib-hdr-8x200" in message


@pytest.mark.parametrize(
    "text, allowed",
    [
        ("16x8xA100-80GB@ib-ndr-8x400", "ib-hdr-8x200"),
        ("4x8xV100-16GB@ib-hdr-8x200", "ib-edr-4x100"),
        ("1x4xcpu@ib-hdr-8x200", "loopback-net"),
        ("1x8xH100-80GB@loopback-net", "ib-ndr-8x400"),
    ],
)
def test_network_the_gpu_cannot_have_names_it_and_the_allowed_ones(text, allowed):
    message = _error(text)
    bad = text.split("@")[1]
    assert f"network {bad!r}" in message and "networks allowed for" in message and allowed in message


@pytest.mark.parametrize(
    "text, limit",
    [
        ("1x16xA100-80GB", 8),
        ("1x9xH100-80GB", 8),
        ("1x17xV100-32GB", 16),
        ("1x17xcpu", 16),
        ("1x32xA100-40GB-PCIe", 16),
    ],
)
def test_more_gpus_per_node_than_the_node_holds_is_rejected(text, limit):
    message = _error(text)
    assert f"at most {limit} GPUs per node" in message and f"x{limit}x" in message


def test_missing_yaml_file_is_reported(tmp_path):
    message = _error(str(tmp_path / "nope.yaml"))
    assert "nope.yaml" in message and "not found" in message


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("nodes: [1, 2\n", "not readable YAML"),
        ("- 1\n- 2\n", "must hold a mapping"),
        ({"nodes": 2, "gpus_per_node": 8}, "missing keys gpu"),
        ({"nodes": 2, "gpus_per_node": 8, "gpu": "A100-80GB", "network": "eth-100g"}, "unknown keys network"),
        ({"nodes": 0, "gpus_per_node": 8, "gpu": "A100-80GB"}, "nodes must be a whole number of at least 1"),
        ({"nodes": 2, "gpus_per_node": "8", "gpu": "A100-80GB"}, "gpus_per_node must be a whole number"),
        ({"nodes": 2, "gpus_per_node": 8, "gpu": "Z100"}, "unknown GPU 'Z100'"),
        ({"nodes": 2, "gpus_per_node": 8, "gpu": "A100-80GB", "intra": "nvlink9"}, "unknown intra-node link"),
        (
            {"nodes": 2, "gpus_per_node": 8, "gpu": "A100-80GB", "memory_gib": -1},
            "memory_gib must be a positive",
        ),
        ({"nodes": 2, "gpus_per_node": 8, "gpu": {"name": "X"}}, "missing fields"),
        (
            {
                "nodes": 2,
                "gpus_per_node": 8,
                "gpu": "A100-80GB",
                "inter": {"name": "n", "busbw_gbps": {"p2p": 1.0}, "latency_us": 1.0},
            },
            "lacks all_reduce",
        ),
        (
            {"nodes": 2, "gpus_per_node": 8, "gpu": "A100-80GB", "inter": {"name": "n", "scope": "intra"}},
            "scope",
        ),
    ],
)
def test_malformed_yaml_cluster_names_the_file_and_the_problem(tmp_path, content, fragment):
    message = _error(str(_write(tmp_path, content)))
    assert "cluster.yaml" in message and fragment in message


def test_corrupt_or_future_json_is_rejected():
    data = ClusterSpec.parse("2x8xA100-80GB").to_json()
    with pytest.raises(ClusterSpecError, match="version 2 is not supported"):
        ClusterSpec.from_json({**data, "version": 2})
    with pytest.raises(ClusterSpecError, match="corrupt cluster JSON"):
        ClusterSpec.from_json({k: v for k, v in data.items() if k != "gpu"})


def test_direct_construction_validates_too():
    spec = ClusterSpec.parse("2x8xA100-80GB")
    with pytest.raises(ClusterSpecError, match="num_nodes must be a positive whole number"):
        dataclasses.replace(spec, num_nodes=0)
    with pytest.raises(ClusterSpecError, match="intra must be a LinkProfile of scope 'intra'"):
        dataclasses.replace(spec, intra=spec.inter)
    with pytest.raises(ClusterSpecError, match="memory_gib must be a positive number"):
        dataclasses.replace(spec, memory_gib=0)
