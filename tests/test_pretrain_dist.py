"""Proofs that the ranks train one model: real torchrun runs of the pretrain entry point on CPU ranks.

Runs are in fp32 so that the comparisons can be tight. Tolerances: losses of
runs that only regroup the same global batch (ranks, micro batches, ZeRO stage)
agree to 1e-4 relative, parameters after four AdamW steps to 1e-4 absolute
(summation order differs; a wrong gradient or a skipped rank moves them by
1e-3 or more at lr 3e-3).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from harness.checkpoints import truncate
from harness.compare import losses, same_losses, same_params
from harness.contracts import mismatches
from harness.training import (
    SharedRun,
    SharedRuns,
    dp2,
    final_params,
    launch,
    model_config,
    run,
    small_config,
    torchrun,
    write_job,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def baseline(shared_runs: SharedRuns) -> dict[str, Any]:
    """Two data-parallel ranks, ZeRO 0, micro batch 2, accumulation 2 (the session's shared run)."""
    return shared_runs["zero0"]


def test_data_parallel_ranks_hold_identical_parameters(baseline: dict[str, Any]) -> None:
    first, second = baseline["param_checksum_per_rank"]
    assert first == second
    assert losses(baseline)[-1] < losses(baseline)[0]  # it learns
    assert not mismatches(baseline, SharedRun)  # summary.json holds what PretrainSummary says


def test_two_ranks_match_one_rank_with_the_same_global_batch(
    data: dict[str, str], baseline: dict[str, Any], tmp_path: Path
) -> None:
    single = run(
        data, tmp_path, world=1, layout={"dp": 1, "tp": 1, "micro_batch_size": 4, "zero_stage": 0}
    )
    assert single["layout"]["grad_accum"] == 2 and baseline["layout"]["grad_accum"] == 2
    same_losses(baseline, single)
    same_params(baseline, single)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_stages_agree(shared_runs: SharedRuns, baseline: dict[str, Any], zero: int) -> None:
    summary = shared_runs[f"zero{zero}"]
    same_losses(baseline, summary)
    same_params(baseline, summary)
    local, total = summary["local_param_elements_per_rank"], summary["param_elements"]
    if zero == 3:  # built inside zero.Init: no rank ever held the whole model
        assert all(abs(n / total - 0.5) < 0.02 for n in local), (local, total)
    else:
        assert local == [total, total]
        assert summary["param_checksum_per_rank"][0] == summary["param_checksum_per_rank"][1]


@pytest.mark.parametrize("tied", [True, False])
def test_tensor_parallel_matches_one_rank(
    data: dict[str, str], shared_runs: SharedRuns, tmp_path: Path, tied: bool
) -> None:
    """Tied: the shared data's model (tied, as the default config) and the session's shared tp=2 run."""
    config = data["model_config"] if tied else model_config(tmp_path, tie_word_embeddings=False)
    layout = {"dp": 1, "micro_batch_size": 4, "zero_stage": 1}
    single = run(data, tmp_path / "tp1", world=1, layout={**layout, "tp": 1}, model_config=config)
    tp2 = (
        shared_runs["tp2"]
        if tied
        else run(data, tmp_path / "tp2", world=2, layout={**layout, "tp": 2}, model_config=config)
    )
    assert tp2["layout"]["tp"] == 2
    same_losses(single, tp2)


def test_moe_trains_under_zero3(shared_runs: SharedRuns) -> None:
    summary = shared_runs["moe"]
    assert summary["experts"] and not mismatches(summary, SharedRun)
    got = losses(summary)
    assert all(torch.isfinite(torch.tensor(got))) and got[-1] < got[0]
    assert all(
        abs(n / summary["param_elements"] - 0.5) < 0.02
        for n in summary["local_param_elements_per_rank"]
    )


def test_a_world_that_differs_from_the_plan_fails_at_start(
    data: dict[str, str], tmp_path: Path
) -> None:
    spec = write_job(data, tmp_path, world=2, layout=dp2(0))
    plan = json.loads((tmp_path / "plan.json").read_text())
    plan["world"] = 4
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    proc = torchrun("stagetrain.pretrain.train", spec, 2)
    assert proc.returncode != 0
    assert "error: plan.json: world size 4, but 2 processes started" in proc.stderr


def test_activation_checkpointing_changes_memory_not_maths(
    data: dict[str, str], baseline: dict[str, Any], tmp_path: Path
) -> None:
    layout = {
        "dp": 2,
        "tp": 1,
        "micro_batch_size": 2,
        "zero_stage": 0,
        "activation_checkpointing": True,
    }
    summary = run(data, tmp_path, world=2, layout=layout)
    assert summary["layout"]["activation_checkpointing"] is True
    same_losses(baseline, summary)
    same_params(baseline, summary)


def test_init_from_loads_partitioned_and_grows_the_embeddings(
    data: dict[str, str], tmp_path: Path
) -> None:
    """A saved model with fewer embedding rows than model_config.json continues under ZeRO-3."""
    from transformers import AutoModelForCausalLM

    from stagetrain.model.config import SHAPE_KEYS
    from stagetrain.training.engine import load_model_config

    config = load_model_config(data["model_config"])
    config.vocab_size = 300
    start = AutoModelForCausalLM.from_config(config)
    start.save_pretrained(tmp_path / "init")
    summary = run(data, tmp_path / "run", world=2, layout={"dp": 2, "tp": 1, "micro_batch_size": 2, "zero_stage": 3},
                  config_changes={"model": {"init_from": str(tmp_path / "init"), **dict.fromkeys(SHAPE_KEYS)}})  # fmt: skip
    local, total = summary["local_param_elements_per_rank"], summary["param_elements"]
    assert all(abs(n / total - 0.5) < 0.02 for n in local), (local, total)
    assert total == sum(p.numel() for p in start.parameters())  # before the resize
    weights = final_params(summary)
    assert weights["model.embed_tokens.weight"].shape[0] == 512
    assert losses(summary)[-1] < losses(summary)[0]


@pytest.mark.parametrize(
    ("precision", "parameters"), [("fp32", "torch.float32"), ("bf16", "torch.bfloat16")]
)
def test_a_bf16_start_model_trains_in_the_plans_precision_with_fp32_master_weights(
    data: dict[str, str], tmp_path: Path, precision: str, parameters: str
) -> None:
    """A folder saved in bf16 (as consolidation writes it) is not trained in pure bf16 under an fp32 plan."""
    from transformers import AutoModelForCausalLM

    from stagetrain.model.config import SHAPE_KEYS
    from stagetrain.training.engine import load_model_config

    start = AutoModelForCausalLM.from_config(load_model_config(data["model_config"]))
    start.to(torch.bfloat16).save_pretrained(tmp_path / "init")
    summary = run(data, tmp_path / "run", world=1, layout={"dp": 1, "tp": 1, "micro_batch_size": 4, "zero_stage": 1},
                  config_changes={"model": {"init_from": str(tmp_path / "init"), **dict.fromkeys(SHAPE_KEYS)},
                                  "deepspeed": {"precision": precision}})  # fmt: skip
    assert summary["dtypes"] == {
        "parameters": parameters, "master": "torch.float32", "optimizer_states": "torch.float32"
    }  # fmt: skip


def _error_lines(proc: Any) -> set[str]:
    return {line for line in proc.stderr.splitlines() if line.startswith("error: ")}


def test_a_damaged_newest_checkpoint_falls_back_on_resume(
    data: dict[str, str], tmp_path: Path
) -> None:
    """Both ranks resume from the earlier complete checkpoint (DeepSpeed's loader under the
    weights-only unpickler) and reach the uninterrupted run's losses; a pointer of the wrong
    shape stops every rank with the same one line."""
    layout = {"dp": 2, "tp": 1, "micro_batch_size": 2, "zero_stage": 2}
    every2 = {"pretrain": {"checkpoint_every": 2}}
    first = run(data, tmp_path, world=2, layout=layout, config_changes=every2)
    folder = Path(first["checkpoint"]["folder"])
    truncate(folder / "step00000004" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    proc = launch(data, tmp_path, world=2, layout=layout, config_changes=every2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "checkpoint step00000004 is damaged" in proc.stdout + proc.stderr
    again = json.loads((tmp_path / "summary.json").read_text())
    assert again["resumed_from_step"] == 2 and again["losses"] == first["losses"]
    (folder / "latest.json").write_text("[]")
    proc = launch(data, tmp_path, world=2, layout=layout, config_changes=every2)
    assert proc.returncode != 0
    assert _error_lines(proc) == {
        f"error: {folder}/latest.json: expected an object with tag, step and layout, found a JSON list"
    }


def test_a_diverged_run_stops_with_one_line_before_saving(
    data: dict[str, str], tmp_path: Path
) -> None:
    optimizer = {**small_config()["pretrain"]["optimizer"], "lr": 1e30, "warmup_steps": 1}
    changes = {"optimizer": optimizer, "steps": 6, "eval_every": 6, "checkpoint_every": 5}
    proc = launch(data, tmp_path, world=2, layout={"dp": 2, "tp": 1, "micro_batch_size": 2, "zero_stage": 0},
                  config_changes={"pretrain": changes})  # fmt: skip
    assert proc.returncode != 0
    [line] = _error_lines(proc)
    assert re.fullmatch(r"error: pretrain: the training loss is nan at step 5 \(fp32\): the run diverged; lower pretrain.optimizer.lr .*", line), line  # fmt: skip
    assert not list((tmp_path / "checkpoints").glob("*/latest.json"))


@pytest.mark.parametrize(("source", "target"), [("zero0", 2), ("zero2", 0)])
def test_a_complete_stage_rerun_under_a_zero_change_no_format_carries_loads_its_weights_alone(
    shared_runs: SharedRuns, tmp_path: Path, source: str, target: int
) -> None:
    """A zero_stage set for GRPO reruns the finished pretraining; resuming needed the optimizer
    across ZeRO-0 and another stage, which no format carries, and it was refused. At its final
    step it trains nothing: the weights alone are loaded, the summary is the finished run's."""
    done = shared_runs[source]
    shutil.copytree(Path(done["checkpoint"]["folder"]).parent, tmp_path / "checkpoints")
    proc = launch(shared_runs.data, tmp_path, world=2, layout=dp2(target))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "is the stage's last, so only its weights are loaded" in proc.stdout + proc.stderr
    again = json.loads((tmp_path / "summary.json").read_text())
    assert again["resumed_from_step"] == again["final_step"] == done["final_step"]
    assert again["layout"] == done["layout"] and again["losses"] == done["losses"]
    assert again["final_eval_loss"] == pytest.approx(done["final_eval_loss"], rel=1e-6)
