"""A DeepSpeed checkpoint checked before anything loads it, and its files read without running code.

Resuming a training stage and consolidating its final checkpoint both come
through here, so a damaged checkpoint gets the same one-line error naming the
file and what is wrong, instead of an AssertionError, a zip RuntimeError or a
KeyError from inside DeepSpeed.

The pointer `latest.json`: `tag`, `step`, `layout` (dp, tp, zero_stage) and
`complete`, the tags of the complete checkpoints kept, newest first (rank 0
writes it after every rank has saved, so each listed tag was complete when
written). A pointer without `complete` (written before it existed) names only
its own tag, so it resumes the same but has nothing to fall back to. `layouts`
gives the layout each kept tag was written under (they differ after a resume
under another layout); a pointer without it wrote every tag under `layout`.

Every file is read with torch's weights-only unpickler, which rebuilds tensors,
containers and the few DeepSpeed classes of `safe_globals` and refuses any other
Python object, so a crafted file's `__reduce__` never runs. DeepSpeed 0.19.8's
own readers pass `weights_only=False` (TorchCheckpointEngine.load under
engine.load_checkpoint; parse_model_states and parse_optim_states in
zero_to_fp32); `weights_only_loads` sends them through the same unpickler with
TORCH_FORCE_WEIGHTS_ONLY_LOAD, which torch.load honours over an explicit
`weights_only=False`.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypedDict, cast

import torch

from stagetrain.errors import StageError
from stagetrain.io import atomic_write_json, read_json

log = logging.getLogger("stagetrain")
POINTER = "latest.json"
TAG = re.compile(r"step\d{8}")
EXPERT_FILE = re.compile(
    r"(layer_\d+_expert_\d+|expp_rank_\d+)_mp_rank_\d+_(model|optim)_states\.pt"
)
"""The files DeepSpeed writes for an expert-parallel run beside `expected_files`."""
FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


class Pointer(TypedDict):
    """latest.json as `read_pointer` returns it (module docstring): a pointer written before
    `complete` or `layouts` existed gets them filled in (its tag alone; `layout` for each tag)."""

    tag: str
    step: int
    layout: dict[str, int]
    """dp, tp and zero_stage of `tag`'s run."""
    complete: list[str]
    layouts: dict[str, dict[str, int]]


class ResumePoint(Pointer):
    """A pointer made loadable under this run's layout (`checkpoints.Checkpoints.latest`;
    never written): `tag` is the checkpoint resumed from, `load_tag` the folder to load (a
    universal copy after a conversion), and `module_only` whether only its weights load."""

    load_tag: str
    module_only: bool


def safe_globals() -> list[type]:
    """What DeepSpeed pickles beside tensors and containers (found by loading real ZeRO 0-3 and
    AutoTP files); imported here, not at module import, to keep DeepSpeed's import off light paths."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every torch.load inside, DeepSpeed's included, through the weights-only unpickler."""
    before = os.environ.get(FORCE)
    os.environ[FORCE] = "1"
    try:
        with torch.serialization.safe_globals(safe_globals()):
            yield
    finally:
        if before is None:
            os.environ.pop(FORCE, None)
        else:
            os.environ[FORCE] = before


def load_file(path: Path) -> Any:
    """One checkpoint file, memory-mapped, by the weights-only unpickler; a one-line error if it cannot be."""
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        refused = re.search(r"WeightsUnpickler error: (.*?)(?: was not an allowed|\n|$)", str(err))
        if refused:
            raise StageError(
                f"{path}: refused: it pickles more than tensors and DeepSpeed's state "
                f"({refused.group(1)}); a crafted or foreign file, not loaded"
            ) from None
        raise StageError(f"{path}: unreadable, truncated or corrupt (UnpicklingError)") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as err:
        raise StageError(
            f"{path}: unreadable, truncated or corrupt ({type(err).__name__})"
        ) from None


def rebuild_pointer(folder: Path, layout: Mapping[str, int]) -> Pointer | None:
    """Write latest.json anew from the tags in `folder` that are intact under `layout`, newest
    first, and say so; None (nothing written) when no tag is. Tags of another layout cannot be
    checked without the pointer's record of it: they are named in the log and left alone,
    those holding this layout's files among others (`foreign_files`) too."""
    tags = sorted((p.name for p in folder.glob("step*") if p.is_dir() and TAG.fullmatch(p.name)),
                  key=step_of, reverse=True)  # fmt: skip
    intact: list[str] = []
    other: list[str] = []
    for tag in tags:
        try:
            check_tag(folder, tag, layout)
        except StageError:
            other.append(tag)
            continue
        (other if foreign_files(folder / tag, layout) else intact).append(tag)
    if other:
        log.warning("%s: no %s, and %s not intact under this run's layout (dp=%d tp=%d ZeRO-%d): left "
                    "as they are, never resumed from", folder, POINTER, ", ".join(other),
                    layout["dp"], layout["tp"], layout["zero_stage"])  # fmt: skip
    if not intact:
        return None
    pointer: Pointer = {"tag": intact[0], "step": step_of(intact[0]), "layout": dict(layout),
                        "complete": intact, "layouts": {t: dict(layout) for t in intact}}  # fmt: skip
    atomic_write_json(folder / POINTER, pointer)
    log.warning("%s: %s was missing; rebuilt it from the %d intact checkpoint(s) here (%s), "
                "resuming from %s", folder, POINTER, len(intact), ", ".join(intact), intact[0])  # fmt: skip
    return pointer


def foreign_files(base: Path, layout: Mapping[str, int]) -> list[str]:
    """The state files in tag folder `base` that a run of `layout` does not write: a tag of
    more dp or tp ranks, or a ZeRO 1-2 tag under ZeRO-0, holds every file `layout` expects,
    and more. An expert-parallel layout's expert files are its own."""
    expected = {p.name for p in expected_files(base, layout)}
    experts = layout.get("ep", 1) > 1
    return sorted(p.name for p in base.glob("*_states.pt") if p.name not in expected
                  and not (experts and EXPERT_FILE.fullmatch(p.name)))  # fmt: skip


def read_pointer(path: Path) -> Pointer:
    """latest.json, checked for the shape save() writes; a one-line error naming what is wrong."""
    pointer = read_json(path)
    expected = "an object with tag, step and layout"
    if not isinstance(pointer, dict):
        raise StageError(f"{path}: expected {expected}, found a JSON {type(pointer).__name__}")
    missing = [k for k in ("tag", "step", "layout") if k not in pointer]
    if missing:
        raise StageError(f"{path}: no {missing[0]!r} (expected {expected})")
    tag = pointer["tag"]
    if not isinstance(tag, str) or not TAG.fullmatch(tag):
        raise StageError(f"{path}: 'tag' must be a tag like step00000004, found {tag!r}")
    tags = pointer.get("complete", [tag])
    if not isinstance(tags, list) or not all(isinstance(t, str) and TAG.fullmatch(t) for t in tags):
        raise StageError(f"{path}: 'complete' must list tags like step00000004, found {tags!r}")
    if tags[:1] != [tag]:
        raise StageError(f"{path}: 'complete' must start with the tag {tag}, found {tags!r}")
    if type(pointer["step"]) is not int or pointer["step"] != step_of(tag):
        raise StageError(f"{path}: 'step' must be {step_of(tag)}, the step of {tag}")
    layouts = pointer.get("layouts", dict.fromkeys(tags, pointer["layout"]))
    if not isinstance(layouts, dict) or set(layouts) != set(tags):
        raise StageError(
            f"{path}: 'layouts' must give the layout of each tag of 'complete' {tags!r}"
        )
    for layout in (pointer["layout"], *layouts.values()):
        if not isinstance(layout, dict) or not all(
            type(layout.get(k)) is int for k in ("dp", "tp", "zero_stage")
        ):
            raise StageError(
                f"{path}: 'layout' must hold integer dp, tp and zero_stage, found {layout!r}"
            )
    # its shape checked above
    return cast(Pointer, {**pointer, "complete": tags, "layouts": layouts})


def step_of(tag: str) -> int:
    """The optimizer step of a tag (step00000004 -> 4)."""
    return int(tag.removeprefix("step"))


def expected_files(base: Path, layout: Mapping[str, int]) -> list[Path]:
    """The files DeepSpeed writes into tag folder `base` under `layout`: model states (one per tp rank,
    one per dp and tp rank under ZeRO-3), then optimizer states (one per dp and tp rank under ZeRO 1-3)."""
    dp, tp, zero = layout["dp"], layout["tp"], layout["zero_stage"]
    if zero == 3:
        models = [
            base / f"zero_pp_rank_{r}_mp_rank_{t:02d}_model_states.pt"
            for t in range(tp)
            for r in range(dp)
        ]
    else:
        models = [base / f"mp_rank_{t:02d}_model_states.pt" for t in range(tp)]
    optims = [_optim_file(base, r, t) for t in range(tp) for r in range(dp)] if zero else []
    return models + optims


def _optim_file(base: Path, rank: int, tp_rank: int) -> Path:
    """The optimizer file of dp rank `rank`, tp rank `tp_rank` (DeepSpeed's bf16 optimizer, used for
    bf16 ZeRO-1, prefixes the name with bf16_)."""
    name = f"zero_pp_rank_{rank}_mp_rank_{tp_rank:02d}_optim_states.pt"
    found = sorted(base.glob(f"*{name}"))
    return found[0] if found else base / name


def check_tag(folder: Path, tag: str, layout: Mapping[str, int]) -> list[Path]:
    """The files of checkpoint `tag`, each present and loadable; else a one-line error naming the first bad one."""
    base = folder / tag
    if not base.is_dir():
        raise StageError(f"{base}: missing: the folder of checkpoint {tag} is gone")
    files = expected_files(base, layout)
    ep = f" ep={layout['ep']}" if layout.get("ep", 1) > 1 else ""
    run = f"{tag} of a dp={layout['dp']} tp={layout['tp']}{ep} ZeRO-{layout['zero_stage']} run"
    for path in files:
        if not path.exists():
            raise StageError(f"{path}: missing from the checkpoint ({run})")
        key = "optimizer_state_dict" if path.name.endswith("_optim_states.pt") else "module"
        content = load_file(path)
        if not isinstance(content, dict) or key not in content:
            raise StageError(f"{path}: not a DeepSpeed checkpoint file (no {key!r})")
        if path == files[0] and layout.get("ep", 1) > 1 and layout["zero_stage"] < 3:
            experts = _expert_files(base, content, path)
            for expert in experts:
                if not expert.exists():
                    raise StageError(f"{expert}: missing from the checkpoint ({run})")
                if not isinstance(load_file(expert), dict):
                    raise StageError(f"{expert}: not a DeepSpeed expert checkpoint file")
    return files


def _expert_files(base: Path, model_states: Mapping[str, Any], path: Path) -> list[Path]:
    """The per-expert files of an AutoEP checkpoint under ZeRO 1-2 (DeepSpeed writes each routed
    expert of each MoE layer to its own file, the layers numbered in module order), from the
    experts per MoE layer the model-states file lists."""
    counts = model_states.get("num_experts")
    if not isinstance(counts, list) or not all(type(n) is int for n in counts):
        raise StageError(
            f"{path}: an expert-parallel checkpoint lists no 'num_experts' per MoE layer"
        )
    return [
        base / f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt"
        for layer, n in enumerate(counts)
        for expert in range(n)
    ]


def resume_point(folder: Path, layout: Mapping[str, int]) -> Pointer | None:
    """The newest complete, intact checkpoint in `folder`, or None if there is none yet.

    Each tag is checked against the layout that wrote it (`layout` of the
    result); whether and how it resumes under this run's layout is
    `stagetrain.training.reshard`'s decision. A damaged newest checkpoint falls
    back to the next complete one the pointer lists (logged); with none left
    the first damage is the error. Tags without a pointer (it was deleted or
    lost) are not a fresh start: the pointer is rebuilt from those intact under
    this run's `layout` (`rebuild_pointer`), which would otherwise be overwritten
    and pruned by the fresh run's first save.
    """
    path = folder / POINTER
    if not path.exists():
        return rebuild_pointer(folder, layout)
    pointer = read_pointer(path)
    damage = []
    for tag in pointer["complete"]:
        try:
            check_tag(folder, tag, pointer["layouts"][tag])
        except StageError as err:
            damage.append(str(err))
            continue
        if damage:
            log.warning("checkpoint %s is damaged (%s); resuming from %s, the newest intact one",
                        pointer["tag"], damage[0], tag)  # fmt: skip
        return {**pointer, "tag": tag, "step": step_of(tag), "layout": pointer["layouts"][tag]}
    earlier = len(pointer["complete"]) - 1
    rest = (
        f"the {earlier} earlier kept checkpoint(s) are damaged too"
        if earlier
        else "no earlier complete checkpoint is kept"
    )
    raise StageError(f"{damage[0]}; {rest}: delete {folder} to start fresh")
