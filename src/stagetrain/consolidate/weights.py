"""Where each weight of a stage's final checkpoint lies, after checking that every file is there and loads.

Every file is first checked and loaded by torch's weights-only unpickler
(`training.integrity`), so a crafted checkpoint file is refused with one line
and none of its code runs. Then each file is described without reading its
tensors (`stored.describe`), and each weight becomes a `Stored`: the regions of
the files that hold it, in order. Only those regions are ever read, so the Adam
moments beside the fp32 weights in the optimizer files are not.

The layouts are DeepSpeed 0.19's, as its `zero_to_fp32` reads them (the names of
`deepspeed.checkpoint.constants`):

- ZeRO 1-2: rank r's optimizer file holds, per parameter group g,
  `single_partition_of_fp32_groups[g]`, its share of the group's flat fp32
  vector (the ranks' shares in rank order make the vector). Parameters lie in
  the vector in the order of the model file's `param_shapes[g]`, each followed
  by its `param_alignment_paddings[g][i]` elements of padding.
- ZeRO-3: rank r's `fp32_flat_groups`, concatenated, hold the r-th
  ceil(n/dp)-element slice of every parameter of n elements, in `param_shapes`
  order; the last slice is padded with zeros.
- ZeRO 0 keeps whole weights in the model file (`module`), and AutoTP (tp > 1)
  one model file per tp rank, each holding its slice of the split layers;
  `gather_tp` places each tensor's slices side by side along the one dimension
  where a slice is 1/tp of the full shape (from the model config), and takes
  replicated tensors (norms, embeddings kept whole) from rank 0.

Buffers come from the model file of rank 0 (`buffer_names`), and names DeepSpeed
lists in `shared_params` take the regions of the parameter they share.

An expert-parallel (AutoEP) checkpoint is read through DeepSpeed's universal copy of it
(`expert_parallel_weights`), and its names are turned into transformers' (`training.autoep`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from stagetrain.consolidate.stored import Region, Stored, describe, region_of, span
from stagetrain.errors import StageError
from stagetrain.training.integrity import POINTER, check_tag, read_pointer

MODULE = "module"
OPTIMIZER = "optimizer_state_dict"
FP32_GROUPS = {1: "single_partition_of_fp32_groups", 2: "single_partition_of_fp32_groups",
               3: "fp32_flat_groups"}  # fmt: skip


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


def module_weights(path: Path) -> dict[str, Stored]:
    """The whole tensors of a model file's `module` (ZeRO 0, or one AutoTP rank's slices)."""
    module = describe(path)[MODULE]
    return {name: Stored(tuple(t.shape), (region_of(path, t, name),)) for name, t in module.items()}


def gather_tp(
    shards: list[Mapping[str, Stored]], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, Stored]:
    """Whole tensors from AutoTP slices: side by side along the split dimension, else rank 0's."""
    tp = len(shards)
    full = {}
    for name, expected in shapes.items():
        if name not in shards[0]:
            continue
        parts = [shard[name] for shard in shards]
        if parts[0].shape == expected:
            full[name] = parts[0]
            continue
        dims = []  # a slice of another number of dimensions makes the shape along none
        if len(parts[0].shape) == len(expected):
            dims = [d for d, (a, b) in enumerate(zip(parts[0].shape, expected, strict=True)) if a * tp == b]  # fmt: skip
        if len(dims) != 1:
            raise StageError(
                f"{name}: tp slices of shape {parts[0].shape} do not make {expected} with tp={tp}"
            )
        pieces = tuple(piece for part in parts for piece in part.pieces)
        full[name] = Stored(expected, pieces, split_dim=dims[0])
    return full


def read_weights(
    folder: Path, tag: str, layout: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, Stored]:
    """Where each of the checkpoint's weights lies, by parameter name (`layout`: a summary's
    layout record, of which its integer dp, tp, ep and zero_stage are read)."""
    files = checkpoint_files(folder, tag, layout)
    if layout.get("ep", 1) > 1:
        return expert_parallel_weights(folder, tag, layout, files[0])
    if layout["tp"] > 1:
        return gather_tp([module_weights(f) for f in files[: layout["tp"]]], shapes)
    if layout["zero_stage"] == 0:
        return module_weights(files[0])
    dp = layout["dp"]
    return zero_weights(files[0], files[-dp:], layout["zero_stage"])


def expert_parallel_weights(
    folder: Path, tag: str, layout: Mapping[str, int], model_file: Path
) -> dict[str, Stored]:
    """The fp32 weights of an AutoEP checkpoint (ep > 1), under transformers' names.

    Its experts lie in per-expert files (ZeRO 1-2) or in partitions over the ranks that share
    them (ZeRO-3), beside dense partitions over every rank. DeepSpeed's own universal converter
    merges both into one whole tensor per parameter, so the tag is converted as a resume without
    expert parallelism would convert it (`reshard.convert`, AutoEP's names turned into
    transformers', the copy kept with its tag), and read from there; buffers come from rank 0's
    model file of that copy, where they carry transformers' names too.
    """
    from stagetrain.training.reshard import convert  # imports DeepSpeed's converter

    copy = folder / convert(folder, tag, layout, {**layout, "ep": 1})
    weights = {}
    for param in sorted(p for p in (copy / "zero").iterdir() if p.is_dir()):
        path = param / "fp32.pt"
        record = describe(path)
        tensor = record.get("param") if isinstance(record, dict) else None
        if not isinstance(tensor, torch.Tensor):
            raise StageError(f"{path}: a universal checkpoint's parameter file without 'param'")
        weights[param.name] = Stored(tuple(tensor.shape), (region_of(path, tensor, param.name),))
    model_states = copy / model_file.name
    return with_buffers_and_ties(weights, describe(model_states), model_states)


def zero_weights(model_file: Path, optim_files: list[Path], stage: int) -> dict[str, Stored]:
    """The fp32 weights of a ZeRO 1-3 checkpoint (rank 0's model file, every rank's optimizer file)."""
    model = describe(model_file)
    missing = [k for k in ("param_shapes", "buffer_names", "shared_params") if k not in model]
    if missing:
        raise StageError(f"{model_file}: not a ZeRO model-states file (no {missing[0]!r})")
    frozen = model.get("frozen_param_shapes") or {}
    if frozen:
        raise StageError(
            f"{model_file}: {len(frozen)} frozen parameters (e.g. {next(iter(frozen))}); "
            "consolidation reads only trained ones"
        )
    partitions, paddings = [], None
    for path in optim_files:
        state = describe(path)[OPTIMIZER]
        key = FP32_GROUPS[stage]
        if key not in state:
            raise StageError(f"{path}: not a ZeRO-{stage} optimizer file (no {key!r})")
        partitions.append([region_of(path, t, f"{key}[{g}]") for g, t in enumerate(state[key])])
        paddings = state.get("param_alignment_paddings")
    shapes = [
        {name: tuple(shape) for name, shape in group.items()} for group in model["param_shapes"]
    ]
    where = f"{optim_files[0].parent}: ZeRO-{stage} over {len(optim_files)} ranks"
    if stage == 3:
        weights = zero3_layout(shapes, partitions, where)
    else:
        weights = zero12_layout(shapes, partitions, paddings, where)
    return with_buffers_and_ties(weights, model, model_file)


def with_buffers_and_ties(
    weights: dict[str, Stored], model: Mapping[str, Any], model_file: Path
) -> dict[str, Stored]:
    """`weights` with the buffers of a model-states file (`model`, described from `model_file`)
    and the names DeepSpeed lists as sharing a parameter, which take its regions."""
    module = model[MODULE]
    for name in model.get("buffer_names", ()):
        if name in module:
            weights[name] = Stored(
                tuple(module[name].shape), (region_of(model_file, module[name], name),)
            )
    for name, source in model.get("shared_params", {}).items():
        if source in weights:
            weights[name] = weights[source]
    return weights


def zero12_layout(shapes: Sequence[Mapping[str, tuple[int, ...]]], partitions: Sequence[Sequence[Region]],
                  paddings: Sequence[Sequence[int]] | None, where: str) -> dict[str, Stored]:  # fmt: skip
    """ZeRO 1-2: `partitions[rank][group]` are the ranks' shares of each group's flat vector."""
    world = len(partitions)
    align = 2 * world  # DeepSpeed pads each group to a multiple of this (zero_to_fp32's check)
    weights = {}
    for g, group in enumerate(shapes):
        vector = [ranks[g] for ranks in partitions]
        available = sum(piece.numel for piece in vector)
        if paddings is not None and len(paddings[g]) != len(group):
            raise StageError(f"{where}: group {g} has {len(group)} parameters but "
                             f"{len(paddings[g])} alignment paddings")  # fmt: skip
        offset = 0
        for i, (name, shape) in enumerate(group.items()):
            numel = math.prod(shape)
            weights[name] = Stored(shape, span(vector, offset, numel, where))
            offset += numel + (paddings[g][i] if paddings is not None else 0)
        if -(-offset // align) != -(-available // align):
            raise StageError(f"{where}: group {g}'s parameters take {offset} elements, its fp32 "
                             f"partitions hold {available}; the model states do not match the optimizer files")  # fmt: skip
    return weights


def zero3_layout(shapes: Sequence[Mapping[str, tuple[int, ...]]], partitions: Sequence[Sequence[Region]],
                 where: str) -> dict[str, Stored]:  # fmt: skip
    """ZeRO-3: `partitions[rank]` are the rank's flat groups, holding its slice of every parameter."""
    world = len(partitions)
    weights, offset = {}, 0
    for group in shapes:
        for name, shape in group.items():
            numel = math.prod(shape)
            share = -(-numel // world)
            slices = [piece for rank in partitions for piece in span(rank, offset, share, where)]
            weights[name] = Stored(shape, span(slices, 0, numel, where))
            offset += share
    available = sum(piece.numel for piece in partitions[0])
    if offset != available:
        raise StageError(f"{where}: the parameters take {offset} elements of each rank's fp32 "
                         f"partition, which holds {available}; the model states do not match the optimizer files")  # fmt: skip
    return weights
