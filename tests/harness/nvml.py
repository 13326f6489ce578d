"""Fakes for detect_hardware's seams, shared by the tests/test_hardware_*.py modules.

NVML is faked through the one seam `detect` offers (`nvml=`), /proc through `proc_root=` (files
in the driver's own format) and the environment through `env=`; nothing else of the detection
is replaced."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagetrain.config.settings import HardwareSettings
from stagetrain.hardware.detect import detect
from stagetrain.hardware.report import HardwareReport

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


def hardware_section(**overrides: Any) -> HardwareSettings:
    """The validated `hardware` config section, with the schema defaults, typed as `detect` takes it."""
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
    return HardwareSettings.from_config(section, "hardware")


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
) -> HardwareReport:
    """detect() with an explicit (default empty) environment and a fake /proc."""
    proc = tmp_path / "proc"
    if not proc.exists():
        make_proc(proc)
    return detect(hardware_section(**section), nvml=nvml, proc_root=proc, env=dict(env or {}))


def uuids(result: Mapping[str, Any]) -> list[str]:
    """The UUIDs of the visible devices in hardware.json, in order."""
    return [d["uuid"] for d in result["devices"]]
