"""The GRPO stage run for real on two CPU ranks: through the DeepSpeed engine, flat and tree, resumable."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from harness.compare import LOSS_RTOL, PARAM_ATOL
from harness.contracts import mismatches
from harness.processes import second_run_while_first_holds
from harness.training import (
    SCORING_FAMILIES,
    assert_learning_signal,
    final_params,
    launch_grpo,
    metric_records,
    run_grpo,
)
from harness.training import grpo_config as harness_grpo_config
from safetensors.torch import load_file

from stagetrain.config.settings import ConsolidateSettings
from stagetrain.consolidate.folder import consolidate
from stagetrain.consolidate.manifest import Manifest
from stagetrain.grpo.metrics import METRICS, GrpoRecord
from stagetrain.grpo.summary import GrpoSummary
from stagetrain.training.checkpoints import KILL_DURING_SAVE
from stagetrain.training.lock import LOCK_NAME

pytestmark = pytest.mark.slow
FAMILIES = set(SCORING_FAMILIES)


@pytest.fixture(scope="module")
def start(data: dict[str, str], scoring_start: str) -> tuple[dict[str, str], str]:
    """The shared data and a consolidated (fp32) model that scores on SCORING_FAMILIES."""
    return data, scoring_start


def grpo_config(**changes: Any) -> dict[str, Any]:
    """The harness's GRPO config on the families the start model scores on."""
    return harness_grpo_config(**{"curriculum": {"families": list(SCORING_FAMILIES)}, **changes})


def test_flat_grpo_trains_through_the_engine_with_a_reference(start: tuple, tmp_path: Path) -> None:
    """Without weight decay a run whose loss were zero would end where it started (AdamW's
    moments stay zero), so weights that moved are the loss's doing, not the decay's. Sampled
    from a nucleus (top_p 0.9) with the KL term on, so the trainer's scoring is held to the
    sampler's on the masked distribution, not only on the whole one."""
    data, model = start
    cfg = grpo_config(kl_coef=0.04, passes=2, top_p=0.9, optimizer={"weight_decay": 0.0})
    cfg["deepspeed"]["attention"] = "eager"  # the described machine's plan would say sdpa
    summary = run_grpo(data, model, tmp_path, world=2, layout={"dp": 2, "tp": 1, "zero_stage": 2},
                       cfg=cfg, generation_batch=4)  # fmt: skip
    assert summary["optimizer_steps"] == 6  # 3 steps x 2 passes, each through engine.step
    assert summary["attention"] == "eager"  # the plan's kernel, as the engine ran it
    records = metric_records(tmp_path)
    # the stage generates in the plan's batches: 4 sequences, one prompt's group, not a rank's 8
    assert all(r["rollout/largest_generate_call"] == 4 for r in records[1:])
    assert_learning_signal(tmp_path / "metrics.jsonl")
    assert all(set(r) <= set(METRICS) for r in records)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(0 <= r["train/sampler_logprob_gap_mean"] < 1e-4 for r in records[1:])  # fp32
    assert all("kl" in r and r["kl"] >= 0 for r in records[1:])
    longest = cfg["grpo"]["max_new_tokens"]  # a row is clipped only where the longest reached it
    assert all(r["completions/mean_length"] <= r["completions/max_length"] <= longest
               and (r["completions/clipped_ratio"] == 0 or r["completions/max_length"] == longest)
               for r in records[1:])  # fmt: skip
    assert all(set(r["reward/by_level"]) == {"1"} for r in records[1:])
    # The built-in families' verifiers score 0 or 1 against a success_at of 1: solved is reward.
    assert all(r["reward/solved"] == pytest.approx(r["reward/mean"]) for r in records[1:])
    assert summary["reward_max"] == max(r["reward/max"] for r in records[1:]) == 1.0
    # One term, the verifier at weight 1: its own mean and std are the reward's (TRL's rewards/<name>/...).
    assert all(r["rewards"] == {"verifier": {"mean": pytest.approx(r["reward/mean"]), "std": pytest.approx(r["reward/std"])}}
               for r in records[1:])  # fmt: skip
    assert all(r["curriculum/level"] == dict.fromkeys(FAMILIES, 1) for r in records[1:])
    assert all(
        set(rates) == FAMILIES and all(v is None or 0 <= v <= 1 for v in rates.values())
        for rates in (r["curriculum/success_rate"] for r in records[1:])
    )
    assert summary["accuracy"]["start"] is not None and summary["accuracy"]["end"] is not None
    initial = load_file(Path(model) / "model-00001-of-00001.safetensors")
    final = final_params(summary)
    moved = max((final[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-5  # the policy really changed
    assert {f: s["level"] for f, s in summary["curriculum"].items()} == dict.fromkeys(FAMILIES, 1)
    assert summary["levels"] == {str(s): dict.fromkeys(FAMILIES, 1) for s in (1, 2, 3)}
    assert not mismatches(summary, GrpoSummary)
    assert not [m for r in records for m in mismatches(r, GrpoRecord, f"step {r['step']}")]


def test_zero3_generation_gathering_per_token_makes_what_the_gathered_policy_makes(
    start: tuple, tmp_path: Path
) -> None:
    """Under ZeRO-3 on 2 ranks, every parameter partitioned: generation that gathers per token
    (the plan's fallback where the whole policy gathered does not fit) samples, scores and
    trains as gathering the whole policy once does, its ranks in lockstep through every generate
    call. A generation batch of 6 makes 3 held-out chunks, so one rank scores a spare chunk to
    keep step with the other."""
    data, model = start
    cfg, layout = (
        grpo_config(steps=2, eval_every=2, checkpoint_every=2),
        {"dp": 2, "tp": 1, "zero_stage": 3},
    )
    summaries = {g: run_grpo(data, model, tmp_path / g, world=2, layout=layout, cfg=cfg, generation_batch=6,
                             gather=g, partition_all=True) for g in ("whole", "per_token")}  # fmt: skip
    whole, per_token = metric_records(tmp_path / "whole"), metric_records(tmp_path / "per_token")
    assert_learning_signal(tmp_path / "whole" / "metrics.jsonl")
    # Two calls per rank and step (a prompt's group of 4 per call): observed on the partitions.
    assert [r["rollout/lockstep_generate_calls"] for r in whole[1:]] == [0, 0]
    assert [r["rollout/lockstep_generate_calls"] for r in per_token[1:]] == [2, 2]
    for a, b in zip(whole[1:], per_token[1:], strict=True):
        for key in (
            "reward/mean",
            "reward/std",
            "completions/mean_length",
            "rollout/generated_tokens",
        ):
            assert a[key] == b[key], key
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=LOSS_RTOL, abs=1e-9)
    assert summaries["per_token"]["accuracy"] == summaries["whole"]["accuracy"]


def test_tree_rollouts_share_prefixes_under_zero3(start: tuple, tmp_path: Path) -> None:
    data, model = start
    cfg = grpo_config(
        rollout="tree",
        steps=2,
        checkpoint_every=2,
        eval_every=2,
        tree={"branching": 2, "segment_tokens": 2, "uct_c": 1.0},
        curriculum={"families": ["counting"]},
    )
    summary = run_grpo(
        data, model, tmp_path, world=2, layout={"dp": 2, "tp": 1, "zero_stage": 3}, cfg=cfg
    )
    assert summary["optimizer_steps"] == 2
    # Comparison is in the corpus, not the curriculum: evaluated all the same, to show its cost.
    assert set(summary["accuracy"]["gain"]["by_family"]) == {"counting", "comparison"}
    assert summary["accuracy"]["gain"]["mean"]["families"] == ["counting"]
    records = metric_records(tmp_path)[1:]
    # The KL term's reference exists under ZeRO-3 too (partitioned like the policy): its
    # DeepSpeed engine's eval() returns None, which once left GRPO under ZeRO-3 without one.
    assert cfg["grpo"]["kl_coef"] > 0 and all(r.get("kl") is not None for r in records), records
    assert all(r["rollout/generated_tokens"] < r["rollout/flat_equivalent_tokens"] for r in records)
    assert all(
        r["tree/leaves"] >= 2 * 4 and r["tree/nodes"] >= r["tree/leaves"] for r in records
    )  # 2 prompts per rank x 4 leaves
    assert all(
        r["tree/tokens_per_leaf"] == pytest.approx(r["rollout/generated_tokens"] / r["tree/leaves"])
        for r in records
    )
    out = tmp_path / "model"
    manifest = consolidate(stage="grpo", summary_path=str(tmp_path / "summary.json"), tokenizer_dir=data["tokenizer"],
                           model_config_path=data["model_config"], meta_path=data["meta"], out=str(out),
                           cfg=ConsolidateSettings(dtype="bf16", max_shard_size="2GB", verify="loss"))  # fmt: skip
    assert manifest["stage"] == "grpo" and manifest["step"] == 2
    assert not mismatches(summary, GrpoSummary)  # tree rollouts and a gain report
    assert not mismatches(json.loads((out / "MANIFEST.json").read_text()), Manifest)


DRILL_LAYOUT = {"dp": 2, "tp": 1, "zero_stage": 1}
LONE_STEPS = 4


def lone_config() -> dict[str, Any]:
    """The drills' one config: a checkpoint every step, all of them kept (the 2 -> 1 drill resumes
    from step 2's), and a curriculum that moves within a few steps so that per-family state
    crosses every restart: from level 2 with a window of two, a family's first full window always
    moves it (a rate of 0 demotes, 0.5 or 1 promotes), whatever the tiny model gets right."""
    cfg = grpo_config(steps=LONE_STEPS, checkpoint_every=1, eval_every=LONE_STEPS,
                      keep_checkpoints=LONE_STEPS)  # fmt: skip
    curriculum = {
        "start_level": 2,
        "window": 2,
        "min_steps": 1,
        "promote_at": 0.5,
        "demote_below": 0.0,
    }
    cfg["grpo"]["curriculum"] = {**cfg["grpo"]["curriculum"], **curriculum}
    return cfg


@pytest.fixture(scope="module")
def lone(start: tuple, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted GRPO run, alone on its folder, that every drill's runs must end as (the
    killed, the two-at-once, the killed-while-saving, and the 2 -> 1 rank resume), with its
    debug prompt log the 2 -> 1 drill compares (beside metrics.jsonl, in its checkpoint folder)."""
    data, model = start
    out = tmp_path_factory.mktemp("lone-grpo")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("STAGETRAIN_WINDOW_LOG", "1")
        summary = run_grpo(data, model, out, world=2, layout=DRILL_LAYOUT, cfg=lone_config())
    assert_learning_signal(out / "metrics.jsonl")
    return summary


def _same_as(summary: dict[str, Any], lone: dict[str, Any]) -> None:
    assert summary["rewards"] == lone["rewards"] and summary["losses"] == lone["losses"]
    a, b = final_params(summary), final_params(lone)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_killed_grpo_resumes_to_the_same_result(
    start: tuple, lone: dict[str, Any], tmp_path: Path
) -> None:
    data, model = start
    proc = launch_grpo(
        data,
        model,
        tmp_path / "killed",
        world=2,
        layout=DRILL_LAYOUT,
        cfg=lone_config(),
        popen=True,
    )
    deadline = time.monotonic() + 300
    pointers = tmp_path / "killed" / "checkpoints"
    while time.monotonic() < deadline and not any(
        json.loads(p.read_text())["step"] >= 2 for p in pointers.glob("*/latest.json")
    ):
        time.sleep(0.2)
    for pid in [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    resumed = run_grpo(
        data, model, tmp_path / "killed", world=2, layout=DRILL_LAYOUT, cfg=lone_config()
    )
    assert 2 <= resumed["resumed_from_step"] < LONE_STEPS
    _same_as(resumed, lone)
    assert resumed["curriculum"] == lone["curriculum"]
    assert resumed["levels"] == lone["levels"]
    records = metric_records(Path(lone["checkpoint"]["folder"]))
    events = [e for r in records for e in r.get("curriculum/events", [])]
    assert events and all(e["family"] in FAMILIES for e in events)
    assert events == sorted(
        (e for s in lone["curriculum"].values() for e in s["events"]),
        key=lambda e: (e["step"], e["family"]),
    )


def test_grpo_on_two_ranks_resumes_on_one(
    start: tuple, lone: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GRPO drill, 2 ranks ZeRO-1 -> 1 rank: the step-2 checkpoint is converted and loaded, the
    curriculum state carries over, the prompt stream goes on where the uninterrupted run's did,
    each prompt samples the completions it sampled there (per-prompt streams), and the loss,
    normalised over the global batch, and the weights follow the uninterrupted run's."""
    from harness.checkpoints import killed_after_step_2

    monkeypatch.setenv("STAGETRAIN_WINDOW_LOG", "1")
    data, model = start
    straight, shrunk = lone, tmp_path / "shrunk"
    proc = launch_grpo(data, model, shrunk, world=1, layout={**DRILL_LAYOUT, "dp": 1}, cfg=lone_config(),
                       checkpoints=killed_after_step_2(straight, shrunk))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (
        "2 ranks (dp=2 tp=1) ZeRO-1 -> 1 rank (dp=1 tp=1) ZeRO-1: converted step 2"
        in proc.stdout + proc.stderr
    )
    resumed = json.loads((shrunk / "summary.json").read_text())
    assert resumed["resumed_from_step"] == 2 and resumed["optimizer_steps"] == LONE_STEPS
    assert resumed["levels"]["3"] == straight["levels"]["3"]  # drawn from the restored curriculum
    ages = {f: s["steps_at_level"] for f, s in resumed["curriculum"].items()}
    assert ages == {f: s["steps_at_level"] for f, s in straight["curriculum"].items()}

    def prompts(summary: dict[str, Any]) -> list[list[str]]:
        path = Path(summary["checkpoint"]["folder"]) / "prompts.jsonl"
        return [json.loads(line)["prompts"] for line in path.read_text().splitlines()]

    got, want = prompts(resumed), prompts(straight)
    assert len(got) == LONE_STEPS and len(want[2]) == 4
    assert got == want  # steps 3-4 drawn at dp=1 are the steps the 2 ranks drew
    assert_learning_signal(shrunk / "metrics.jsonl")
    assert resumed["rewards"] == straight["rewards"]  # the same completions, so the same rewards
    assert resumed["losses"] == pytest.approx(straight["losses"], rel=LOSS_RTOL, abs=1e-7)
    a, b = final_params(resumed), final_params(straight)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < PARAM_ATOL


def test_evaluation_script_reports_accuracy_per_family_and_level(
    start: tuple, capsys: pytest.CaptureFixture[str]
) -> None:
    from stagetrain.evaluate.accuracy import accuracy, main

    _, model = start
    results = accuracy(model, ["comparison", "counting"], [1, 2], 4, seed=1)
    assert set(results) == {("comparison", 1), ("comparison", 2), ("counting", 1), ("counting", 2)}
    assert all(
        0.0 <= acc <= 1.0 and n == 4 and 1 <= distinct <= 4 for acc, n, distinct in results.values()
    )
    main([model, "--families", "counting", "--levels", "1", "--problems", "4"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("family") and lines[1].split()[:2] == ["counting", "1"]


def test_two_grpo_runs_at_once_one_trains_the_other_fails_in_one_line(
    start: tuple, lone: dict[str, Any], tmp_path: Path
) -> None:
    """The GRPO stage locks its checkpoint root through the same `Checkpoints.hold` as pretrain.
    The first run's ranks are stopped (SIGSTOP) while its rank 0 holds the lock, so the second
    certainly starts mid-run; then the first goes on and ends as the lone run did."""
    data, model = start

    def launch() -> subprocess.CompletedProcess[str]:
        return launch_grpo(data, model, tmp_path, world=2, layout=DRILL_LAYOUT, cfg=lone_config())

    winner, loser, ranks = second_run_while_first_holds(
        launch, tmp_path / "checkpoints" / LOCK_NAME
    )
    assert len(ranks) == 2 and winner.returncode == 0, winner.stderr[-3000:]
    assert loser.returncode != 0
    errors = {line for line in loser.stderr.splitlines() if line.startswith("error: ")}
    holder = json.loads((tmp_path / "checkpoints" / LOCK_NAME).read_text())
    assert errors == {
        f"error: {tmp_path / 'checkpoints'}: another run of this stage is writing here (pid {holder['pid']} "
        f"on host {holder['host']} since {holder['since']}); wait for it to end or stop it, then rerun"
    }
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from_step"] == 0
    assert [r["step"] for r in metric_records(tmp_path)] == list(range(LONE_STEPS + 1))
    _same_as(summary, lone)


def test_a_grpo_rank_killed_while_saving_resumes_from_the_previous_checkpoint(
    start: tuple, lone: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, model = start
    cfg = lone_config()
    monkeypatch.setenv(KILL_DURING_SAVE, "1:2")  # rank 1, in its save at step 2
    killed = launch_grpo(data, model, tmp_path, world=2, layout=DRILL_LAYOUT, cfg=cfg)
    assert killed.returncode != 0
    (pointer,) = (tmp_path / "checkpoints").glob("*/latest.json")
    assert (pointer.parent / "step00000002").exists()  # rank 1 died in the middle of writing it
    assert json.loads(pointer.read_text())["tag"] == "step00000001"
    monkeypatch.delenv(KILL_DURING_SAVE)
    resumed = run_grpo(data, model, tmp_path, world=2, layout=DRILL_LAYOUT, cfg=cfg)
    assert resumed["resumed_from_step"] == 1
    assert_learning_signal(tmp_path / "metrics.jsonl")
    _same_as(resumed, lone)
