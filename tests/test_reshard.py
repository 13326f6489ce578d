"""Resuming under another layout, without ranks: what is converted, what is refused, what a failed conversion leaves.

The real conversions (DeepSpeed's ds_to_universal on checkpoints of real runs)
are the drills of test_elastic.py and test_workflow.py; here the tag folders
are the small stand-ins of test_checkpoint_integrity.py, which hold the right
file names but not DeepSpeed's state, so a conversion of them must fail cleanly.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from harness.checkpoints import ZERO2, FakeEngine, fake_universal, saved

from stagetrain.errors import StageError
from stagetrain.training import reshard
from stagetrain.training.checkpoints import Checkpoints

ZERO2_DP1 = {"dp": 1, "tp": 1, "zero_stage": 2}


@pytest.mark.parametrize(
    ("old", "new", "how"),
    [
        (ZERO2, ZERO2, "same"),
        ({"dp": 2, "tp": 1, "zero_stage": 0}, {"dp": 1, "tp": 1, "zero_stage": 0}, "as_is"),
        (ZERO2, ZERO2_DP1, "universal"),
        (ZERO2, {"dp": 2, "tp": 1, "zero_stage": 3}, "universal"),
        ({"dp": 1, "tp": 2, "zero_stage": 1}, {"dp": 1, "tp": 1, "zero_stage": 1}, "universal"),
    ],
)
def test_which_changes_convert(old: dict, new: dict, how: str) -> None:
    assert reshard.plan(old, new) == how
    assert reshard.plan(old, new, final=True) == how  # a final checkpoint that converts, converts


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ({"dp": 2, "tp": 1, "zero_stage": 0}, ZERO2_DP1),
        (ZERO2, {"dp": 1, "tp": 1, "zero_stage": 0}),
    ],
)
def test_a_final_checkpoint_no_format_carries_loads_its_weights_alone(old: dict, new: dict) -> None:
    assert reshard.plan(old, new, final=True) == "weights"


@pytest.mark.parametrize(
    ("old", "new"),
    [({"dp": 1, "tp": 2, "zero_stage": 0}, {"dp": 2, "tp": 1, "zero_stage": 0}),
     ({"dp": 2, "tp": 1, "zero_stage": 3}, {"dp": 2, "tp": 1, "zero_stage": 0})],
    ids=["another-tp", "zero3-placeholders"],
)  # fmt: skip
def test_a_final_checkpoint_whose_model_file_cannot_give_the_weights_is_still_refused(
    old: dict, new: dict
) -> None:
    with pytest.raises(StageError, match="a ZeRO-0 checkpoint resumes only under ZeRO-0"):
        reshard.plan(old, new, final=True)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ({"dp": 2, "tp": 1, "zero_stage": 0}, ZERO2_DP1),
        (ZERO2, {"dp": 1, "tp": 1, "zero_stage": 0}),
        ({"dp": 1, "tp": 2, "zero_stage": 0}, {"dp": 2, "tp": 1, "zero_stage": 0}),
    ],
)
def test_a_change_the_formats_cannot_carry_is_one_line(old: dict, new: dict) -> None:
    with pytest.raises(StageError) as err:
        reshard.plan(old, new)
    assert "a ZeRO-0 checkpoint resumes only under ZeRO-0 with the same tp" in str(err.value)
    assert f"set parallelism.zero_stage: {old['zero_stage']}" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_checkpoint_that_cannot_be_converted_is_one_line_and_changes_nothing(
    tmp_path: Path,
) -> None:
    ckpt = saved(tmp_path, [2, 4], ZERO2)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    pointer = (ckpt.folder / "latest.json").read_text()
    with pytest.raises(StageError) as err:
        Checkpoints(tmp_path, {"seed": 1}, ZERO2_DP1, keep=2).latest()
    line = str(err.value)
    assert line.startswith(
        f"{ckpt.folder / 'step00000004'}: cannot convert to a universal checkpoint ("
    )
    assert line.endswith("nothing was changed") and "\n" not in line
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    assert (ckpt.folder / "latest.json").read_text() == pointer


def test_the_pointer_keeps_each_tags_layout_and_prunes_a_universal_copy_with_its_tag(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = saved(tmp_path, [2], ZERO2)
    fake_universal(old.folder, "step00000002")
    new = Checkpoints(tmp_path, {"seed": 1}, ZERO2_DP1, keep=2)
    with caplog.at_level(logging.INFO, logger="stagetrain"):
        point = new.latest()
    assert point["load_tag"] == "step00000002.universal" and point["layout"] == ZERO2
    assert any(
        "reusing the universal checkpoint step00000002.universal" in r.getMessage()
        for r in caplog.records
    )
    new.save(FakeEngine(ZERO2_DP1), 3, {"step": 3})
    pointer = json.loads((new.folder / "latest.json").read_text())
    assert pointer["layouts"] == {"step00000003": ZERO2_DP1, "step00000002": ZERO2}
    # the newest is damaged: the fallback checks step 2 against the layout that wrote it
    (new.folder / "step00000003" / "mp_rank_00_model_states.pt").unlink()
    assert new.latest()["tag"] == "step00000002"
    (new.folder / ".step00000002.universal.tmp").mkdir()  # a conversion killed on a later try
    new.save(FakeEngine(ZERO2_DP1), 4, {"step": 4})
    new.save(FakeEngine(ZERO2_DP1), 5, {"step": 5})
    assert sorted(p.name for p in new.folder.glob("*step*")) == ["step00000004", "step00000005"]


def test_a_universal_copy_missing_a_file_is_converted_again_from_its_intact_tag(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Reused, it stopped DeepSpeed's loader inside the ranks ("exp_avg not found"). The tags
    here cannot convert, so the conversion tried again fails in its own one line."""
    old = saved(tmp_path, [2], ZERO2)
    copy = fake_universal(old.folder, "step00000002", missing="exp_avg.pt")
    with (
        caplog.at_level(logging.INFO, logger="stagetrain"),
        pytest.raises(StageError, match="cannot convert"),
    ):
        Checkpoints(tmp_path, {"seed": 1}, ZERO2_DP1, keep=2).latest()
    assert (
        "the universal checkpoint step00000002.universal lacks zero/w/exp_avg.pt: converting step00000002 again"
        in caplog.text
    )
    assert not copy.exists() and "reusing" not in caplog.text


def test_a_zero3_universal_copy_gets_what_the_zero12_loader_reads(tmp_path: Path) -> None:
    """ds_to_universal from ZeRO-3 writes the Adam step into the global optimizer state and no
    `ds_version`; the ZeRO 1-2 loader reads the step per parameter and asserts the version. The
    global state, memory-mapped and holding the fp32 weights, is rewritten through a new file."""
    import torch

    zero = tmp_path / "zero"
    (zero / "lm_head.weight").mkdir(parents=True)
    torch.save({"param": torch.ones(3)}, zero / "lm_head.weight" / "fp32.pt")
    step = torch.tensor(6.0)
    torch.save({"optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": [{"lr": 1.0}]},
                "param_groups": [{"lr": 1.0}], "fp32_flat_groups": [torch.arange(4096.0)]},
               zero / "optimizer_state.pt")  # fmt: skip
    reshard._optimizer_state_for_every_stage(zero)
    state = torch.load(zero / "optimizer_state.pt", weights_only=False)
    assert state["ds_version"] and torch.equal(state["fp32_flat_groups"][0], torch.arange(4096.0))
    assert torch.equal(torch.load(zero / "lm_head.weight" / "step.pt"), step)
    assert sorted(p.name for p in zero.iterdir()) == ["lm_head.weight", "optimizer_state.pt"]


def test_a_save_clears_what_a_killed_save_of_its_step_left(tmp_path: Path) -> None:
    """A run killed while saving step 4 under one layout leaves a partial tag folder; the rerun,
    under another layout, saves step 4 again: only its own files may be there (a leftover ZeRO-3
    file beside tp=2 files broke the next conversion in the Snakemake drill)."""
    ckpt = saved(tmp_path, [2], ZERO2)
    stray = ckpt.folder / "step00000004" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    stray.parent.mkdir()
    stray.write_bytes(b"half a file")
    (ckpt.folder / "step00000004.universal").mkdir()
    shrunk = Checkpoints(tmp_path, {"seed": 1}, ZERO2_DP1, keep=2)
    shrunk.save(FakeEngine(ZERO2_DP1), 4, {"step": 4})
    assert not stray.exists() and not (ckpt.folder / "step00000004.universal").exists()
    assert shrunk.latest()["tag"] == "step00000004"
