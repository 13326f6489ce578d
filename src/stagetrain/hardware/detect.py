"""The detect_hardware stage: what devices this process may train on.

Fallback chain, with the source and the reason for each fall recorded:
NVML (nvidia-ml-py) -> /proc/driver/nvidia/gpus/*/information -> the CPU.
NVML is reached through one seam, the `nvml` argument, so tests run this code
against a fake module; nothing else is faked.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, cast

from stagetrain.config.settings import HardwareSettings
from stagetrain.errors import StageError
from stagetrain.hardware import allocation
from stagetrain.hardware.catalog import GpuSpec, gpu_spec, match_gpu
from stagetrain.hardware.report import (
    CpuFacts,
    DeviceRecord,
    DriverFacts,
    GpuSpecRecord,
    GpuSummary,
    HardwareReport,
    NodesSource,
    SlurmAllocation,
    Source,
)
from stagetrain.hardware.visible import Device, select_visible

NVLINK_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS in nvml.h


def load_nvml() -> ModuleType:
    """The real NVML binding (nvidia-ml-py installs it as `pynvml`)."""
    import pynvml

    return pynvml


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True, kw_only=True, slots=True)
class NvmlScan:
    """What one pass over an initialised NVML found."""

    gpus: list[Device]
    migs: list[Device]
    """The MIG instances of the GPUs in MIG mode."""
    driver: DriverFacts
    nvlink: bool
    """Whether any GPU has an active NVLink."""
    mig_enabled: frozenset[str]
    """UUIDs of the GPUs in MIG mode."""


def _record(spec: GpuSpec) -> GpuSpecRecord:
    """A catalog entry as hardware.json stores it (GpuSpecRecord names the same fields)."""
    return cast(GpuSpecRecord, asdict(spec))


def _nvml_devices(nvml: Any) -> NvmlScan:
    """Whole GPUs, MIG instances, and system facts from an initialised NVML."""
    gpus: list[Device] = []
    migs: list[Device] = []
    mig_enabled: list[str] = []
    nvlink = False
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        gpu = Device(
            index=index,
            name=_text(nvml.nvmlDeviceGetName(handle)),
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
            memory_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
            compute_capability=f"{major}.{minor}",
        )
        gpus.append(gpu)
        nvlink = nvlink or _has_nvlink(nvml, handle)
        try:
            mig_on = nvml.nvmlDeviceGetMigMode(handle)[0] == 1
        except nvml.NVMLError:  # not a MIG-capable GPU
            mig_on = False
        if mig_on:
            mig_enabled.append(gpu.uuid)
            migs.extend(_mig_instances(nvml, handle, gpu))
    cuda = int(nvml.nvmlSystemGetCudaDriverVersion())
    driver: DriverFacts = {
        "driver_version": _text(nvml.nvmlSystemGetDriverVersion()),
        "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}",
    }
    return NvmlScan(
        gpus=gpus, migs=migs, driver=driver, nvlink=nvlink, mig_enabled=frozenset(mig_enabled)
    )


def _has_nvlink(nvml: Any, handle: Any) -> bool:
    for link in range(NVLINK_MAX_LINKS):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link):
                return True
        except nvml.NVMLError:  # link absent or NVLink not supported on this GPU
            return False
    return False


def _mig_instances(nvml: Any, handle: Any, gpu: Device) -> list[Device]:
    instances = []
    for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except nvml.NVMLError:  # empty slot
            continue
        instances.append(
            Device(
                index=gpu.index,
                name=_text(nvml.nvmlDeviceGetName(mig)),
                uuid=_text(nvml.nvmlDeviceGetUUID(mig)),
                memory_bytes=int(nvml.nvmlDeviceGetMemoryInfo(mig).total),
                compute_capability=gpu.compute_capability,
                mig=True,
                parent_uuid=gpu.uuid,
            )
        )
    return instances


def _proc_devices(proc_root: Path) -> tuple[list[Device], DriverFacts]:
    """GPUs from the driver's /proc files: names and UUIDs only, in PCI bus order."""
    gpus = []
    files = sorted((proc_root / "driver/nvidia/gpus").glob("*/information"))
    for index, path in enumerate(files):
        fields = dict(
            (k.strip(), v.strip())
            for k, v in (
                line.split(":", 1) for line in path.read_text().splitlines() if ":" in line
            )
        )
        if "Model" not in fields or "GPU UUID" not in fields:
            raise StageError(f"{path}: expected 'Model:' and 'GPU UUID:' lines")
        gpus.append(
            Device(
                index=index,
                name=fields["Model"],
                uuid=fields["GPU UUID"],
                memory_bytes=None,
                compute_capability=None,
            )
        )
    version = proc_root / "driver/nvidia/version"
    found = (
        re.search(r"Kernel Module(?: for \S+)?\s+(\S+)", version.read_text())
        if version.exists()
        else None
    )
    return gpus, {"driver_version": found.group(1) if found else None, "cuda_driver_version": None}


def cpu_facts(proc_root: Path = Path("/proc")) -> CpuFacts:
    """Cores this process may run on and the machine's memory."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    meminfo = proc_root / "meminfo"
    memory = 0
    if meminfo.exists():
        found = re.search(r"MemTotal:\s+(\d+) kB", meminfo.read_text())
        memory = int(found.group(1)) * 1024 if found else 0
    if not memory:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cores": int(cores or 1), "memory_bytes": int(memory)}


def slurm_allocation(
    env: Mapping[str, str], scontrol: Callable[[str], str] | None = None
) -> SlurmAllocation | None:
    """The Slurm allocation this process runs in, if any: job, nodes, node list, GPUs on this node.

    Inside a job step whose job variables were removed (Snakemake's job step keeps
    only SLURM_JOB_ID, then runs the stage through `srun -n1`), SLURM_NNODES and
    SLURM_JOB_NODELIST describe that one-node step, not the job: the job's nodes
    are then asked of the controller (`scontrol`, injectable for tests).
    """
    if "SLURM_JOB_ID" not in env:
        return None
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if "SLURM_JOB_NUM_NODES" not in env and "SLURM_STEP_ID" in env:
        job = allocation.allocation({"SLURM_JOB_ID": env["SLURM_JOB_ID"]}, scontrol)
        assert job is not None  # SLURM_JOB_ID is set
        nodes, nodelist = str(len(job.hosts)), ",".join(job.hosts)
    gpus = env.get("SLURM_GPUS_ON_NODE")
    return {
        "job_id": env["SLURM_JOB_ID"],
        "nodes": int(nodes),
        "nodelist": nodelist,
        "gpus_on_node": int(gpus) if gpus and gpus.isdigit() else None,
    }


def _gpu_summary(devices: list[Device], nvlink: bool | None) -> GpuSummary:
    """The one GPU model all visible devices share, or a one-line error listing them."""
    names = sorted({d.name for d in devices})
    if len(names) > 1:
        listing = "; ".join(f"{d.uuid}: {d.name}" for d in devices)
        raise StageError(
            f"CUDA_VISIBLE_DEVICES selects GPUs of different models ({listing}); "
            "expected one model: select GPUs of one kind"
        )
    first = devices[0]
    key = None if first.mig else match_gpu(first.name)
    return {
        "key": key,
        "name": first.name,
        # one source read every device: NVML knows each one's memory, /proc none's
        "memory_bytes": min(d.memory_bytes for d in devices if d.memory_bytes is not None)
        if first.memory_bytes
        else None,
        "compute_capability": first.compute_capability,
        "nvlink": nvlink,
        "mig": first.mig,
        "spec": _record(gpu_spec(key)) if key else None,
    }


def _from_nvml(
    nvml: ModuleType | None, visible_env: str | None, warnings: list[str]
) -> tuple[list[Device], DriverFacts, bool | None]:
    """The visible devices NVML reports, the driver facts and NVLink; GPUs in MIG mode are
    dropped with a warning (only their MIG instances can run work). NVML errors propagate."""
    nvml = load_nvml() if nvml is None else nvml
    nvml.nvmlInit()
    try:
        scan = _nvml_devices(nvml)
    finally:
        nvml.nvmlShutdown()
    devices = select_visible(visible_env, scan.gpus, scan.migs)
    dropped = [d for d in devices if not d.mig and d.uuid in scan.mig_enabled]
    if dropped:
        warnings.append(
            f"GPUs in MIG mode are usable only through their MIG instances; skipped "
            f"{', '.join(d.uuid for d in dropped)} (name MIG-<uuid> in CUDA_VISIBLE_DEVICES)"
        )
        devices = [d for d in devices if d not in dropped]
    return devices, scan.driver, scan.nvlink


def _why_no_gpu(visible_env: str | None) -> str:
    """Why a source that found GPUs left none to use."""
    if visible_env is None:
        return "no usable GPU"
    return f"CUDA_VISIBLE_DEVICES={visible_env!r} hides every GPU"


def detect(
    hardware: HardwareSettings,
    *,
    nvml: ModuleType | None = None,
    proc_root: Path = Path("/proc"),
    env: Mapping[str, str] | None = None,
) -> HardwareReport:
    """Build hardware.json (less `speed`, which the stage measures) from the `hardware` section.

    Args:
        hardware: the config section, typed (source, nodes, ... see the schema).
        nvml: an NVML module; None loads the real one (tests pass a fake).
        proc_root: where /proc is (tests pass a folder of fake driver files).
        env: the environment (CUDA_VISIBLE_DEVICES, SLURM_*); None is os.environ.
    """
    env = os.environ if env is None else env
    if hardware.source == "describe":
        return describe(hardware)
    fallbacks: list[str] = []
    warnings: list[str] = []
    facts: DriverFacts = {"driver_version": None, "cuda_driver_version": None}
    visible_env = env.get("CUDA_VISIBLE_DEVICES")
    devices: list[Device] = []
    source: Source = "cpu"
    nvlink: bool | None = None
    try:
        devices, facts, nvlink = _from_nvml(nvml, visible_env, warnings)
        source = "nvml"
    except StageError:
        raise
    except Exception as err:  # ImportError or any NVMLError: record it and fall back
        fallbacks.append(f"nvml: {type(err).__name__}: {err}")
        gpus, facts = _proc_devices(proc_root)
        if gpus:
            source = "proc"
            devices = select_visible(visible_env, gpus)
        else:
            fallbacks.append(f"proc: no {proc_root}/driver/nvidia/gpus/*/information")
    if source != "cpu" and not devices:
        fallbacks.append(f"{source}: {_why_no_gpu(visible_env)}")
        source = "cpu"
    nodes, nodes_source, slurm = _nodes(hardware, env, warnings)
    return {
        "source": source,
        "fallbacks": fallbacks,
        "warnings": warnings,
        "cuda_visible_devices": visible_env,
        "nodes": nodes,
        "nodes_source": nodes_source,
        "slurm": slurm,
        "gpus_per_node": len(devices) if source != "cpu" else 0,
        "cpu_ranks": hardware.cpu_ranks if source == "cpu" else None,
        "gpu": _gpu_summary(devices, nvlink) if source != "cpu" else None,
        "devices": [cast(DeviceRecord, asdict(d)) for d in devices] if source != "cpu" else [],
        "cpu": cpu_facts(proc_root),
        **facts,
    }


def _nodes(
    hardware: HardwareSettings, env: Mapping[str, str], warnings: list[str]
) -> tuple[int, NodesSource, SlurmAllocation | None]:
    """Nodes to train on (config's, or the allocation's when the whole run is inside one),
    where that number came from, and the allocation.

    Under profiles/slurm this stage is a one-node job and the training jobs ask
    for hardware.nodes themselves, so a one-node allocation leaves the config's
    count; a config of 1 inside a larger allocation (the pipeline run within
    salloc) takes the allocation's.
    """
    slurm = slurm_allocation(env)
    if slurm is None or slurm["nodes"] == 1:
        return hardware.nodes, "config", slurm
    if hardware.nodes not in (1, slurm["nodes"]):
        warnings.append(
            f"hardware.nodes={hardware.nodes} but the Slurm allocation has "
            f"{slurm['nodes']} nodes; using the allocation"
        )
    return slurm["nodes"], "slurm", slurm


def describe(hardware: HardwareSettings) -> HardwareReport:
    """hardware.json for hardware named in the config rather than detected."""
    if hardware.gpu is None or hardware.gpus_per_node is None:
        raise StageError(
            "hardware: source 'describe' needs hardware.gpu (a catalog key) and hardware.gpus_per_node"
        )
    spec = gpu_spec(hardware.gpu)
    host = hardware.host_memory_gib
    return {
        "source": "config",
        "fallbacks": [],
        "warnings": [],
        "cuda_visible_devices": None,
        "nodes": hardware.nodes,
        "nodes_source": "config",
        "slurm": None,
        "gpus_per_node": hardware.gpus_per_node,
        "cpu_ranks": None,
        "gpu": {
            "key": spec.key,
            "name": spec.key,
            "memory_bytes": int(spec.memory_gib * 2**30),
            "compute_capability": None,
            "nvlink": spec.nvlink_gbps > 0,
            "mig": False,
            "spec": _record(spec),
        },
        "devices": [],
        "cpu": {"cores": None, "memory_bytes": int(host * 2**30) if host else None},
        "driver_version": None,
        "cuda_driver_version": None,
    }
