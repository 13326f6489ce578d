"""hardware.json's shape: what detect_hardware writes and the planner reads.

TypedDicts, not classes: the report is plain JSON from the moment it is built to the moment
the planner reads it back, so the writers' bytes stay what they were; the types only name
each key and its values. `detect.detect` builds everything but `speed`, which the stage adds
(`speed.measure`, or None for described hardware). docs/architecture.md, "Contracts between
stages", describes each key. No `from __future__ import annotations` here: Python 3.11 reads
`NotRequired` only from evaluated annotations (`__required_keys__`).
"""

from typing import Literal, NotRequired, TypedDict

Source = Literal["nvml", "proc", "cpu", "config"]
"""Where the devices came from; `config` for hardware the config describes."""
NodesSource = Literal["config", "slurm"]
"""Where the node count came from: the config, or the Slurm allocation the run is inside."""


class SlurmAllocation(TypedDict):
    """The Slurm job this process runs in (`detect.slurm_allocation`)."""

    job_id: str
    nodes: int
    nodelist: str | None
    gpus_on_node: int | None


class GpuSpecRecord(TypedDict):
    """A catalog entry as JSON (`catalog.GpuSpec`, field by field)."""

    key: str
    match: str
    memory_gib: float
    bf16_tflops: float
    fp16_tflops: float
    bf16: bool
    fp8: bool
    nvlink_gbps: float
    pcie_gbps: float
    source: str


class GpuSummary(TypedDict):
    """The one GPU model every visible device shares."""

    key: str | None
    """The catalog key; None for a GPU the catalog lacks, or a MIG instance."""
    name: str
    memory_bytes: int | None
    """The smallest of the devices' memories; None where /proc gave no sizes."""
    compute_capability: str | None
    nvlink: bool | None
    mig: bool
    spec: GpuSpecRecord | None


class DeviceRecord(TypedDict):
    """One visible device (`visible.Device`, field by field)."""

    index: int
    name: str
    uuid: str
    memory_bytes: int | None
    compute_capability: str | None
    mig: bool
    parent_uuid: str | None


class CpuFacts(TypedDict):
    """The host: cores this process may use and its memory (None: described, not measured)."""

    cores: int | None
    memory_bytes: int | None


class DriverFacts(TypedDict):
    """The driver's versions, where a source reports them."""

    driver_version: str | None
    cuda_driver_version: str | None


ATTENTION_SHAPE = (16, 4, 128, 32)
"""(batch, heads, sequence, head size) of the attention probe (`attention_ms`): a small model's
training shape."""


class SpeedReport(TypedDict):
    """`speed`: what each precision delivers here (`speed.measure`).

    A GPU that torch cannot reach has only device, gflops (None) and reason; a GPU
    measurement has no CPU facts (attention_ms, capability, flags).
    """

    device: Literal["cpu", "cuda"]
    gflops: dict[str, float] | None
    """GFLOP/s of square matrix products by precision (fp32, bf16, fp16)."""
    threads: NotRequired[int | None]
    size: NotRequired[int]
    attention_ms: NotRequired[dict[str, dict[str, float]]]
    """Milliseconds of one causal attention forward and backward at ATTENTION_SHAPE, by
    precision, then kernel."""
    capability: NotRequired[str]
    flags: NotRequired[list[str]]
    seconds: NotRequired[float]
    reason: NotRequired[str]


class HardwareReport(TypedDict):
    """hardware.json."""

    source: Source
    fallbacks: list[str]
    warnings: list[str]
    cuda_visible_devices: str | None
    nodes: int
    nodes_source: NodesSource
    slurm: SlurmAllocation | None
    gpus_per_node: int
    """0 on CPU ranks."""
    cpu_ranks: int | None
    """Ranks per node on a CPU machine; None with GPUs."""
    gpu: GpuSummary | None
    devices: list[DeviceRecord]
    cpu: CpuFacts
    driver_version: str | None
    cuda_driver_version: str | None
    speed: NotRequired[SpeedReport | None]
    """Added by the stage after `detect.detect`: None for described hardware."""
