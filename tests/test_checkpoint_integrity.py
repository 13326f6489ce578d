"""A damaged or crafted checkpoint on resume: checked before loading, one line, fallback to an earlier complete one.

Tag folders here hold small files written with torch.save under the names
DeepSpeed uses, which is all the checks read; the slow tests in
test_pretrain_dist.py and test_consolidate.py damage real checkpoints.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from harness.checkpoints import ZERO2, Crafted, FakeEngine, saved, truncate

from stagetrain.consolidate.weights import checkpoint_files
from stagetrain.errors import StageError
from stagetrain.training.checkpoints import Checkpoints, tag_of


def test_save_lists_the_complete_checkpoints_kept_and_prunes_the_rest(tmp_path: Path) -> None:
    ckpt = saved(tmp_path, [2, 4, 6])
    pointer = json.loads((ckpt.folder / "latest.json").read_text())
    assert pointer == {"tag": "step00000006", "step": 6, "layout": ZERO2, "complete": ["step00000006", "step00000004"],
                       "layouts": {"step00000006": ZERO2, "step00000004": ZERO2}}  # fmt: skip
    assert sorted(p.name for p in ckpt.folder.glob("step*")) == ["step00000004", "step00000006"]
    assert ckpt.latest()["tag"] == "step00000006"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("folder", r"step00000006: missing: the folder of checkpoint step00000006 is gone"),
        ("model", r"step00000006/mp_rank_00_model_states.pt: unreadable, truncated or corrupt \(RuntimeError\)"),
        ("optimizer", r"step00000006/zero_pp_rank_1_mp_rank_00_optim_states.pt: unreadable, truncated or corrupt"),
        ("deleted", r"step00000006/zero_pp_rank_0_mp_rank_00_optim_states.pt: missing from the checkpoint \(step00000006 of a dp=2 tp=1 ZeRO-2 run\)"),
        ("empty", r"step00000006/mp_rank_00_model_states.pt: not a DeepSpeed checkpoint file \(no 'module'\)"),
    ],
)  # fmt: skip
def test_a_damaged_newest_checkpoint_falls_back_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, message: str
) -> None:
    ckpt = saved(tmp_path, [4, 6])
    base = ckpt.folder / "step00000006"
    if damage == "folder":
        for path in base.iterdir():
            path.unlink()
        base.rmdir()
    elif damage == "model":
        truncate(base / "mp_rank_00_model_states.pt")
    elif damage == "optimizer":
        truncate(base / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    elif damage == "deleted":
        (base / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    else:
        torch.save({}, base / "mp_rank_00_model_states.pt")
    with caplog.at_level(logging.INFO, logger="stagetrain"):
        pointer = ckpt.latest()
    assert (pointer["tag"], pointer["step"]) == ("step00000004", 4)
    [line] = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert line.startswith("checkpoint step00000006 is damaged (") and "\n" not in line
    assert line.endswith("resuming from step00000004, the newest intact one")
    with pytest.raises(StageError, match=message):  # a damaged final checkpoint is an error there
        checkpoint_files(ckpt.folder, "step00000006", ZERO2)
    # the next save after the fallback no longer lists or keeps the damaged tag
    ckpt.save(FakeEngine(ZERO2), 5, {"step": 5})
    assert json.loads((ckpt.folder / "latest.json").read_text())["complete"] == ["step00000005", "step00000004"]  # fmt: skip
    assert sorted(p.name for p in ckpt.folder.glob("step*")) == ["step00000004", "step00000005"]


def test_with_no_earlier_checkpoint_kept_the_damage_is_one_line(tmp_path: Path) -> None:
    ckpt = saved(tmp_path, [4, 6], keep=1)
    truncate(ckpt.folder / "step00000006" / "mp_rank_00_model_states.pt")
    with pytest.raises(StageError) as err:
        ckpt.latest()
    text = str(err.value)
    assert "step00000006/mp_rank_00_model_states.pt: unreadable, truncated or corrupt" in text
    assert "no earlier complete checkpoint is kept: delete" in text and "\n" not in text


def test_every_kept_checkpoint_damaged_is_one_line(tmp_path: Path) -> None:
    ckpt = saved(tmp_path, [4, 6])
    for step in (4, 6):
        (ckpt.folder / tag_of(step) / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(StageError, match=r"step00000006/mp_rank_00_model_states.pt: missing .* the 1 earlier kept checkpoint\(s\) are damaged too"):  # fmt: skip
        ckpt.latest()


@pytest.mark.parametrize(
    ("pointer", "message"),
    [
        ([], "expected an object with tag, step and layout, found a JSON list"),
        ({"step": 4, "layout": ZERO2}, "no 'tag'"),
        ({"tag": "step00000004", "layout": ZERO2}, "no 'step'"),
        ({"tag": "step00000004", "step": 4}, "no 'layout'"),
        ({"tag": "../x", "step": 4, "layout": ZERO2}, "'tag' must be a tag like step00000004, found '../x'"),
        ({"tag": "step00000004", "step": "4", "layout": ZERO2}, "'step' must be 4"),
        ({"tag": "step00000004", "step": 4, "layout": [2, 1, 2]}, "'layout' must hold integer dp, tp and zero_stage"),
        ({"tag": "step00000004", "step": 4, "layout": ZERO2, "complete": "step00000004"}, "'complete' must list tags"),
        ({"tag": "step00000004", "step": 4, "layout": ZERO2, "complete": ["step00000002"]}, "'complete' must start with the tag step00000004"),
    ],
)  # fmt: skip
def test_a_pointer_of_the_wrong_shape_is_one_line(
    tmp_path: Path, pointer: Any, message: str
) -> None:
    ckpt = saved(tmp_path, [4])
    (ckpt.folder / "latest.json").write_text(json.dumps(pointer))
    for read in (ckpt.latest, lambda: checkpoint_files(ckpt.folder, "step00000004", ZERO2)):
        with pytest.raises(StageError, match=message) as err:
            read()
        assert str(err.value).startswith(f"{ckpt.folder}/latest.json: ") and "\n" not in str(
            err.value
        )


def test_a_pointer_from_before_the_complete_list_still_resumes(tmp_path: Path) -> None:
    ckpt = saved(tmp_path, [4])
    (ckpt.folder / "latest.json").write_text(
        json.dumps({"tag": "step00000004", "step": 4, "layout": ZERO2})
    )
    assert ckpt.latest()["tag"] == "step00000004"
    ckpt.save(FakeEngine(ZERO2), 6, {"step": 6})
    assert json.loads((ckpt.folder / "latest.json").read_text())["complete"] == ["step00000006", "step00000004"]  # fmt: skip


def test_a_crafted_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    ckpt = saved(tmp_path, [4], keep=1)
    marker = tmp_path / "MARKER"
    torch.save(
        {"module": Crafted(marker)}, ckpt.folder / "step00000004" / "mp_rank_00_model_states.pt"
    )
    with pytest.raises(StageError, match=r"mp_rank_00_model_states.pt: refused: it pickles more than tensors .*GLOBAL io.open.* not loaded") as err:  # fmt: skip
        ckpt.latest()
    assert "\n" not in str(err.value)
    assert not marker.exists()


def test_deepspeeds_own_reader_refuses_a_crafted_file_under_weights_only_loads(
    tmp_path: Path,
) -> None:
    """DeepSpeed's checkpoint reader passes weights_only=False (what engine.load_checkpoint
    calls); under the stages' `weights_only_loads` it goes through the weights-only
    unpickler and refuses the file, without it the file's code runs."""
    import pickle

    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from stagetrain.training.integrity import weights_only_loads

    marker, path = tmp_path / "ran", tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": Crafted(marker)}, path)
    with weights_only_loads(), pytest.raises(pickle.UnpicklingError):
        TorchCheckpointEngine().load(str(path), map_location="cpu")
    assert not marker.exists()
    TorchCheckpointEngine().load(str(path), map_location="cpu")
    assert marker.exists()  # the reader alone would have run it


def test_tags_without_a_pointer_rebuild_it_and_survive_the_next_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lost latest.json is not a fresh start: the fresh run's first save would prune every
    intact checkpoint. The pointer is rebuilt from the intact tags, and the run resumes."""
    ckpt = saved(tmp_path, [2, 4, 6], keep=3)
    (ckpt.folder / "latest.json").unlink()
    truncate(ckpt.folder / "step00000006" / "mp_rank_00_model_states.pt")  # a save killed halfway
    with caplog.at_level(logging.WARNING, logger="stagetrain"):
        point = ckpt.latest()
    assert point["tag"] == "step00000004" and point["complete"] == ["step00000004", "step00000002"]
    assert "latest.json was missing; rebuilt it from the 2 intact checkpoint(s)" in caplog.text
    assert "step00000006 not intact" in caplog.text
    ckpt.save(FakeEngine(ZERO2), 6, {"step": 6})
    assert sorted(p.name for p in ckpt.folder.glob("step*")) == [
        "step00000002",
        "step00000004",
        "step00000006",
    ]


def test_without_a_pointer_or_an_intact_tag_the_run_starts_fresh(tmp_path: Path) -> None:
    ckpt = saved(tmp_path, [2])
    (ckpt.folder / "latest.json").unlink()
    truncate(ckpt.folder / "step00000002" / "mp_rank_00_model_states.pt")
    assert ckpt.latest() is None
    assert not (ckpt.folder / "latest.json").exists()


def test_a_save_never_prunes_a_tag_its_pointer_did_not_list(tmp_path: Path) -> None:
    ckpt = saved(tmp_path, [2, 4, 6], keep=3)
    pointer = json.loads((ckpt.folder / "latest.json").read_text())
    listed = {**pointer, "complete": ["step00000006", "step00000004"],
              "layouts": {t: ZERO2 for t in ("step00000006", "step00000004")}}  # fmt: skip
    # step 2 unlisted (restored by hand)
    (ckpt.folder / "latest.json").write_text(json.dumps(listed))
    small = saved(tmp_path, [8], keep=2)
    assert small.folder == ckpt.folder
    assert sorted(p.name for p in ckpt.folder.glob("step*")) == [
        "step00000002",
        "step00000006",
        "step00000008",
    ]


class FullDiskEngine(FakeEngine):
    """A save that writes its first file halfway and fails as torch.save does on a full disk."""

    def __init__(self, layout: dict[str, int], error: Exception) -> None:
        super().__init__(layout)
        self.error = error

    def save_checkpoint(
        self, folder: str, *, tag: str, client_state: dict, save_latest: bool
    ) -> None:
        base = Path(folder) / tag
        base.mkdir(parents=True)
        (base / "mp_rank_00_model_states.pt").write_bytes(b"\0" * 4096)
        raise self.error


@pytest.mark.parametrize(
    "error",
    [RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
     PermissionError(13, "Permission denied")],
    ids=["full-disk", "read-only"],
)  # fmt: skip
def test_a_save_that_cannot_be_written_is_one_line_and_leaves_no_partial_tag(
    tmp_path: Path, error: Exception
) -> None:
    """The stage's own save path: the partial tag (8 MB of the tiny model's 16 on a real full
    disk) is removed, the pointer and the complete tags are untouched, and the line says so."""
    ckpt = saved(tmp_path, [2, 4])
    before = (ckpt.folder / "latest.json").read_bytes()
    with pytest.raises(StageError, match=r"checkpoint step00000006: could not be written in .* MiB free "
                       r"there\); the partial save was removed, and the run resumes from step00000004"):  # fmt: skip
        ckpt.save(FullDiskEngine(ZERO2, error), 6, {"step": 6})
    assert not (ckpt.folder / "step00000006").exists()
    assert (ckpt.folder / "latest.json").read_bytes() == before
    assert ckpt.latest()["tag"] == "step00000004"


def test_a_pointer_that_cannot_be_written_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = saved(tmp_path, [2])
    from stagetrain.training import checkpoints

    def no_space(path: Path, obj: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoints, "atomic_write_json", no_space)
    with pytest.raises(
        StageError,
        match=r"step00000004: could not be written .*No space left on device.*resumes from step00000002",
    ):
        ckpt.save(FakeEngine(ZERO2), 4, {"step": 4})
    assert not (ckpt.folder / "step00000004").exists()


def test_a_checkpoint_folder_that_cannot_be_written_is_one_line_before_anything_is_built(
    tmp_path: Path,
) -> None:
    """A read-only folder failed at the first write, inside the ranks, after the engines were
    built. Root ignores file modes, so the folder here is a path under a plain file."""
    ckpt = Checkpoints(tmp_path, {"seed": 1}, ZERO2, keep=2)
    ckpt.folder.write_text("")
    with pytest.raises(StageError) as err:
        ckpt.hold()
    assert str(err.value) == (f"{ckpt.folder}: cannot write the stage's checkpoints here (File exists); "
                              "make it writable, or free space, then rerun")  # fmt: skip


def test_a_peer_gone_mid_save_is_not_called_a_write_failure(tmp_path: Path) -> None:
    """A RuntimeError that is not torch.save's writer (gloo's, when another rank dies) keeps its
    own report: the launcher names the rank that died, not a full disk."""
    ckpt = saved(tmp_path, [2])
    gone = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    )
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        ckpt.save(FullDiskEngine(ZERO2, gone), 4, {"step": 4})
