"""Sharded safetensors in the Hugging Face layout: model-0000i-of-0000n.safetensors plus the index.

Shards are planned from the tensors' sizes first (so the file names know the
count). Each shard is then streamed: its header is computed from the shapes
alone, and each tensor's bytes are written as its chunks arrive, so no shard
and no whole tensor is ever held in memory. Tensors are written in sorted name
order with fixed metadata, so the same weights always give the same bytes; the
bytes are those of `safetensors.torch.save_file` (which sorts by dtype, then
name, and pads the JSON header with spaces to 8 bytes), as tests/test_consolidate_unit.py
checks. A shard may mix dtypes (the few tensors transformers keeps in fp32 in a
16-bit model): its fp32 tensors come first, as save_file orders them.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeAlias, TypedDict

import torch

UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
INDEX = "model.safetensors.index.json"
METADATA = {"format": "pt"}
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
DTYPE_ORDER = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
"""The dtypes' order in safetensors (its `Dtype`), whose save_file writes the larger first."""
Dtypes: TypeAlias = torch.dtype | Mapping[str, torch.dtype]
"""One dtype for every tensor, or each tensor's own by name."""


def dtype_of(dtypes: Dtypes, name: str) -> torch.dtype:
    """The dtype `name` is written in."""
    return dtypes if isinstance(dtypes, torch.dtype) else dtypes[name]


def data_order(names: Sequence[str], dtypes: Dtypes) -> list[str]:
    """`names` in the order a shard holds their data: by dtype, larger first, then by name."""
    return sorted(names, key=lambda n: (-DTYPE_ORDER[dtype_of(dtypes, n)], n))


class TensorEntry(TypedDict):
    """One tensor in a safetensors header: its dtype, shape and byte range in the data."""

    dtype: str
    shape: list[int]
    data_offsets: list[int]


class IndexMetadata(TypedDict):
    """The index's metadata: the weights' bytes in all, as transformers writes it."""

    total_size: int


class ShardIndex(TypedDict):
    """model.safetensors.index.json: the bytes of all tensors, and each tensor's shard."""

    metadata: IndexMetadata
    weight_map: dict[str, str]


def parse_size(text: str) -> int:
    """'2GB' -> 2_000_000_000 (decimal units, as transformers uses)."""
    match = re.fullmatch(r"(\d+)(KB|MB|GB)", text)
    if match is None:  # the config schema's pattern lets none through
        raise ValueError(f"{text!r}: expected a size like 2GB")
    number, unit = match.groups()
    return int(number) * UNITS[unit]


def plan_shards(sizes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
    """Names grouped into shards of at most `max_bytes` (a bigger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(sizes):
        if shards[-1] and used + sizes[name] > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def header(names: list[str], shapes: Mapping[str, tuple[int, ...]], dtypes: Dtypes) -> bytes:
    """The safetensors header of a shard of `names`, in `data_order`."""
    entries: dict[str, TensorEntry | dict[str, str]] = {"__metadata__": METADATA}
    start = 0
    for name in data_order(names, dtypes):
        dtype = dtype_of(dtypes, name)
        end = start + math.prod(shapes[name]) * dtype.itemsize
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shapes[name]),
            "data_offsets": [start, end],
        }
        start = end
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_shards(
    names: list[str],
    shapes: Mapping[str, tuple[int, ...]],
    dtypes: Dtypes,
    chunks: Callable[[str], Iterator[torch.Tensor]],
    folder: Path,
    max_bytes: int,
) -> ShardIndex:
    """Write the tensors, each from `chunks(name)` (its values in row-major order, in its dtype,
    any number of pieces); return the index (also written to `folder`)."""
    sizes = {n: math.prod(shapes[n]) * dtype_of(dtypes, n).itemsize for n in names}
    groups = plan_shards(sizes, max_bytes)
    weight_map = {}
    for i, group in enumerate(groups, 1):
        filename = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        with open(folder / filename, "wb") as out:
            out.write(header(group, shapes, dtypes))
            for name in data_order(group, dtypes):
                written = 0
                for chunk in chunks(name):
                    data = chunk.contiguous().view(torch.uint8).numpy()
                    out.write(data)
                    written += data.nbytes
                if written != sizes[name]:
                    raise RuntimeError(f"{name}: {written} bytes written, {sizes[name]} expected")
        weight_map.update(dict.fromkeys(group, filename))
    index: ShardIndex = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return index
