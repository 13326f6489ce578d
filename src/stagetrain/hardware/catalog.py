"""The GPU catalog (catalog.yaml): NVML names to normalised keys and their specs.

The figures are data, kept in YAML next to this module with a datasheet link on
each entry, so adding a GPU is a one-entry change with no code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import yaml

from stagetrain.errors import StageError

CATALOG_PATH = Path(str(resources.files("stagetrain.hardware") / "catalog.yaml"))


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuSpec:
    """One catalog entry; field meanings are documented at the top of catalog.yaml."""

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

    @property
    def peak_tflops(self) -> float:
        """The dense 16-bit peak training runs at: BF16 where supported, else FP16."""
        return self.bf16_tflops if self.bf16 else self.fp16_tflops


@cache
def catalog() -> dict[str, GpuSpec]:
    """All catalog entries, in match order."""
    with open(CATALOG_PATH, encoding="utf-8") as handle:
        raw = yaml.safe_load(handle)
    return {key: GpuSpec(key=key, **fields) for key, fields in raw.items()}


def match_gpu(name: str) -> str | None:
    """The catalog key of an NVML device name (first match wins), or None if unknown."""
    for key, spec in catalog().items():
        if re.search(spec.match, name, flags=re.IGNORECASE):
            return key
    return None


def gpu_spec(key: str, where: str = "hardware.gpu") -> GpuSpec:
    """The spec of a catalog key, or a one-line error listing the known keys."""
    try:
        return catalog()[key]
    except KeyError:
        known = ", ".join(catalog())
        raise StageError(
            f"{where}: GPU key {key!r} is not in the catalog ({CATALOG_PATH.name}); known: {known}"
        ) from None
