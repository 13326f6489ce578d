"""Reading a stage's final checkpoint into one state dict, after checking that every file is there and loads.

Every file is read by torch's weights-only unpickler (`training.integrity`), so
a crafted checkpoint file is refused with one line and none of its code runs.

ZeRO 1-3 checkpoints go through DeepSpeed's own `get_fp32_state_dict_from_zero_checkpoint`
in lazy mode: tensors are assembled from the rank partitions one at a time, when
the writer asks for them. ZeRO 0 keeps whole weights in the model file. AutoTP
(tp > 1) writes one model file per tp rank, each holding its slice of the split
layers; `gather_tp` rebuilds each tensor by concatenating the slices along the
one dimension where a slice is 1/tp of the full shape (from the model config),
and takes replicated tensors (norms, embeddings kept whole) from rank 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from stagetrain.errors import StageError
from stagetrain.training.integrity import (
    POINTER,
    check_tag,
    load_file,
    read_pointer,
    weights_only_loads,
)


def checkpoint_files(folder: Path, tag: str, layout: Mapping[str, int]) -> list[Path]:
    """The files of the checkpoint the summary names, each present and loadable, or a one-line error.

    Consolidation reads the stage's final checkpoint, so a damaged one is an
    error here, not a fallback as on resume.
    """
    pointer = folder / POINTER
    if not pointer.exists():
        raise StageError(f"{pointer}: missing: no complete checkpoint was recorded for this run")
    recorded = read_pointer(pointer)["tag"]
    if recorded != tag:
        raise StageError(f"{pointer}: points at {recorded}, but the summary names {tag}")
    return check_tag(folder, tag, layout)


def gather_tp(
    shards: list[Mapping[str, torch.Tensor]], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """Whole tensors from AutoTP slices: concatenated along the split dimension, else rank 0's."""
    tp = len(shards)
    full = {}
    for name, expected in shapes.items():
        parts = [shard[name] for shard in shards]
        if tuple(parts[0].shape) == expected:
            full[name] = parts[0]
            continue
        dims = [
            d for d, (a, b) in enumerate(zip(parts[0].shape, expected, strict=True)) if a * tp == b
        ]
        if len(dims) != 1:
            raise StageError(
                f"{name}: tp slices of shape {tuple(parts[0].shape)} do not make {expected} with tp={tp}"
            )
        full[name] = torch.cat(parts, dim=dims[0])
    return full


def read_weights(
    folder: Path, tag: str, layout: Mapping[str, int], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, Any]:
    """The checkpoint's weights by parameter name: tensors, or lazy ones with `.contiguous()`."""
    files = checkpoint_files(folder, tag, layout)
    if layout["tp"] > 1:
        return gather_tp([load_file(f)["module"] for f in files[: layout["tp"]]], shapes)
    if layout["zero_stage"] == 0:
        return dict(load_file(files[0])["module"])
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # zero_to_fp32 calls torch.load(weights_only=False); forced through the weights-only unpickler
    # (every file was already loaded that way by checkpoint_files, so this cannot fail on safety).
    with weights_only_loads():
        return get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag, lazy_mode=True)
