"""detect_hardware: the real detection code run against a fake NVML and fake /proc files.

NVML is faked through the one seam `detect` offers (`nvml=`), /proc through
`proc_root=` (a tmp_path holding driver files in the driver's own format) and
the environment through `env=`; nothing else is replaced.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from stagetrain.errors import StageError
from stagetrain.hardware.catalog import catalog, gpu_spec, match_gpu
from stagetrain.hardware.detect import detect, slurm_allocation
from stagetrain.hardware.visible import Device, select_visible

# --------------------------------------------------------------------------------------
# Fake NVML
# --------------------------------------------------------------------------------------

MIB = 2**20
H100_MEMORY = 81559 * MIB  # what NVML reports for an "NVIDIA H100 80GB HBM3"
H200_MEMORY = 143771 * MIB
A100_80_MEMORY = 81920 * MIB
A100_40_MEMORY = 40960 * MIB
MIG_1G_MEMORY = 9856 * MIB
MIG_3G_MEMORY = 40192 * MIB

H100 = "NVIDIA H100 80GB HBM3"
A100_80 = "NVIDIA A100-SXM4-80GB"
MIG_1G = "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
MIG_3G = "NVIDIA H100 80GB HBM3 MIG 3g.40gb"

# Eight GPU UUIDs; the first two share the prefix "GPU-5b" (ambiguous) while
# "GPU-5b0f" names only the first.
UUIDS = [
    "GPU-5b0f6f3a-2c4e-4a8f-9d1b-7e3c5a9f0b21",
    "GPU-5b1e0d47-93fa-6c25-e81d-4f6a2b7c9d03",
    "GPU-a3c2e1f0-7b6d-4c5e-8f9a-0b1c2d3e4f56",
    "GPU-c7d8e9f0-1a2b-3c4d-5e6f-7a8b9c0d1e2f",
    "GPU-1f2e3d4c-5b6a-7988-a7b6-c5d4e3f2a1b0",
    "GPU-8e7d6c5b-4a39-2817-0f1e-2d3c4b5a6978",
    "GPU-2468ace0-1357-9bdf-0246-8ace13579bdf",
    "GPU-fedcba98-7654-3210-0123-456789abcdef",
]
MIG_UUIDS = [
    "MIG-1d2c3b4a-5e6f-5a7b-8c9d-0e1f2a3b4c5d",
    "MIG-7f6e5d4c-3b2a-5918-a7b6-c5d4e3f2a1b0",
    "MIG-0a9b8c7d-6e5f-5a4b-9c3d-2e1f0a9b8c7d",
]


class NVMLError(Exception):
    """Stands in for pynvml.NVMLError (the code catches `nvml.NVMLError`)."""


@dataclass
class FakeMig:
    """One MIG instance; the object is also its NVML handle."""

    name: str
    uuid: str
    memory_bytes: int


@dataclass
class FakeGpu:
    """One physical GPU; the object is also its NVML handle.

    `mig_mode` None means the GPU is not MIG-capable (nvmlDeviceGetMigMode raises);
    `nvlink` None means NVLink is not supported (nvmlDeviceGetNvLinkState raises).
    """

    name: str | bytes
    uuid: str | bytes
    memory_bytes: int
    compute_capability: tuple[int, int] = (9, 0)
    nvlink: bool | None = True
    mig_mode: bool | None = None
    migs: list[FakeMig] = field(default_factory=list)


@dataclass
class _Memory:
    total: int
    free: int = 0
    used: int = 0


class FakeNvml:
    """The subset of pynvml that detect.py calls, answering from a list of FakeGpu.

    `fail` maps a function name to the exception that function raises; `calls`
    records every call by name so tests can check init/shutdown pairing.
    """

    NVMLError = NVMLError
    MAX_MIG_DEVICES = 7

    def __init__(
        self,
        gpus: Sequence[FakeGpu],
        *,
        driver: str | bytes = "550.54.15",
        cuda: int = 12040,
        fail: Mapping[str, BaseException] | None = None,
    ) -> None:
        self.gpus = list(gpus)
        self.driver = driver
        self.cuda = cuda
        self.fail = dict(fail or {})
        self.calls: list[str] = []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise self.fail[name]

    def nvmlInit(self) -> None:
        self._call("nvmlInit")

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._call("nvmlDeviceGetHandleByIndex")
        return self.gpus[index]

    def nvmlDeviceGetName(self, handle: FakeGpu | FakeMig) -> str | bytes:
        self._call("nvmlDeviceGetName")
        return handle.name

    def nvmlDeviceGetUUID(self, handle: FakeGpu | FakeMig) -> str | bytes:
        self._call("nvmlDeviceGetUUID")
        return handle.uuid

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu | FakeMig) -> _Memory:
        self._call("nvmlDeviceGetMemoryInfo")
        return _Memory(total=handle.memory_bytes)

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeGpu) -> tuple[int, int]:
        self._call("nvmlDeviceGetCudaComputeCapability")
        return handle.compute_capability

    def nvmlDeviceGetMigMode(self, handle: FakeGpu) -> tuple[int, int]:
        self._call("nvmlDeviceGetMigMode")
        if handle.mig_mode is None:
            raise NVMLError("Not Supported")
        mode = int(handle.mig_mode)
        return mode, mode

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeGpu) -> int:
        self._call("nvmlDeviceGetMaxMigDeviceCount")
        return self.MAX_MIG_DEVICES

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeGpu, slot: int) -> FakeMig:
        self._call("nvmlDeviceGetMigDeviceHandleByIndex")
        if slot >= len(handle.migs):
            raise NVMLError("Not Found")
        return handle.migs[slot]

    def nvmlDeviceGetNvLinkState(self, handle: FakeGpu, link: int) -> int:
        self._call("nvmlDeviceGetNvLinkState")
        if handle.nvlink is None:
            raise NVMLError("Not Supported")
        return int(handle.nvlink)

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        self._call("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._call("nvmlSystemGetCudaDriverVersion")
        return self.cuda


def gpus_of(name: str, count: int, memory: int = H100_MEMORY, **kwargs: Any) -> list[FakeGpu]:
    """`count` identical GPUs with the UUIDs of UUIDS, in order."""
    return [FakeGpu(name=name, uuid=UUIDS[i], memory_bytes=memory, **kwargs) for i in range(count)]


def h100s(count: int = 8, **kwargs: Any) -> FakeNvml:
    """An NVML that sees `count` H100 SXM GPUs."""
    return FakeNvml(gpus_of(H100, count, **kwargs))


def mig_gpu(*profiles: tuple[str, int], uuid: str = UUIDS[0]) -> FakeGpu:
    """An H100 in MIG mode holding one instance per (name, memory) profile."""
    migs = [
        FakeMig(name=name, uuid=MIG_UUIDS[i], memory_bytes=memory)
        for i, (name, memory) in enumerate(profiles)
    ]
    return FakeGpu(name=H100, uuid=uuid, memory_bytes=H100_MEMORY, mig_mode=True, migs=migs)


def hardware_section(**overrides: Any) -> dict[str, Any]:
    """The validated `hardware` config section, with the schema defaults."""
    section: dict[str, Any] = {
        "source": "detect",
        "gpu": None,
        "gpus_per_node": None,
        "host_memory_gib": None,
        "nodes": 1,
        "cpu_ranks": 2,
        "inter_node_gbps": 50,
    }
    section.update(overrides)
    return section


# --------------------------------------------------------------------------------------
# Fake /proc
# --------------------------------------------------------------------------------------

PROPRIETARY_VERSION = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
    "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n"
)
OPEN_VERSION = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  555.58.02  Release Build  "
    "(dvs-builder@U16-I3-B03-4-3)  Tue Jun 25 01:26:03 UTC 2024\n"
    "GCC version:  gcc version 14.2.1 20240801 (Red Hat 14.2.1-1) (GCC)\n"
)
MEMTOTAL_KB = 16384000


def information(name: str, uuid: str, bus: str, minor: int) -> str:
    """A /proc/driver/nvidia/gpus/<bus>/information file as the driver writes it."""
    return (
        f"Model: \t\t {name}\n"
        "IRQ:   \t\t 0\n"
        f"GPU UUID: \t {uuid}\n"
        "Video BIOS: \t 96.00.89.00.01\n"
        "Bus Type: \t PCIe\n"
        "DMA Size: \t 52 bits\n"
        "DMA Mask: \t 0xfffffffffffff\n"
        f"Bus Location: \t {bus}\n"
        f"Device Minor: \t {minor}\n"
        "GPU Firmware: \t 550.54.15\n"
        "GPU Excluded:\t No\n"
    )


def make_proc(
    root: Path,
    gpus: Iterable[tuple[str, str, str]] = (),
    *,
    version: str | None = PROPRIETARY_VERSION,
    meminfo: str | None = f"MemTotal:       {MEMTOTAL_KB} kB\nMemFree:         1024000 kB\n",
) -> Path:
    """Write a fake /proc under `root`: one information file per (bus, name, uuid)."""
    for minor, (bus, name, uuid) in enumerate(gpus):
        folder = root / "driver/nvidia/gpus" / bus
        folder.mkdir(parents=True)
        (folder / "information").write_text(information(name, uuid, bus, minor))
    if version is not None:
        (root / "driver/nvidia").mkdir(parents=True, exist_ok=True)
        (root / "driver/nvidia/version").write_text(version)
    if meminfo is not None:
        root.mkdir(parents=True, exist_ok=True)
        (root / "meminfo").write_text(meminfo)
    return root


# Written out of bus order on purpose: detection must sort them by PCI address.
PROC_H100S = [
    ("0000:9a:00.0", H100, UUIDS[2]),
    ("0000:18:00.0", H100, UUIDS[0]),
    ("0000:2a:00.0", H100, UUIDS[1]),
]
"""In bus order: UUIDS[0] (18), UUIDS[1] (2a), UUIDS[2] (9a)."""


def no_nvml() -> FakeNvml:
    """An NVML whose init fails the way it does without a loaded driver."""
    return FakeNvml([], fail={"nvmlInit": NVMLError("Driver Not Loaded")})


def run_detect(
    nvml: FakeNvml,
    tmp_path: Path,
    env: Mapping[str, str] | None = None,
    **section: Any,
) -> dict[str, Any]:
    """detect() with an explicit (default empty) environment and a fake /proc."""
    proc = tmp_path / "proc"
    if not proc.exists():
        make_proc(proc)
    return detect(hardware_section(**section), nvml=nvml, proc_root=proc, env=dict(env or {}))


def uuids(result: Mapping[str, Any]) -> list[str]:
    """The UUIDs of the visible devices in hardware.json, in order."""
    return [d["uuid"] for d in result["devices"]]


# --------------------------------------------------------------------------------------
# NVML: a node of identical GPUs
# --------------------------------------------------------------------------------------


class TestNvmlNode:
    """Eight H100s through NVML: summary, versions, NVLink, init/shutdown pairing."""

    def test_eight_h100s(self, tmp_path: Path) -> None:
        """Every field of the GPU summary comes from NVML."""
        nvml = h100s(8)
        result = run_detect(nvml, tmp_path)
        assert result["source"] == "nvml"
        assert result["fallbacks"] == []
        assert result["warnings"] == []
        assert result["gpus_per_node"] == 8
        assert result["cpu_ranks"] is None
        assert result["cuda_visible_devices"] is None
        gpu = result["gpu"]
        assert gpu["key"] == "H100"
        assert gpu["name"] == H100
        assert gpu["memory_bytes"] == H100_MEMORY
        assert gpu["compute_capability"] == "9.0"
        assert gpu["nvlink"] is True
        assert gpu["mig"] is False
        assert gpu["spec"]["key"] == "H100"
        assert gpu["spec"]["bf16_tflops"] == 989.5
        assert result["driver_version"] == "550.54.15"
        assert result["cuda_driver_version"] == "12.4"
        assert uuids(result) == UUIDS
        assert [d["index"] for d in result["devices"]] == list(range(8))
        assert nvml.calls[0] == "nvmlInit"
        assert nvml.calls[-1] == "nvmlShutdown"

    def test_memory_is_the_smallest_visible(self, tmp_path: Path) -> None:
        """Same model, different reported totals: plan for the smallest."""
        gpus = gpus_of(H100, 2)
        gpus[1].memory_bytes = H100_MEMORY - 512 * MIB
        result = run_detect(FakeNvml(gpus), tmp_path)
        assert result["gpu"]["memory_bytes"] == H100_MEMORY - 512 * MIB

    def test_nvlink_false_when_links_inactive(self, tmp_path: Path) -> None:
        """NVLink-capable GPUs whose links are all down report no NVLink."""
        assert run_detect(h100s(8, nvlink=False), tmp_path)["gpu"]["nvlink"] is False

    def test_nvlink_false_when_state_raises(self, tmp_path: Path) -> None:
        """nvmlDeviceGetNvLinkState raising NVMLError (no NVLink) is not a failure."""
        result = run_detect(h100s(8, nvlink=None), tmp_path)
        assert result["source"] == "nvml"
        assert result["fallbacks"] == []
        assert result["gpu"]["nvlink"] is False

    @pytest.mark.parametrize(
        ("cuda", "expected"),
        [(12040, "12.4"), (11080, "11.8"), (12090, "12.9"), (13000, "13.0"), (12020, "12.2")],
    )
    def test_cuda_driver_version(self, tmp_path: Path, cuda: int, expected: str) -> None:
        """NVML's integer CUDA version (1000 * major + 10 * minor) becomes 'major.minor'."""
        nvml = FakeNvml(gpus_of(H100, 1), cuda=cuda)
        assert run_detect(nvml, tmp_path)["cuda_driver_version"] == expected

    def test_bytes_from_old_bindings_are_decoded(self, tmp_path: Path) -> None:
        """Older pynvml returns bytes for names, UUIDs and the driver version."""
        gpu = FakeGpu(name=H100.encode(), uuid=UUIDS[0].encode(), memory_bytes=H100_MEMORY)
        result = run_detect(FakeNvml([gpu], driver=b"535.104.05"), tmp_path)
        assert result["gpu"]["name"] == H100
        assert result["gpu"]["key"] == "H100"
        assert uuids(result) == [UUIDS[0]]
        assert result["driver_version"] == "535.104.05"

    def test_zero_gpus_falls_back_to_cpu(self, tmp_path: Path) -> None:
        """NVML working but seeing no GPU: CPU, with a reason that does not blame the variable."""
        result = run_detect(FakeNvml([]), tmp_path)
        assert result["source"] == "cpu"
        assert result["gpu"] is None
        assert result["gpus_per_node"] == 0
        assert result["fallbacks"] == ["nvml: no usable GPU"]


# --------------------------------------------------------------------------------------
# CUDA_VISIBLE_DEVICES
# --------------------------------------------------------------------------------------


class TestCudaVisibleDevices:
    """CUDA_VISIBLE_DEVICES read as the CUDA runtime reads it, through detect()."""

    @pytest.mark.parametrize(
        ("value", "count", "expected"),
        [
            ("2,0", 8, [UUIDS[2], UUIDS[0]]),
            ("7", 8, [UUIDS[7]]),
            ("0,7,1", 4, [UUIDS[0]]),  # 7 is out of range: the list ends there
            ("0,abc,1", 8, [UUIDS[0]]),  # not a device: the list ends there
            ("1,-1,2", 8, [UUIDS[1]]),
            ("0,,1", 8, [UUIDS[0]]),
            ("0,\u00b2", 8, [UUIDS[0]]),  # a superscript digit is not an index
            ("GPU-5b0f", 8, [UUIDS[0]]),  # unique UUID prefix
            ("GPU-5b1e0d47,3", 8, [UUIDS[1], UUIDS[3]]),
            (UUIDS[5], 8, [UUIDS[5]]),  # a full UUID
            ("3,GPU-5b,2", 8, [UUIDS[3]]),  # ambiguous prefix: the list ends there
            ("1,GPU-00000000,2", 8, [UUIDS[1]]),  # unknown UUID
            ("1,MIG-1d2c3b4a", 8, [UUIDS[1]]),  # no MIG instance by that UUID
        ],
    )
    def test_selection(self, tmp_path: Path, value: str, count: int, expected: list[str]) -> None:
        """The visible devices, in the order CUDA would number them."""
        result = run_detect(h100s(count), tmp_path, {"CUDA_VISIBLE_DEVICES": value})
        assert result["source"] == "nvml"
        assert result["cuda_visible_devices"] == value
        assert uuids(result) == expected
        assert result["gpus_per_node"] == len(expected)

    def test_order_keeps_physical_index(self, tmp_path: Path) -> None:
        """'2,0' renumbers the devices but each keeps its NVML index."""
        result = run_detect(h100s(8), tmp_path, {"CUDA_VISIBLE_DEVICES": "2,0"})
        assert [d["index"] for d in result["devices"]] == [2, 0]

    @pytest.mark.parametrize("value", ["", "-1", "8", "GPU-5b", "none"])
    def test_hiding_every_gpu_falls_back_to_cpu(self, tmp_path: Path, value: str) -> None:
        """No visible device: source 'cpu', the reason recorded, NVML facts kept."""
        result = run_detect(h100s(8), tmp_path, {"CUDA_VISIBLE_DEVICES": value})
        assert result["source"] == "cpu"
        assert result["fallbacks"] == [f"nvml: CUDA_VISIBLE_DEVICES={value!r} hides every GPU"]
        assert result["gpu"] is None
        assert result["devices"] == []
        assert result["gpus_per_node"] == 0
        assert result["cpu_ranks"] == 2
        assert result["driver_version"] == "550.54.15"

    @pytest.mark.parametrize("value", ["1,1", "0,2,0", f"0,{UUIDS[0][:10]}", "GPU-5b0f,0"])
    def test_device_listed_twice_is_an_error(self, tmp_path: Path, value: str) -> None:
        """CUDA refuses a device named twice (by index or UUID); so does detection."""
        with pytest.raises(StageError, match="listed twice") as caught:
            run_detect(h100s(8), tmp_path, {"CUDA_VISIBLE_DEVICES": value})
        assert repr(value) in str(caught.value)
        assert "\n" not in str(caught.value)

    def test_duplicate_after_the_end_is_ignored(self, tmp_path: Path) -> None:
        """Entries after the first invalid one are never read, duplicates included."""
        result = run_detect(h100s(8), tmp_path, {"CUDA_VISIBLE_DEVICES": "0,x,0"})
        assert uuids(result) == [UUIDS[0]]


class TestSelectVisible:
    """select_visible on its own: the unset case and MIG stand-ins."""

    GPUS = [
        Device(
            index=i, name=H100, uuid=UUIDS[i], memory_bytes=H100_MEMORY, compute_capability="9.0"
        )
        for i in range(3)
    ]
    MIGS = [
        Device(
            index=1,
            name=MIG_1G,
            uuid=MIG_UUIDS[i],
            memory_bytes=MIG_1G_MEMORY,
            compute_capability="9.0",
            mig=True,
            parent_uuid=UUIDS[1],
        )
        for i in range(2)
    ]

    def test_unset_is_every_gpu_in_order(self) -> None:
        """Unset: every GPU in enumeration order."""
        assert select_visible(None, self.GPUS) == self.GPUS

    def test_unset_puts_mig_instances_in_place_of_their_gpu(self) -> None:
        """Unset: a MIG-enabled GPU is replaced, in place, by its instances."""
        chosen = select_visible(None, self.GPUS, self.MIGS)
        assert [d.uuid for d in chosen] == [UUIDS[0], MIG_UUIDS[0], MIG_UUIDS[1], UUIDS[2]]

    def test_mig_uuid_prefix(self) -> None:
        """MIG-<uuid> prefixes select among the instances only."""
        chosen = select_visible("MIG-7f6e,0", self.GPUS, self.MIGS)
        assert [d.uuid for d in chosen] == [MIG_UUIDS[1], UUIDS[0]]

    def test_gpu_prefix_does_not_match_mig(self) -> None:
        """A GPU- entry never names a MIG instance, nor a MIG- entry a GPU."""
        assert select_visible("GPU-" + MIG_UUIDS[0][4:], self.GPUS, self.MIGS) == []
        assert select_visible("MIG-" + UUIDS[0][4:], self.GPUS, self.MIGS) == []


# --------------------------------------------------------------------------------------
# Mixed GPU models
# --------------------------------------------------------------------------------------


class TestMixedModels:
    """Visible GPUs of different models are refused; restricting to one model works."""

    @staticmethod
    def mixed() -> FakeNvml:
        """Two H100s (0, 1) and two A100 80GB (2, 3)."""
        a100s = [
            FakeGpu(
                name=A100_80,
                uuid=UUIDS[i],
                memory_bytes=A100_80_MEMORY,
                compute_capability=(8, 0),
            )
            for i in (2, 3)
        ]
        return FakeNvml([*gpus_of(H100, 2), *a100s])

    def test_mixed_is_one_line_error_naming_both(self, tmp_path: Path) -> None:
        """The message is one line and names both models and every device."""
        with pytest.raises(StageError) as caught:
            run_detect(self.mixed(), tmp_path)
        message = str(caught.value)
        assert "\n" not in message
        assert "different models" in message
        assert H100 in message
        assert A100_80 in message
        for uuid in UUIDS[:4]:
            assert uuid in message

    def test_visible_pair_of_two_models_is_an_error(self, tmp_path: Path) -> None:
        """Selecting one of each is as wrong as seeing all of them."""
        with pytest.raises(StageError, match="different models"):
            run_detect(self.mixed(), tmp_path, {"CUDA_VISIBLE_DEVICES": "1,2"})

    @pytest.mark.parametrize(
        ("value", "key", "memory", "capability"),
        [
            ("2,3", "A100-80GB", A100_80_MEMORY, "8.0"),
            ("0,1", "H100", H100_MEMORY, "9.0"),
            ("3", "A100-80GB", A100_80_MEMORY, "8.0"),
        ],
    )
    def test_restricting_to_one_model(
        self, tmp_path: Path, value: str, key: str, memory: int, capability: str
    ) -> None:
        """CUDA_VISIBLE_DEVICES naming one model's GPUs gives that model's summary."""
        result = run_detect(self.mixed(), tmp_path, {"CUDA_VISIBLE_DEVICES": value})
        assert result["gpu"]["key"] == key
        assert result["gpu"]["memory_bytes"] == memory
        assert result["gpu"]["compute_capability"] == capability
        assert result["gpus_per_node"] == len(value.split(","))


# --------------------------------------------------------------------------------------
# MIG
# --------------------------------------------------------------------------------------


class TestMig:
    """MIG-enabled GPUs: usable only through their instances."""

    def test_unset_instances_stand_in(self, tmp_path: Path) -> None:
        """With the variable unset the instances are the devices; empty slots are skipped."""
        nvml = FakeNvml([mig_gpu((MIG_1G, MIG_1G_MEMORY), (MIG_1G, MIG_1G_MEMORY))])
        result = run_detect(nvml, tmp_path)
        assert result["source"] == "nvml"
        assert result["warnings"] == []
        assert result["gpus_per_node"] == 2
        assert uuids(result) == MIG_UUIDS[:2]
        assert all(d["mig"] and d["parent_uuid"] == UUIDS[0] for d in result["devices"])
        assert all(d["compute_capability"] == "9.0" for d in result["devices"])
        gpu = result["gpu"]
        assert gpu["mig"] is True
        assert gpu["name"] == MIG_1G
        assert gpu["memory_bytes"] == MIG_1G_MEMORY
        assert gpu["key"] is None  # a slice runs at a fraction of the catalog's peak
        assert gpu["spec"] is None

    def test_gpu_selected_by_index_is_skipped_with_a_warning(self, tmp_path: Path) -> None:
        """Index 0 names a MIG-enabled GPU: skipped, named in a warning; index 1 kept."""
        nvml = FakeNvml([mig_gpu((MIG_1G, MIG_1G_MEMORY)), gpus_of(H100, 2)[1]])
        result = run_detect(nvml, tmp_path, {"CUDA_VISIBLE_DEVICES": "0,1"})
        assert result["source"] == "nvml"
        assert uuids(result) == [UUIDS[1]]
        assert result["gpu"]["key"] == "H100"
        assert len(result["warnings"]) == 1
        assert UUIDS[0] in result["warnings"][0]
        assert "MIG" in result["warnings"][0]

    def test_gpu_selected_by_uuid_is_skipped(self, tmp_path: Path) -> None:
        """Naming the MIG-enabled GPU by UUID is skipped the same way."""
        nvml = FakeNvml([mig_gpu((MIG_1G, MIG_1G_MEMORY)), gpus_of(H100, 2)[1]])
        result = run_detect(nvml, tmp_path, {"CUDA_VISIBLE_DEVICES": "GPU-5b0f,1"})
        assert uuids(result) == [UUIDS[1]]
        assert UUIDS[0] in result["warnings"][0]

    def test_only_a_mig_gpu_selected_leaves_the_cpu(self, tmp_path: Path) -> None:
        """Skipping the only selected GPU leaves nothing: CPU, with warning and reason."""
        nvml = FakeNvml([mig_gpu((MIG_1G, MIG_1G_MEMORY)), gpus_of(H100, 2)[1]])
        result = run_detect(nvml, tmp_path, {"CUDA_VISIBLE_DEVICES": "0"})
        assert result["source"] == "cpu"
        assert UUIDS[0] in result["warnings"][0]
        assert result["fallbacks"] == ["nvml: CUDA_VISIBLE_DEVICES='0' hides every GPU"]

    def test_mig_uuid_selects_an_instance(self, tmp_path: Path) -> None:
        """MIG-<uuid> selects that instance; its memory is the instance's memory."""
        gpu = mig_gpu((MIG_1G, MIG_1G_MEMORY), (MIG_3G, MIG_3G_MEMORY))
        result = run_detect(FakeNvml([gpu]), tmp_path, {"CUDA_VISIBLE_DEVICES": MIG_UUIDS[1]})
        assert uuids(result) == [MIG_UUIDS[1]]
        assert result["devices"][0]["parent_uuid"] == UUIDS[0]
        assert result["gpu"]["name"] == MIG_3G
        assert result["gpu"]["memory_bytes"] == MIG_3G_MEMORY
        assert result["gpu"]["mig"] is True
        assert result["warnings"] == []

    def test_instances_of_different_profiles_are_different_models(self, tmp_path: Path) -> None:
        """A 1g.10gb and a 3g.40gb slice are not one model."""
        gpu = mig_gpu((MIG_1G, MIG_1G_MEMORY), (MIG_3G, MIG_3G_MEMORY))
        with pytest.raises(StageError, match="different models"):
            run_detect(FakeNvml([gpu]), tmp_path)

    def test_mig_gpu_without_instances_is_skipped(self, tmp_path: Path) -> None:
        """MIG mode on, no instance created: nothing usable, and the warning says why."""
        result = run_detect(FakeNvml([mig_gpu()]), tmp_path)
        assert result["source"] == "cpu"
        assert UUIDS[0] in result["warnings"][0]

    def test_mig_capable_but_disabled_is_a_whole_gpu(self, tmp_path: Path) -> None:
        """nvmlDeviceGetMigMode answering (0, 0): an ordinary GPU."""
        gpus = gpus_of(A100_80, 2, A100_80_MEMORY, compute_capability=(8, 0), mig_mode=False)
        result = run_detect(FakeNvml(gpus), tmp_path)
        assert result["gpu"]["key"] == "A100-80GB"
        assert result["gpu"]["mig"] is False
        assert uuids(result) == UUIDS[:2]
        assert result["warnings"] == []


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
