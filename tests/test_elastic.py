"""Elastic resume at the runtime level: a checkpoint of one layout resumed under another.

Each drill starts from the state a SIGKILL of the whole run after step 2's
checkpoint leaves on disk: the uninterrupted run's checkpoint folder with the
pointer at step 2 and step 4 never written (its tag folder gone, the logs
beyond step 2 still there, as a killed run leaves them). The resumed run, under
another layout and the same global batch, must then match the uninterrupted
run: losses of steps 3-4 to 1e-4 relative, final fp32 weights to 1e-4 absolute
(the tolerances of test_pretrain_dist.py), and the windows it read (the
STAGETRAIN_WINDOW_LOG debug log) must be the uninterrupted run's, each once.
One uninterrupted run per source layout is shared by the drills that start from it.
The drill through Snakemake (SIGKILL of the real 2-rank ZeRO-2 run, `--rerun-incomplete`
with `hardware.cpu_ranks: 1`) is the last test here; test_workflow.py's killed-run test
ends with a ZeRO-0 checkpoint resumed on one rank as it is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from harness.checkpoints import killed_after_step_2
from harness.compare import LOSS_RTOL, PARAM_ATOL
from harness.training import final_params, launch, run

from stagetrain.consolidate.stored import Reader
from stagetrain.consolidate.weights import read_weights

pytestmark = pytest.mark.slow
CHANGES = {"pretrain": {"checkpoint_every": 2, "keep_checkpoints": 2}}
ZERO2_DP2 = {"dp": 2, "tp": 1, "micro_batch_size": 2, "zero_stage": 2}
ZERO1_TP2 = {"dp": 1, "tp": 2, "micro_batch_size": 4, "zero_stage": 1}
ZERO1_DP1 = {"dp": 1, "tp": 1, "micro_batch_size": 4, "zero_stage": 1}
ZERO0_DP2 = {"dp": 2, "tp": 1, "micro_batch_size": 2, "zero_stage": 0}


@pytest.fixture(autouse=True)
def _window_log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGETRAIN_WINDOW_LOG", "1")


def _uninterrupted(data: dict[str, str], out: Path, layout: dict[str, Any]) -> dict[str, Any]:
    world = layout["dp"] * layout["tp"]
    return run(data, out, world=world, layout=layout, config_changes=CHANGES)


@pytest.fixture(scope="module")
def zero2_dp2(data: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STAGETRAIN_WINDOW_LOG", "1")
        return _uninterrupted(data, tmp_path_factory.mktemp("z2dp2"), ZERO2_DP2)


def windows_of(folder: Path, steps: int) -> list[list[int]]:
    """The windows read per step (all dp ranks together) from a checkpoint folder's window log."""
    records = [json.loads(line) for line in (folder / "windows.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    return [sum(r["windows"], []) for r in records]


def windows(summary: dict[str, Any]) -> list[list[int]]:
    """`windows_of` the run's checkpoint folder (four steps)."""
    return windows_of(Path(summary["checkpoint"]["folder"]), 4)


def tp_params(
    summary: dict[str, Any], shapes: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """The final weights of a run, AutoTP slices joined by the consolidation's reader (zero_to_fp32
    reads no AutoTP checkpoint); `final_params` for other layouts."""
    if summary["layout"]["tp"] == 1:
        return final_params(summary)
    folder, tag = Path(summary["checkpoint"]["folder"]), summary["checkpoint"]["tag"]
    stored = read_weights(folder, tag, summary["layout"], shapes)
    with Reader() as reader:
        return {name: torch.cat([c.flatten().float() for c in reader.chunks(where)]).view(shapes[name])
                for name, where in stored.items()}  # fmt: skip


def drill(data: dict[str, str], baseline: dict[str, Any], out: Path, layout: dict[str, Any]) -> str:
    """Resume the baseline's step-2 checkpoint under `layout`; check it against the baseline; the log."""
    world = layout["dp"] * layout["tp"]
    proc = launch(data, out, world=world, layout=layout, config_changes=CHANGES,
                  checkpoints=killed_after_step_2(baseline, out))  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["resumed_from_step"] == 2 and resumed["layout"]["dp"] == layout["dp"]
    for step in ("3", "4"):
        assert resumed["losses"][step] == pytest.approx(baseline["losses"][step], rel=LOSS_RTOL)
    got, want = windows(resumed), windows(baseline)
    assert got == want  # the same global order, step by step
    flat = sum(got, [])
    assert len(flat) == len(set(flat))  # no window read twice
    a = final_params(resumed)
    b = tp_params(baseline, {k: tuple(v.shape) for k, v in a.items()})
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < PARAM_ATOL, worst
    return proc.stdout + proc.stderr


def test_two_ranks_zero2_resume_on_one_rank(
    data: dict[str, str], zero2_dp2: dict[str, Any], tmp_path: Path
) -> None:
    log = drill(data, zero2_dp2, tmp_path, {**ZERO1_DP1, "zero_stage": 2})
    assert "2 ranks (dp=2 tp=1) ZeRO-2 -> 1 rank (dp=1 tp=1) ZeRO-2: converted step 2" in log
    folder = tmp_path / "checkpoints" / zero2_dp2["fingerprint"]
    assert (folder / "step00000002.universal").is_dir()  # beside the original, kept with it
    assert sorted(p.name for p in folder.glob("step*")) == [
        "step00000002", "step00000002.universal", "step00000004"
    ]  # fmt: skip


def test_zero2_resumes_under_zero3(
    data: dict[str, str], zero2_dp2: dict[str, Any], tmp_path: Path
) -> None:
    log = drill(data, zero2_dp2, tmp_path, {**ZERO2_DP2, "zero_stage": 3})
    assert "ZeRO-2 -> 2 ranks (dp=2 tp=1) ZeRO-3: converted step 2" in log


def test_one_rank_resumes_on_two(data: dict[str, str], tmp_path: Path) -> None:
    baseline = _uninterrupted(data, tmp_path / "base", ZERO1_DP1)
    log = drill(data, baseline, tmp_path / "drill", {**ZERO2_DP2, "zero_stage": 1})
    assert "1 rank (dp=1 tp=1) ZeRO-1 -> 2 ranks (dp=2 tp=1) ZeRO-1: converted step 2" in log


def test_tensor_parallel_two_resumes_on_tp_one(data: dict[str, str], tmp_path: Path) -> None:
    baseline = _uninterrupted(data, tmp_path / "base", ZERO1_TP2)
    log = drill(data, baseline, tmp_path / "drill", ZERO1_DP1)
    assert "2 ranks (dp=1 tp=2) ZeRO-1 -> 1 rank (dp=1 tp=1) ZeRO-1: converted step 2" in log


def _fp32_model(workdir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file as load_safetensors

    folder = workdir / "results/tiny/model/pretrain"
    assert (
        "verified: validation loss"
        in (workdir / "results/tiny/logs/consolidate_pretrain.log").read_text()
    )
    return {
        k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_safetensors(f).items()
    }


def test_snakemake_run_killed_on_two_ranks_resumes_on_one(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drill through Snakemake: SIGKILL after step 4's checkpoint of a 2-rank ZeRO-2 run, then
    `--rerun-incomplete` with hardware.cpu_ranks: 1; the consolidated fp32 model of the resumed run
    verifies and matches the uninterrupted run's."""
    from harness.configs import edit_config, small_run
    from harness.workflow import copy_workflow, kill_after_checkpoint, snakemake

    straight = copy_workflow(tmp_path_factory.mktemp("straight") / "wf")
    small_run(straight, steps=8)
    edit_config(straight, "deepspeed", precision="fp32")
    edit_config(straight, "parallelism", zero_stage=2)
    edit_config(straight, "consolidate", dtype="fp32")
    snakemake(straight, "results/tiny/model/pretrain")
    drilled = tmp_path_factory.mktemp("drilled") / "wf"
    shutil.copytree(straight, drilled, symlinks=True)
    for done in ("pretrain", "checkpoints/pretrain", "model/pretrain"):  # the data is reused
        shutil.rmtree(drilled / "results/tiny" / done)
    kill_after_checkpoint(drilled, "pretrain", 4, "results/tiny/model/pretrain")
    assert not (drilled / "results/tiny/pretrain/summary.json").exists()
    snakemake(drilled, "--unlock")
    edit_config(drilled, "hardware", cpu_ranks=1)
    snakemake(drilled, "--rerun-incomplete", "results/tiny/model/pretrain")

    log = (drilled / "results/tiny/logs/pretrain.log").read_text()
    assert "2 ranks (dp=2 tp=1) ZeRO-2 -> 1 rank (dp=1 tp=1) ZeRO-2: converted step 4" in log
    resumed, reference = (
        json.loads((w / "results/tiny/pretrain/summary.json").read_text())
        for w in (drilled, straight)
    )
    assert 4 <= resumed["resumed_from_step"] < 8 and resumed["layout"]["dp"] == 1
    for step in range(resumed["resumed_from_step"] + 1, 9):
        assert resumed["losses"][str(step)] == pytest.approx(
            reference["losses"][str(step)], rel=LOSS_RTOL
        )
    got, want = (windows_of(Path(s["checkpoint"]["folder"]), 8) for s in (resumed, reference))
    assert got == want and len(sum(got, [])) == len(set(sum(got, [])))
    a, b = _fp32_model(drilled), _fp32_model(straight)
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < PARAM_ATOL
