"""CUDA_VISIBLE_DEVICES, read the way the CUDA runtime reads it.

The runtime takes a comma-separated list of entries, each a device index, a
`GPU-<uuid>` (any unique prefix) or a `MIG-<uuid>`. Parsing stops at the first
entry that names no device (an index out of range, a negative index, an unknown
or ambiguous UUID, or anything else), keeping the entries before it; so "-1" or
"" hides every device. Unset means every device, in enumeration order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stagetrain.errors import StageError


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    """A device the CUDA runtime could expose: a whole GPU or one MIG instance."""

    index: int
    """Enumeration index of the physical GPU (NVML or /proc order)."""
    name: str
    uuid: str
    memory_bytes: int | None
    compute_capability: str | None
    mig: bool = False
    parent_uuid: str | None = None
    """For a MIG instance, the UUID of its GPU."""


def _match_uuid(entry: str, devices: Sequence[Device]) -> Device | None:
    hits = [d for d in devices if d.uuid.lower().startswith(entry.lower())]
    return hits[0] if len(hits) == 1 else None


def select_visible(
    value: str | None, gpus: Sequence[Device], migs: Sequence[Device] = ()
) -> list[Device]:
    """The devices a CUDA process would see given CUDA_VISIBLE_DEVICES=`value`.

    `gpus` are whole GPUs in enumeration order, `migs` the MIG instances of
    MIG-enabled GPUs. A GPU in MIG mode is usable only through its instances,
    so with the variable unset the instances stand in for it.

    Raises:
        StageError: when one device is named twice (CUDA would refuse to start).
    """
    if value is None:
        chosen: list[Device] = []
        for gpu in gpus:
            own = [m for m in migs if m.parent_uuid == gpu.uuid]
            chosen.extend(own if own else [gpu])
        return chosen
    chosen = []
    for raw in value.split(","):
        entry = raw.strip()
        device: Device | None = None
        if entry.startswith("GPU-"):
            device = _match_uuid(entry, gpus)
        elif entry.startswith("MIG-"):
            device = _match_uuid(entry, migs)
        elif entry.isascii() and entry.isdigit() and int(entry) < len(gpus):
            device = gpus[int(entry)]
        if device is None:
            break
        if device in chosen:
            raise StageError(
                f"CUDA_VISIBLE_DEVICES={value!r}: device {entry!r} is listed twice "
                "(expected each device at most once)"
            )
        chosen.append(device)
    return chosen
