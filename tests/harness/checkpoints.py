"""Checkpoint folders for tests: DeepSpeed's file names with small contents, damage, the state a kill leaves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from stagetrain.training.checkpoints import Checkpoints, tag_of
from stagetrain.training.integrity import expected_files
from stagetrain.training.summary import StageSummary

ZERO2 = {"dp": 2, "tp": 1, "zero_stage": 2}


class Crafted:
    """Unpickling this runs code: it creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def fake_checkpoint(folder: Path, step: int, layout: dict[str, int]) -> Path:
    """A tag folder with every file DeepSpeed writes under `layout`, each a small loadable dict."""
    base = folder / tag_of(step)
    base.mkdir(parents=True)
    for path in expected_files(base, layout):
        key = "optimizer_state_dict" if path.name.endswith("_optim_states.pt") else "module"
        torch.save({key: {"w": torch.full((4,), float(step))}}, path)
    return base


def fake_universal(folder: Path, tag: str, missing: str | None = None) -> Path:
    """`tag`'s universal copy as a conversion leaves it, for one parameter `w`: its model states
    and zero/w/ with every file but `missing`."""
    from stagetrain.training.reshard import UNIVERSAL_FILES, universal_tag

    base = folder / universal_tag(tag)
    (base / "zero" / "w").mkdir(parents=True)
    torch.save({"param_shapes": [{"w": torch.Size([4])}]}, base / "mp_rank_00_model_states.pt")
    for name in UNIVERSAL_FILES:
        if name != missing:
            torch.save({"param": torch.zeros(4), "cat_dim": 0}, base / "zero" / "w" / name)
    return base


class FakeEngine:
    """engine.save_checkpoint as DeepSpeed's: every rank's files into folder/tag."""

    def __init__(self, layout: dict[str, int]) -> None:
        self.layout = layout

    def save_checkpoint(
        self, folder: str, *, tag: str, client_state: dict, save_latest: bool
    ) -> None:
        fake_checkpoint(Path(folder), int(tag.removeprefix("step")), self.layout)


def saved(
    root: Path, steps: list[int], layout: dict[str, int] = ZERO2, keep: int = 2
) -> Checkpoints:
    """A checkpoint root with `steps` saved under `layout` through the real Checkpoints."""
    ckpt = Checkpoints(root, {"seed": 1}, layout, keep=keep)
    for step in steps:
        ckpt.save(FakeEngine(layout), step, {"step": step})
    return ckpt


def truncate(path: Path) -> None:
    """Cut the file to half its size, as a write stopped by a full disk or a kill."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def killed_after_step_2(summary: StageSummary, out: Path) -> Path:
    """A copy of the run's checkpoint root as a SIGKILL after step 2's checkpoint leaves it: the
    pointer at step 2, the later tags never written; the logs beyond step 2 as they were."""
    source = Path(summary["checkpoint"]["folder"])
    root = out / "checkpoints"
    shutil.copytree(source.parent, root)
    folder = root / source.name
    for later in folder.glob("step*"):
        if int(later.name.removeprefix("step")) > 2:
            shutil.rmtree(later)
    layout = json.loads((folder / "latest.json").read_text())["layouts"][tag_of(2)]
    (folder / "latest.json").write_text(json.dumps({"tag": tag_of(2), "step": 2, "layout": layout,
                                                    "complete": [tag_of(2)], "layouts": {tag_of(2): layout}}))  # fmt: skip
    return root
