"""Resuming a checkpoint written under another layout (world size, dp, tp, ep, ZeRO stage).

DeepSpeed's sharded files are tied to the layout that wrote them. Two cases
need no conversion and one needs DeepSpeed's universal checkpoint:

- ZeRO-0 to ZeRO-0 with the same tp: the model file of each tp rank already
  holds the whole model and optimizer state, whatever dp wrote it, so it loads
  as it is.
- ZeRO 1-3 to ZeRO 1-3 (tp changes included, with ZeRO 1-2 on both tp sides):
  the tag is converted once with DeepSpeed's own `ds_to_universal` (ZeRO
  partitions and AutoTP slices merged into one folder per parameter holding
  its fp32 weights and both Adam moments), and the engine loads that with
  `checkpoint.load_universal`, re-partitioning under the new layout. The
  converted copy is written under a temporary name beside the original and
  renamed to `<tag>.universal` when complete, so a killed conversion leaves
  nothing that looks finished and the next try reuses a finished one. It lives
  and dies with its tag (`keep_checkpoints` prunes both together).
- Expert parallelism (ep > 1, DeepSpeed AutoEP) on either side converts too (AutoEP's
  universal loader gives each rank its experts). AutoEP names an MoE layer's weights its own
  way (`training.autoep`), so where one side runs AutoEP and the other does not, the copy's
  MoE weights and moments are renamed (and the fused projection split or joined) for the
  side that loads it; such a copy is `<tag>.autoep.universal` when AutoEP loads it.
- Anything involving ZeRO-0 and another stage or tp is refused with one line:
  DeepSpeed's universal format is built from, and loaded into, ZeRO
  optimizer partitions, which a ZeRO-0 run does not have.

The universal folder also gets the model-states file under the name the
target's ZeRO stage looks for (ZeRO-3 reads `zero_pp_rank_0_mp_rank_XX_...`,
the others `mp_rank_XX_...`): under `load_universal` DeepSpeed reads only the
step, scheduler and client state from it, the weights come from `zero/`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import pickle
import shutil
import time
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from stagetrain.errors import StageError
from stagetrain.training.autoep import FUSED, autoep_names, gated_shared_expert, transformers_name
from stagetrain.training.integrity import ResumePoint, load_file, weights_only_loads

log = logging.getLogger("stagetrain")
SUFFIX = ".universal"
AUTOEP = ".autoep"
"""In a universal copy's name: its MoE weights under AutoEP's names (`training.autoep`)."""


def describe(layout: Mapping[str, int]) -> str:
    """'2 ranks (dp=2 tp=1) ZeRO-2', or '2 ranks (dp=2 tp=1 ep=2) ZeRO-1', for the log line."""
    world = layout["dp"] * layout["tp"]
    ep = f" ep={layout['ep']}" if _autoep(layout) else ""
    return (
        f"{world} rank{'s' if world != 1 else ''} (dp={layout['dp']} tp={layout['tp']}{ep}) "
        f"ZeRO-{layout['zero_stage']}"
    )


def plan(old: Mapping[str, int], new: Mapping[str, int], *, final: bool = False) -> str:
    """How a checkpoint of layout `old` resumes under `new`: "same", "as_is", "universal", or,
    for the stage's `final` checkpoint, "weights" (its module alone, `load_module_only`).

    A final checkpoint trains nothing more, so a change no format carries (ZeRO-0 against
    another ZeRO stage: a finished pretraining rerun for a zero_stage set for GRPO's sake)
    needs its weights, not the optimizer; under ZeRO 0-2 each tp rank's model file holds them
    (ZeRO-3's holds placeholders).

    Raises:
        StageError: a change DeepSpeed's formats cannot carry (ZeRO-0 against another stage or tp).
    """
    if dict(old) == dict(new):
        return "same"
    if old["zero_stage"] == 0 and new["zero_stage"] == 0 and old["tp"] == new["tp"]:
        return "as_is"
    if old["zero_stage"] == 0 or new["zero_stage"] == 0:
        if final and old["zero_stage"] != 3 and old["tp"] == new["tp"] and not _autoep(old):
            return "weights"
        raise StageError(
            f"{describe(old)} -> {describe(new)}: a ZeRO-0 checkpoint resumes only under ZeRO-0 with "
            "the same tp, and an expert-parallel one only under ZeRO 1-3 (DeepSpeed's universal "
            "checkpoint needs ZeRO 1-3 on both sides); set "
            f"parallelism.zero_stage: {old['zero_stage']} to resume, or delete the folder to start fresh"
        )
    return "universal"


def universal_tag(tag: str, autoep: bool = False) -> str:
    """The tag folder of `tag`'s universal copy, under transformers' names or AutoEP's."""
    return f"{tag}{AUTOEP if autoep else ''}{SUFFIX}"


def universal_tags(tag: str) -> tuple[str, str]:
    """Both universal copies `tag` can have."""
    return universal_tag(tag), universal_tag(tag, autoep=True)


def source_tag(name: str) -> str:
    """The checkpoint tag a folder belongs to (step00000004.universal, step00000004.autoep.universal
    and a conversion's temp folder .step00000004.universal.tmp -> step00000004)."""
    return name.removeprefix(".").removesuffix(".tmp").removesuffix(SUFFIX).removesuffix(AUTOEP)


def _autoep(layout: Mapping[str, int]) -> bool:
    """Whether a layout's model runs under AutoEP, whose MoE layers name their weights otherwise."""
    return layout.get("ep", 1) > 1


def convert(folder: Path, tag: str, old: Mapping[str, int], new: Mapping[str, int]) -> str:
    """`tag`'s universal copy in `folder`, made now or reused from an earlier try; its tag.

    Logs what changed, how long the conversion took and its size. A
    conversion DeepSpeed cannot do (a file that reads but holds the wrong
    state) is a one-line error naming the tag folder, and nothing is left behind.
    """
    target = folder / universal_tag(tag, _autoep(new))
    change = f"{describe(old)} -> {describe(new)}"
    if target.is_dir():
        missing = missing_universal_file(target)
        if missing is None:
            log.info(
                "%s: reusing the universal checkpoint %s (%s)", change, target.name, _size(target)
            )
            return target.name
        # DeepSpeed's loader would stop on it ("exp_avg not found"); the source tag is intact.
        log.warning("%s: the universal checkpoint %s lacks %s: converting %s again",
                    change, target.name, missing, tag)  # fmt: skip
        shutil.rmtree(target)
    work = folder / f".{target.name}.tmp"
    shutil.rmtree(work, ignore_errors=True)  # a killed earlier try
    began = time.monotonic()
    try:
        _ds_to_universal(folder / tag, work / tag)
        _model_states_for_every_stage(work / tag, folder / tag)
        _optimizer_state_for_every_stage(work / tag / "zero")
        _param_files_for_every_stage(work / tag)
        if _autoep(old) != _autoep(new):
            _rename_experts(work / tag, to_autoep=_autoep(new))
    except StageError:  # a converted file that does not read back: named already
        shutil.rmtree(work, ignore_errors=True)
        raise
    except (AssertionError, KeyError, IndexError, ValueError, RuntimeError, OSError, TypeError,
            EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as err:  # fmt: skip
        shutil.rmtree(work, ignore_errors=True)
        raise StageError(
            f"{folder / tag}: cannot convert to a universal checkpoint ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else 'no detail'}); nothing was changed"
        ) from None
    (work / tag).rename(target)
    shutil.rmtree(work, ignore_errors=True)
    log.info("%s: converted step %d to a universal checkpoint in %.1f s, %s",
             change, int(tag.removeprefix("step")), time.monotonic() - began, _size(target))  # fmt: skip
    return target.name


def _ds_to_universal(source: Path, output: Path) -> None:
    """DeepSpeed's converter, in process and serially (no worker pool in a rank), its prints and
    progress bars kept out of the stage's log (a failure still raises)."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(source), output_folder=str(output), num_extract_workers=1,
        num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True,
    )  # fmt: skip
    output.parent.mkdir(parents=True, exist_ok=True)
    quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
    with weights_only_loads(), quiet[0], quiet[1]:
        ds_to_universal.main(args)


def _model_states_for_every_stage(folder: Path, source: Path) -> None:
    """Give each tp rank's model-states file the other stage's name too (see the module docstring).

    ds_to_universal copies these files from the source tag unchanged; they are
    replaced by hard links to the source's, and the second name is a hard link
    too, so the universal folder adds no second copy of the weights they hold.
    """
    for path in sorted(folder.glob("*model_states.pt")):
        name = path.name
        if name.startswith("zero_pp_rank_0_"):
            twin = name.removeprefix("zero_pp_rank_0_")
        elif name.startswith("mp_rank_"):
            twin = f"zero_pp_rank_0_{name}"
        else:
            continue
        original = source / name
        if original.exists() and original.stat().st_size == path.stat().st_size:
            _link(original, path)
        if not (folder / twin).exists():
            _link(path, folder / twin)


def _link(existing: Path, name: Path) -> None:
    """`name` as a hard link to `existing` (a copy where the filesystem has no hard links)."""
    tmp = name.with_name(f".{name.name}.link")
    tmp.unlink(missing_ok=True)
    try:
        os.link(existing, tmp)
    except OSError:
        shutil.copy2(existing, tmp)
    os.replace(tmp, name)


def _optimizer_state_for_every_stage(zero: Path) -> None:
    """Give the universal folder the optimizer step both of DeepSpeed's loaders look for.

    ds_to_universal writes the Adam step where the source's ZeRO stage keeps
    it and the loaders read it where the target's keeps it: ZeRO 1-2 per
    parameter (`<param>/step.pt`), ZeRO-3 in the global `optimizer_state.pt`
    (`optimizer_state_dict.state[0].step`, with its `param_groups`). Without
    this a ZeRO-3 -> ZeRO-2 resume would restart Adam's bias correction at
    step 0, and ZeRO-2 -> ZeRO-3 fails on the missing key. Likewise the ZeRO 1-2
    loader asserts the global state's `ds_version`, which ZeRO-3's lacks (the
    version that wrote the source: this install's, as the conversion just read it).
    """
    import deepspeed
    import torch

    path = zero / "optimizer_state.pt"
    state = load_file(path)
    inner = state.get("optimizer_state_dict")
    steps = sorted(zero.glob("*/step.pt"))
    if inner is not None:
        step = inner["state"][0]["step"]
    elif steps:
        step = load_file(steps[0])
    else:
        raise KeyError("no optimizer step in the converted checkpoint")
    if inner is None or "ds_version" not in state:
        state.setdefault("ds_version", deepspeed.__version__)
        state.setdefault(
            "optimizer_state_dict",
            {"state": {0: {"step": step}}, "param_groups": state["param_groups"]},
        )
        # `state` is memory-mapped from `path` (ZeRO-3's holds the fp32 weights): saving over
        # it in place would truncate the pages being read (SIGBUS); a new file, then rename.
        torch.save(state, path.with_name(path.name + ".new"))
        os.replace(path.with_name(path.name + ".new"), path)
    for folder in (p.parent for p in zero.glob("*/fp32.pt")):
        if not (folder / "step.pt").exists():
            torch.save(step, folder / "step.pt")


def _param_files_for_every_stage(folder: Path) -> None:
    """Give a universal copy made from ZeRO-3 the per-parameter files the ZeRO 1-2 loader reads.

    From ZeRO-3, ds_to_universal writes each parameter's states (`fp32.pt`, the
    Adam moments) as bare flat tensors, and only under the name of a tied
    parameter's owner; the ZeRO 1-2 loader takes each file as {"param": tensor
    of the parameter's shape, "cat_dim": ...} and looks for a folder under every
    name (it fails on an IndexError otherwise). The ZeRO-3 loader reads both
    forms, so the copy stays one for every target. Shapes and tied names come
    from the model-states file; files are rewritten through a new file (the old
    one is memory-mapped while it is read).
    """
    import torch

    states = load_file(next(folder.glob("*model_states.pt")))
    shapes = {name: shape for group in states["param_shapes"] for name, shape in group.items()}
    zero = folder / "zero"
    for name, shape in shapes.items():
        for path in sorted((zero / name).glob("*.pt")):
            value = load_file(path)
            if path.name != "step.pt" and isinstance(value, torch.Tensor):
                torch.save(
                    {"param": value.view(shape), "cat_dim": 0}, path.with_name(path.name + ".new")
                )
                os.replace(path.with_name(path.name + ".new"), path)
    for alias, owner in states.get("shared_params", {}).items():
        if (zero / owner).is_dir() and not (zero / alias).exists():
            shutil.copytree(
                zero / owner, zero / alias, copy_function=lambda a, b: _link(Path(a), Path(b))
            )


def _rename_experts(folder: Path, *, to_autoep: bool) -> None:
    """Turn a universal copy's MoE weights (with their Adam moments) and its model-states files'
    names from AutoEP's to transformers' or back (`training.autoep`), for a resume that turns
    expert parallelism on or off: AutoEP's universal loader takes each rank's experts from the
    whole tensors under its own names, marked as experts; the plain loader reads transformers'.

    The model-states files are written anew, not through their hard links to the source tag:
    under `load_universal` DeepSpeed reads only the step, scheduler and client state from them,
    `restore_buffers` the buffers, and `missing_universal_file` the parameter names.
    """
    import torch

    zero = folder / "zero"
    gated = gated_shared_expert(p.name for p in zero.iterdir())
    for param in sorted(p for p in zero.iterdir() if p.is_dir()):
        if not param.is_dir():  # the up half, joined already with its gate half
            continue
        names = autoep_names(param.name) if to_autoep else (transformers_name(param.name, gated),)
        if names == (param.name,):  # not an MoE layer's tensor
            continue
        if len(names) == 2:  # transformers' fused projection -> AutoEP's gate and up halves
            for file in _states(param):
                value = _tensor(file)
                for half, part in zip(names, value.chunk(2, dim=1), strict=True):
                    _save_param(part, zero / half / file.name, experts=len(value))
        elif names[0].endswith(FUSED):  # AutoEP's gate half, with its up half -> one projection
            up = zero / autoep_names(names[0])[1]
            for file in _states(param):
                joined = torch.cat([_tensor(file), _tensor(up / file.name)], dim=1)
                _save_param(joined, zero / names[0] / file.name, experts=None)
            shutil.rmtree(up)
        elif param.name.endswith((".w2", ".down_proj")):  # the down projection: (un)marked
            for file in _states(param):
                value = _tensor(file)
                _save_param(value, zero / names[0] / file.name,
                            experts=len(value) if to_autoep else None)  # fmt: skip
        else:  # the router's weight and bias: renamed
            param.rename(zero / names[0])
            continue
        for name in names:
            shutil.copy2(param / "step.pt", zero / name / "step.pt")
        shutil.rmtree(param)
    if to_autoep:
        _groups_for_autoep(zero / "optimizer_state.pt")
    for path in sorted(folder.glob("*model_states.pt")):
        states = load_file(path)
        buffers = [transformers_name(b, gated) if not to_autoep else autoep_names(b)[0]
                   for b in states.get("buffer_names", [])]  # fmt: skip
        module = states["module"]
        states["module"] = {new: module[old] for old, new in
                            zip(states.get("buffer_names", []), buffers, strict=True) if old in module}  # fmt: skip
        states["buffer_names"] = buffers
        states["param_shapes"] = [
            _renamed_shapes(group, to_autoep, gated) for group in states["param_shapes"]
        ]
        torch.save(states, path.with_name(path.name + ".new"))
        os.replace(path.with_name(path.name + ".new"), path)


def _groups_for_autoep(path: Path) -> None:
    """Give the optimizer's global state a parameter group for each group AutoEP's optimizer has.

    AutoEP splits each parameter group in two, the dense parameters and the experts, and the
    ZeRO 1-2 universal loader pairs the optimizer's groups with the saved ones one by one
    (`zip`): a copy saved without AutoEP has one group, so the experts' group would be skipped,
    its Adam step left at 0 (measured: the first update after the resume differed, 4e-4 in the
    loss). The groups' settings (lr, betas, ...) are the same for both halves.
    """
    state = load_file(path)
    for holder in (state, state.get("optimizer_state_dict") or {}):
        if "param_groups" in holder:
            groups = holder["param_groups"]
            holder["param_groups"] = groups + [dict(g) for g in groups]
    torch.save(state, path.with_name(path.name + ".new"))
    os.replace(path.with_name(path.name + ".new"), path)


def _states(param: Path) -> list[Path]:
    """A universal parameter folder's weight and Adam moment files (not its step)."""
    return [param / name for name in UNIVERSAL_FILES if (param / name).exists()]


def _tensor(path: Path) -> torch.Tensor:
    value = load_file(path)
    return value["param"] if isinstance(value, dict) else value


def _save_param(value: torch.Tensor, path: Path, *, experts: int | None) -> None:
    """One universal parameter file; AutoEP's universal loader slices a tensor marked as experts
    (their count first) among the ranks of an ep group."""
    record: dict[str, object] = {"param": value.contiguous(), "cat_dim": 0}
    if experts is not None:
        record |= {"is_expert_param": True, "ep_num_experts": experts}
    path.parent.mkdir(exist_ok=True)
    torch.save(record, path.with_name(path.name + ".new"))
    os.replace(path.with_name(path.name + ".new"), path)


def _renamed_shapes(
    group: Mapping[str, torch.Size], to_autoep: bool, gated: bool
) -> dict[str, torch.Size]:
    """A `param_shapes` group under the other names (shapes of whole tensors are not kept here:
    only the names are read back)."""
    out = {}
    for name, shape in group.items():
        for new in autoep_names(name) if to_autoep else (transformers_name(name, gated),):
            out[new] = shape
    return out


UNIVERSAL_FILES = ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt")
"""What a universal copy holds for each parameter, under zero/<name>/."""


def missing_universal_file(folder: Path) -> str | None:
    """The first file a universal copy lacks (its model states, or a parameter's of
    UNIVERSAL_FILES, by the names the model states list), relative to `folder`; None if whole."""
    states = next(folder.glob("*model_states.pt"), None)
    if states is None:
        return "its model states file"
    for group in load_file(states)["param_shapes"]:
        for name in group:
            for file in UNIVERSAL_FILES:
                if not (folder / "zero" / name / file).is_file():
                    return f"zero/{name}/{file}"
    return None


def check_universal(folder: Path) -> None:
    """Every file of a universal copy readable (the weights-only unpickler), else one line naming it."""
    for path in sorted(folder.rglob("*.pt")):
        load_file(path)


def _size(folder: Path) -> str:
    # disk the copy adds: files hard-linked to the source tag's are counted once there
    total = sum(
        p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.stat().st_nlink == 1
    )
    return f"{total / 1e6:.1f} MB"


class LoadOptions(NamedTuple):
    """What `engine.load_checkpoint` needs for a resume point."""

    tag: str
    """The tag folder to load."""
    universal: bool
    """Whether it is a universal copy (DeepSpeed's `load_universal_checkpoint`)."""
    module_only: bool
    """Whether only the weights load (`load_module_only`)."""


def restore_buffers(module: torch.nn.Module, folder: Path) -> list[str]:
    """Copy into `module` the buffers the universal copy `folder`'s model-states file holds; the
    names restored.

    DeepSpeed's universal load rebuilds parameters from zero/ and takes only the
    step, scheduler and client state from the model-states file, so a persistent
    buffer (deepseek_v3's routing bias, trained by its own update rule, not the
    optimizer) would keep its initial value. Buffers are whole on every rank and
    alike on every tp rank (ZeRO and AutoTP split parameters), so tp rank 0's
    file serves every rank of the new layout.
    """
    saved = load_file(folder / "mp_rank_00_model_states.pt")["module"]
    restored = []
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name in saved:
                buffer.copy_(saved[name])
                restored.append(name)
    return restored


def mend_optimizer(optimizer: object) -> None:
    """Give each optimizer sub-group its own Adam step after a universal load.

    DeepSpeed 0.19.8's ZeRO-3 universal loader gives every sub-group the same step tensor, and
    AdamW adds 1 to it in place once per sub-group, so with two sub-groups (AutoEP's dense and
    experts; by the code, a model larger than `sub_group_size` too) the second stepped with a
    count one ahead: measured on 2 ranks at ep=2, the experts' weights were 9e-5 off after one
    update. (The same loader also copies the first group's name into every group, which
    changed nothing measurable here, and is left.)
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    seen: set[int] = set()
    for state in getattr(inner, "state", {}).values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(step))


def load_options(point: ResumePoint) -> LoadOptions:
    """What `engine.load_checkpoint` needs for `point`: the tag folder and whether it is universal."""
    return LoadOptions(tag=point["load_tag"], universal=point["load_tag"].endswith(SUFFIX),
                       module_only=point["module_only"])  # fmt: skip
