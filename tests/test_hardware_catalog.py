"""The GPU catalog, the node count from config or Slurm, described hardware, and hardware.json as JSON. Fakes: tests/harness/nvml.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from harness.nvml import (
    A100_40_MEMORY,
    A100_80,
    A100_80_MEMORY,
    H100,
    H100_MEMORY,
    H200_MEMORY,
    MIB,
    MIG_1G,
    MIG_1G_MEMORY,
    PROC_H100S,
    UUIDS,
    FakeGpu,
    FakeNvml,
    gpus_of,
    h100s,
    hardware_section,
    make_proc,
    mig_gpu,
    no_nvml,
    run_detect,
)

from stagetrain.errors import StageError
from stagetrain.hardware.catalog import GpuSpec, catalog, gpu_spec, match_gpu
from stagetrain.hardware.detect import detect, slurm_allocation
from stagetrain.hardware.report import (
    CpuFacts,
    DeviceRecord,
    GpuSpecRecord,
    GpuSummary,
    HardwareReport,
    SlurmAllocation,
)
from stagetrain.hardware.visible import Device

# --------------------------------------------------------------------------------------
# Catalog
# --------------------------------------------------------------------------------------


class TestCatalog:
    """NVML names to catalog keys (first match wins) and catalog lookups."""

    @pytest.mark.parametrize(
        ("name", "key"),
        [
            ("NVIDIA H100 80GB HBM3", "H100"),
            ("NVIDIA H100 PCIe", "H100-PCIe"),
            ("NVIDIA H100 NVL", "H100-NVL"),
            ("NVIDIA H200", "H200"),
            ("NVIDIA H200 NVL", "H200-NVL"),
            ("NVIDIA GH200 480GB", "GH200"),
            ("NVIDIA GH200 144G HBM3e", "GH200"),
            ("NVIDIA B200", "B200"),
            ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
            ("NVIDIA A100 80GB PCIe", "A100-80GB"),
            ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
            ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
            ("NVIDIA A10G", "A10G"),
            ("NVIDIA A10", "A10"),
            ("NVIDIA L40S", "L40S"),
            ("NVIDIA L4", "L4"),
            ("Tesla V100-SXM2-32GB", "V100-32GB"),
            ("Tesla V100-SXM2-16GB", "V100-16GB"),
            ("nvidia h100 80gb hbm3", "H100"),
            ("NVIDIA Z9000", None),
            ("NVIDIA L40", None),
            ("NVIDIA A40", None),
            ("NVIDIA GeForce RTX 4090", None),
        ],
    )
    def test_match_gpu(self, name: str, key: str | None) -> None:
        """More specific names win: GH200 and H200 are not H100, A10G is not A10."""
        assert match_gpu(name) == key

    @pytest.mark.parametrize(
        ("name", "memory", "capability", "key"),
        [
            ("NVIDIA H200", H200_MEMORY, (9, 0), "H200"),
            ("NVIDIA GH200 480GB", 97871 * MIB, (9, 0), "GH200"),
            ("NVIDIA H100 PCIe", H100_MEMORY, (9, 0), "H100-PCIe"),
            (A100_80, A100_80_MEMORY, (8, 0), "A100-80GB"),
            ("NVIDIA A100-SXM4-40GB", A100_40_MEMORY, (8, 0), "A100-40GB"),
            ("NVIDIA A10G", 23028 * MIB, (8, 6), "A10G"),
            ("NVIDIA L40S", 46068 * MIB, (8, 9), "L40S"),
        ],
    )
    def test_detected_key_and_spec(
        self,
        tmp_path: Path,
        name: str,
        memory: int,
        capability: tuple[int, int],
        key: str,
    ) -> None:
        """Detection records the matched key, its spec and NVML's own figures."""
        nvml = FakeNvml(gpus_of(name, 4, memory, compute_capability=capability))
        gpu = run_detect(nvml, tmp_path)["gpu"]
        assert gpu["key"] == key
        assert gpu["spec"] == {**gpu["spec"], "key": key}
        assert gpu["spec"]["memory_gib"] == catalog()[key].memory_gib
        assert gpu["memory_bytes"] == memory
        assert gpu["compute_capability"] == f"{capability[0]}.{capability[1]}"

    def test_unknown_gpu_is_not_a_detection_error(self, tmp_path: Path) -> None:
        """An unknown name is detected with key None; the planner decides what to do."""
        result = run_detect(FakeNvml(gpus_of("NVIDIA Z9000", 2)), tmp_path)
        assert result["source"] == "nvml"
        assert result["gpu"]["name"] == "NVIDIA Z9000"
        assert result["gpu"]["key"] is None
        assert result["gpu"]["spec"] is None
        assert result["gpus_per_node"] == 2

    def test_gpu_spec_unknown_key(self) -> None:
        """An unknown key is a one-line error naming it and every known key."""
        with pytest.raises(StageError) as caught:
            gpu_spec("Z9000")
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith("hardware.gpu: GPU key 'Z9000' is not in the catalog")
        assert "catalog.yaml" in message
        for key in ("H100", "H200", "GH200", "A100-80GB", "A10G", "A10", "L40S"):
            assert key in message.split("known: ")[1].split(", ")

    def test_gpu_spec_where(self) -> None:
        """The error names the config key the caller passes."""
        with pytest.raises(StageError, match=r"^plan\.gpu: GPU key 'h100'"):
            gpu_spec("h100", where="plan.gpu")

    def test_peak_tflops(self) -> None:
        """BF16 peak where the tensor cores run BF16, FP16 peak otherwise (V100)."""
        assert gpu_spec("H100").peak_tflops == 989.5
        assert gpu_spec("V100-32GB").peak_tflops == 125

    def test_every_key_matches_its_own_name(self) -> None:
        """No entry is shadowed by an earlier one for the name its key spells."""
        for key in catalog():
            assert match_gpu(f"NVIDIA {key.replace('-', ' ')}") == key, key


# --------------------------------------------------------------------------------------
# Nodes: config or Slurm
# --------------------------------------------------------------------------------------

SLURM_ENV = {"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}


class TestSlurm:
    """The node count comes from the Slurm allocation when there is one."""

    def test_allocation(self, tmp_path: Path) -> None:
        """Nodes and nodelist from SLURM_*; config nodes=1 (default) is no conflict."""
        result = run_detect(h100s(8), tmp_path, SLURM_ENV)
        assert result["nodes"] == 2
        assert result["nodes_source"] == "slurm"
        assert result["slurm"] == {
            "job_id": "1",
            "nodes": 2,
            "nodelist": "n[1-2]",
            "gpus_on_node": None,
        }
        assert result["warnings"] == []

    def test_a_one_node_detection_job_keeps_the_configured_nodes(self, tmp_path: Path) -> None:
        """profiles/slurm runs detection as a one-node job; training asks for hardware.nodes itself."""
        env = {"SLURM_JOB_ID": "3", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "gpu7",
               "SLURM_GPUS_ON_NODE": "8"}  # fmt: skip
        result = run_detect(h100s(8), tmp_path, env, nodes=4)
        assert (result["nodes"], result["nodes_source"], result["warnings"]) == (4, "config", [])
        assert result["slurm"] == {"job_id": "3", "nodes": 1, "nodelist": "gpu7", "gpus_on_node": 8}

    def test_config_differing_from_allocation_warns(self, tmp_path: Path) -> None:
        """hardware.nodes=4 in a 2-node allocation: the allocation wins, with a warning."""
        result = run_detect(h100s(8), tmp_path, SLURM_ENV, nodes=4)
        assert result["nodes"] == 2
        assert result["warnings"] == [
            "hardware.nodes=4 but the Slurm allocation has 2 nodes; using the allocation"
        ]

    def test_config_matching_allocation(self, tmp_path: Path) -> None:
        """hardware.nodes equal to the allocation: no warning."""
        result = run_detect(h100s(8), tmp_path, SLURM_ENV, nodes=2)
        assert result["nodes"] == 2
        assert result["warnings"] == []

    def test_older_variable_names(self, tmp_path: Path) -> None:
        """SLURM_NNODES and SLURM_NODELIST are read when the JOB_ forms are absent."""
        env = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "3", "SLURM_NODELIST": "gpu[01-03]"}
        result = run_detect(h100s(8), tmp_path, env)
        assert result["slurm"] == {
            "job_id": "77",
            "nodes": 3,
            "nodelist": "gpu[01-03]",
            "gpus_on_node": None,
        }

    def test_inside_a_step_of_a_stripped_job_the_controller_names_the_nodes(self) -> None:
        """Snakemake's job step leaves SLURM_JOB_ID and runs the stage in an `srun -n1`
        step, whose SLURM_NNODES and SLURM_JOB_NODELIST count only that step's node."""
        env = {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0", "SLURM_NNODES": "1",
               "SLURM_JOB_NODELIST": "node1"}  # fmt: skip
        answer = "JobId=5 NodeList=node[1-2] NumNodes=2 NumCPUs=4"
        found = slurm_allocation(env, lambda job_id: answer)
        assert (found["nodes"], found["nodelist"]) == (2, "node1,node2")

    def test_no_allocation_uses_config(self, tmp_path: Path) -> None:
        """Outside Slurm the config's node count stands."""
        env = {"SLURM_JOB_NUM_NODES": "2"}  # no SLURM_JOB_ID: not in a job
        result = run_detect(h100s(8), tmp_path, env, nodes=4)
        assert result["nodes"] == 4
        assert result["nodes_source"] == "config"
        assert result["slurm"] is None

    def test_slurm_on_cpu(self, tmp_path: Path) -> None:
        """The allocation is read whatever the device source."""
        result = run_detect(no_nvml(), tmp_path, SLURM_ENV)
        assert result["source"] == "cpu"
        assert result["nodes"] == 2


# --------------------------------------------------------------------------------------
# Describe mode
# --------------------------------------------------------------------------------------


class TestDescribe:
    """source: describe builds hardware.json from the config, touching nothing."""

    def test_described_h100_node(self, tmp_path: Path) -> None:
        """Catalog figures stand in for measurements; NVML and the env are not read."""
        nvml = h100s(8)
        section = hardware_section(
            source="describe", gpu="H100", gpus_per_node=8, host_memory_gib=512, nodes=2
        )
        result = detect(
            section,
            nvml=nvml,
            proc_root=tmp_path / "absent",
            env={**SLURM_ENV, "SLURM_JOB_NUM_NODES": "9"},
        )
        assert nvml.calls == []
        assert result["source"] == "config"
        assert result["nodes"] == 2
        assert result["nodes_source"] == "config"
        assert result["gpus_per_node"] == 8
        assert result["gpu"]["key"] == "H100"
        assert result["gpu"]["memory_bytes"] == int(79.6 * 2**30)
        assert result["gpu"]["nvlink"] is True
        assert result["gpu"]["spec"]["bf16_tflops"] == 989.5
        assert result["cpu"] == {"cores": None, "memory_bytes": 512 * 2**30}
        assert result["devices"] == []

    def test_described_gpu_without_nvlink(self) -> None:
        """An L40S has no NVLink; host memory unset stays None."""
        section = hardware_section(source="describe", gpu="L40S", gpus_per_node=4)
        result = detect(section, nvml=h100s(1), env={})
        assert result["gpu"]["key"] == "L40S"
        assert result["gpu"]["nvlink"] is False
        assert result["cpu"]["memory_bytes"] is None

    @pytest.mark.parametrize(
        "overrides",
        [{"gpu": "H100"}, {"gpus_per_node": 8}, {}],
        ids=["no-count", "no-gpu", "neither"],
    )
    def test_missing_fields(self, overrides: dict[str, Any]) -> None:
        """gpu and gpus_per_node are both required."""
        section = hardware_section(source="describe", **overrides)
        with pytest.raises(StageError, match="hardware.gpus_per_node"):
            detect(section, nvml=h100s(1), env={})

    def test_unknown_key(self) -> None:
        """An unknown key names hardware.gpu and the bad value."""
        section = hardware_section(source="describe", gpu="Z9000", gpus_per_node=8)
        with pytest.raises(StageError, match=r"^hardware\.gpu: GPU key 'Z9000'"):
            detect(section, nvml=h100s(1), env={})


# --------------------------------------------------------------------------------------
# hardware.json is JSON
# --------------------------------------------------------------------------------------


def _scenarios(tmp_path: Path) -> dict[str, dict[str, Any]]:
    """One hardware.json per source and shape."""
    make_proc(tmp_path / "proc", PROC_H100S)
    cpu_root = make_proc(tmp_path / "cpu-proc")
    return {
        "nvml": run_detect(h100s(8), tmp_path, SLURM_ENV, nodes=4),
        "mig": run_detect(FakeNvml([mig_gpu((MIG_1G, MIG_1G_MEMORY))]), tmp_path),
        "bytes": run_detect(
            FakeNvml([FakeGpu(name=H100.encode(), uuid=UUIDS[0].encode(), memory_bytes=1)]),
            tmp_path,
        ),
        "proc": run_detect(no_nvml(), tmp_path),
        "cpu": detect(hardware_section(), nvml=no_nvml(), proc_root=cpu_root, env={}),
        "describe": detect(
            hardware_section(source="describe", gpu="H200", gpus_per_node=8), env={}
        ),
    }


@pytest.mark.parametrize("scenario", ["nvml", "mig", "bytes", "proc", "cpu", "describe"])
def test_hardware_json_round_trips(tmp_path: Path, scenario: str) -> None:
    """json.dumps accepts the result and loading it back gives the same dict."""
    result = _scenarios(tmp_path)[scenario]
    assert json.loads(json.dumps(result)) == result


def test_every_source_has_the_same_keys(tmp_path: Path) -> None:
    """Consumers can read any hardware.json the same way."""
    keys = {name: set(result) for name, result in _scenarios(tmp_path).items()}
    assert len({frozenset(k) for k in keys.values()}) == 1, keys


def test_every_source_has_the_keys_its_types_name(tmp_path: Path) -> None:
    """hardware.json against `hardware.report`'s TypedDicts (`speed`, which the stage adds
    after `detect`, is its one optional key); the records copied from a dataclass name its fields."""
    assert GpuSpecRecord.__required_keys__ == set(GpuSpec.__dataclass_fields__)
    assert DeviceRecord.__required_keys__ == set(Device.__dataclass_fields__)
    assert HardwareReport.__optional_keys__ == {"speed"}
    for name, result in _scenarios(tmp_path).items():
        assert set(result) == HardwareReport.__required_keys__, name
        assert set(result["cpu"]) == CpuFacts.__required_keys__, name
        assert result["slurm"] is None or set(result["slurm"]) == SlurmAllocation.__required_keys__
        assert all(set(d) == DeviceRecord.__required_keys__ for d in result["devices"]), name
        if result["gpu"] is not None:
            assert set(result["gpu"]) == GpuSummary.__required_keys__, name
