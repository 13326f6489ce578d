"""Sharded safetensors in the Hugging Face layout: model-0000i-of-0000n.safetensors plus the index.

Shards are planned from the tensors' sizes first (so the file names know the
count), then written one at a time: only one shard's tensors are materialised
at once. Tensors are written in sorted name order with fixed metadata, so the
same weights always give the same bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from stagetrain.io import public_file

UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
INDEX = "model.safetensors.index.json"


def parse_size(text: str) -> int:
    """'2GB' -> 2_000_000_000 (decimal units, as transformers uses)."""
    number, unit = re.fullmatch(r"(\d+)(KB|MB|GB)", text).groups()
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


def write_shards(
    names: list[str],
    sizes: Mapping[str, int],
    materialise: Callable[[str], torch.Tensor],
    folder: Path,
    max_bytes: int,
) -> dict[str, Any]:
    """Write the tensors; return the index (also written to `folder`)."""
    groups = plan_shards({n: sizes[n] for n in names}, max_bytes)
    weight_map = {}
    for i, group in enumerate(groups, 1):
        filename = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file(
            {name: materialise(name) for name in group},
            str(folder / filename),
            metadata={"format": "pt"},
        )
        public_file(folder / filename)
        weight_map.update(dict.fromkeys(group, filename))
    index = {"metadata": {"total_size": sum(sizes[n] for n in names)}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return index
