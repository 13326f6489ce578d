"""detect_hardware's fallbacks, NVML -> /proc -> CPU, on a fake NVML and fake /proc files. Fakes: tests/harness/nvml.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from harness.nvml import (
    A100_80,
    H100,
    MEMTOTAL_KB,
    OPEN_VERSION,
    PROC_H100S,
    UUIDS,
    FakeNvml,
    NVMLError,
    gpus_of,
    h100s,
    hardware_section,
    make_proc,
    no_nvml,
    run_detect,
    uuids,
)
from harness.planning import plan_for, preset_config

from stagetrain.errors import StageError
from stagetrain.hardware.detect import detect

# --------------------------------------------------------------------------------------
# Fallbacks: NVML -> /proc -> CPU
# --------------------------------------------------------------------------------------


class TestProcFallback:
    """Without a working NVML, GPUs come from /proc/driver/nvidia; without those, the CPU."""

    def test_nvml_init_fails(self, tmp_path: Path) -> None:
        """Names and UUIDs from the information files in bus order, driver from version."""
        proc = make_proc(tmp_path / "proc", PROC_H100S)
        nvml = no_nvml()
        result = detect(hardware_section(), nvml=nvml, proc_root=proc, env={})
        assert result["source"] == "proc"
        assert result["fallbacks"] == ["nvml: NVMLError: Driver Not Loaded"]
        assert uuids(result) == UUIDS[:3]
        assert [d["index"] for d in result["devices"]] == [0, 1, 2]
        assert result["gpus_per_node"] == 3
        gpu = result["gpu"]
        assert gpu["name"] == H100
        assert gpu["key"] == "H100"
        assert gpu["memory_bytes"] is None
        assert gpu["compute_capability"] is None
        assert gpu["nvlink"] is None
        assert result["driver_version"] == "550.54.15"
        assert result["cuda_driver_version"] is None
        assert "nvmlShutdown" not in nvml.calls  # never initialised

    def test_nvml_import_error(self, tmp_path: Path) -> None:
        """An ImportError (no nvidia-ml-py) is recorded and /proc used."""
        make_proc(tmp_path / "proc", PROC_H100S)
        nvml = FakeNvml([], fail={"nvmlInit": ImportError("No module named 'pynvml'")})
        result = run_detect(nvml, tmp_path)
        assert result["source"] == "proc"
        assert result["fallbacks"] == ["nvml: ImportError: No module named 'pynvml'"]

    @pytest.mark.parametrize(
        "failing",
        [
            "nvmlDeviceGetCount",
            "nvmlDeviceGetHandleByIndex",
            "nvmlDeviceGetName",
            "nvmlDeviceGetUUID",
            "nvmlDeviceGetMemoryInfo",
            "nvmlDeviceGetCudaComputeCapability",
            "nvmlSystemGetDriverVersion",
            "nvmlSystemGetCudaDriverVersion",
        ],
    )
    def test_nvml_failing_midway(self, tmp_path: Path, failing: str) -> None:
        """An NVMLError after init: NVML shut down, the reason recorded, /proc used."""
        make_proc(tmp_path / "proc", PROC_H100S)
        nvml = FakeNvml(gpus_of(H100, 3), fail={failing: NVMLError("GPU is lost")})
        result = run_detect(nvml, tmp_path)
        assert result["source"] == "proc"
        assert result["fallbacks"] == ["nvml: NVMLError: GPU is lost"]
        assert uuids(result) == UUIDS[:3]
        assert result["cuda_driver_version"] is None  # nothing from the failed NVML
        assert nvml.calls[-1] == "nvmlShutdown"

    @pytest.mark.parametrize(
        ("value", "expected"),
        [("2,0", [UUIDS[2], UUIDS[0]]), ("1,5,0", [UUIDS[1]]), ("GPU-a3c2", [UUIDS[2]])],
    )
    def test_cuda_visible_devices_applies(
        self, tmp_path: Path, value: str, expected: list[str]
    ) -> None:
        """Indices count in PCI bus order; UUID prefixes work too."""
        make_proc(tmp_path / "proc", PROC_H100S)
        result = run_detect(no_nvml(), tmp_path, {"CUDA_VISIBLE_DEVICES": value})
        assert result["source"] == "proc"
        assert uuids(result) == expected

    def test_cuda_visible_devices_hiding_all(self, tmp_path: Path) -> None:
        """'-1' hides the /proc GPUs too: CPU, with both reasons."""
        make_proc(tmp_path / "proc", PROC_H100S)
        result = run_detect(no_nvml(), tmp_path, {"CUDA_VISIBLE_DEVICES": "-1"})
        assert result["source"] == "cpu"
        assert result["fallbacks"] == [
            "nvml: NVMLError: Driver Not Loaded",
            "proc: CUDA_VISIBLE_DEVICES='-1' hides every GPU",
        ]
        assert result["cpu_ranks"] == 2

    def test_duplicate_in_proc_is_an_error(self, tmp_path: Path) -> None:
        """The duplicate check holds for /proc devices too."""
        make_proc(tmp_path / "proc", PROC_H100S)
        with pytest.raises(StageError, match="listed twice"):
            run_detect(no_nvml(), tmp_path, {"CUDA_VISIBLE_DEVICES": "1,1"})

    def test_mixed_models_in_proc(self, tmp_path: Path) -> None:
        """Different models in /proc are refused like NVML's."""
        make_proc(
            tmp_path / "proc",
            [("0000:18:00.0", H100, UUIDS[0]), ("0000:2a:00.0", A100_80, UUIDS[1])],
        )
        with pytest.raises(StageError, match="different models") as caught:
            run_detect(no_nvml(), tmp_path)
        assert H100 in str(caught.value)
        assert A100_80 in str(caught.value)

    def test_open_kernel_module_version(self, tmp_path: Path) -> None:
        """The open kernel module's version line ('... Module for x86_64  X') parses too."""
        make_proc(tmp_path / "proc", PROC_H100S, version=OPEN_VERSION)
        assert run_detect(no_nvml(), tmp_path)["driver_version"] == "555.58.02"

    def test_aarch64_version(self, tmp_path: Path) -> None:
        """The proprietary aarch64 line (e.g. on GH200) parses."""
        version = "NVRM version: NVIDIA UNIX aarch64 Kernel Module  550.54.15  Tue Mar  5 2024\n"
        make_proc(tmp_path / "proc", PROC_H100S, version=version)
        assert run_detect(no_nvml(), tmp_path)["driver_version"] == "550.54.15"

    def test_no_version_file(self, tmp_path: Path) -> None:
        """Without the version file the driver version is unknown, not an error."""
        make_proc(tmp_path / "proc", PROC_H100S, version=None)
        result = run_detect(no_nvml(), tmp_path)
        assert result["source"] == "proc"
        assert result["driver_version"] is None

    def test_information_without_uuid_is_an_error(self, tmp_path: Path) -> None:
        """A malformed information file is named in a one-line error."""
        proc = make_proc(tmp_path / "proc", PROC_H100S[:1])
        path = proc / "driver/nvidia/gpus/0000:9a:00.0/information"
        path.write_text(f"Model: \t\t {H100}\nBus Location: \t 0000:9a:00.0\n")
        with pytest.raises(StageError, match="GPU UUID") as caught:
            run_detect(no_nvml(), tmp_path)
        assert str(path) in str(caught.value)

    def test_no_gpu_anywhere_is_the_cpu(self, tmp_path: Path) -> None:
        """No NVML, no /proc GPU files: the CPU, its cores and /proc/meminfo memory."""
        result = run_detect(no_nvml(), tmp_path)
        proc = tmp_path / "proc"
        assert result["source"] == "cpu"
        assert result["fallbacks"] == [
            "nvml: NVMLError: Driver Not Loaded",
            f"proc: no {proc}/driver/nvidia/gpus/*/information",
        ]
        assert result["gpu"] is None
        assert result["devices"] == []
        assert result["gpus_per_node"] == 0
        assert result["cpu_ranks"] == 2
        assert result["cpu"] == {
            "cores": len(os.sched_getaffinity(0)),
            "memory_bytes": MEMTOTAL_KB * 1024,
        }
        assert result["driver_version"] == "550.54.15"  # the version file is still read

    def test_cpu_ranks_come_from_config(self, tmp_path: Path) -> None:
        """On the CPU the planned ranks are hardware.cpu_ranks."""
        assert run_detect(no_nvml(), tmp_path, cpu_ranks=6)["cpu_ranks"] == 6

    def test_cpu_facts_are_recorded_with_gpus_too(self, tmp_path: Path) -> None:
        """hardware.json always carries the host's cores and memory."""
        result = run_detect(h100s(2), tmp_path)
        assert result["cpu"]["memory_bytes"] == MEMTOTAL_KB * 1024
        assert result["cpu"]["cores"] >= 1


def test_a_plan_for_gpus_found_in_proc_is_one_line(tmp_path: Path) -> None:
    """/proc names the GPUs but not their memory: the planner says so in one line (it was a
    TypeError inside the memory model)."""
    proc = make_proc(tmp_path / "proc", PROC_H100S[:2])  # two devices: a layout divides them
    hardware = detect(hardware_section(), nvml=no_nvml(), proc_root=proc, env={})
    assert hardware["source"] == "proc" and hardware["gpu"] is not None
    with pytest.raises(
        StageError, match=r"^hardware.json: the memory of GPU .* is unknown \(source proc\)"
    ):
        plan_for(preset_config("deepseek-moe-h100"), dict(hardware))
