"""Reading a stage's final checkpoint into one state dict, after checking that every file is there.

ZeRO 1-3 checkpoints go through DeepSpeed's own `get_fp32_state_dict_from_zero_checkpoint`
in lazy mode: tensors are assembled from the rank partitions one at a time, when
the writer asks for them. ZeRO 0 keeps whole weights in the model file. AutoTP
(tp > 1) writes one model file per tp rank, each holding its slice of the split
layers; `gather_tp` rebuilds each tensor by concatenating the slices along the
one dimension where a slice is 1/tp of the full shape (from the model config),
and takes replicated tensors (norms, embeddings kept whole) from rank 0.
"""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from stagetrain.errors import StageError
from stagetrain.io import read_json


def checkpoint_files(folder: Path, tag: str, layout: Mapping[str, int]) -> list[Path]:
    """The files a complete checkpoint of `layout` has, or a one-line error naming the first missing."""
    pointer = folder / "latest.json"
    if not pointer.exists():
        raise StageError(f"{pointer}: missing: no complete checkpoint was recorded for this run")
    if read_json(pointer)["tag"] != tag:
        raise StageError(
            f"{pointer}: points at {read_json(pointer)['tag']}, but the summary names {tag}"
        )
    base = folder / tag
    tp, dp, zero = layout["tp"], layout["dp"], layout["zero_stage"]
    if zero == 3:
        expected = [base / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(dp)]
    else:
        expected = [base / f"mp_rank_{t:02d}_model_states.pt" for t in range(tp)]
    if zero > 0 and tp == 1:
        expected += [_optim_file(base, r) for r in range(dp)]
    for path in expected:
        if not path.exists():
            raise StageError(
                f"{path}: missing from the checkpoint ({tag} of a dp={dp} tp={tp} ZeRO-{zero} run)"
            )
    return expected


def _optim_file(base: Path, rank: int) -> Path:
    found = sorted(base.glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    return found[0] if found else base / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _load(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError) as err:
        raise StageError(
            f"{path}: unreadable, truncated or corrupt ({type(err).__name__})"
        ) from None


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
        return gather_tp([_load(f)["module"] for f in files[: layout["tp"]]], shapes)
    if layout["zero_stage"] == 0:
        return dict(_load(files[0])["module"])
    for path in files:  # zero_to_fp32 would fail on a truncated file with a long traceback
        _load(path)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag, lazy_mode=True)
