"""The workflow run by the real Snakemake: the DAG of each target, reruns, errors at the edge."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness.configs import edit_config, small_run
from harness.workflow import kill_after_checkpoint, snakemake

from stagetrain.pretrain.metrics import METRICS
from stagetrain.training.integrity import load_file

pytestmark = pytest.mark.slow
PLAN_JOBS = {
    "detect_hardware",
    "plan_parallelism",
    "plan_part[pretrain]",
    "plan_part[grpo]",
    "render_deepspeed_config[pretrain]",
    "render_deepspeed_config[grpo]",
}
# Before detection (a fresh run's DAG) every job hangs on detect_hardware, the checkpoint after
# which Snakemake builds them again (common.smk: after_detection); the stages depend on the plan
# parts they read, never on plan.json.
EDGES = {
    ("detect_hardware", "plan_parallelism"),
    *(("detect_hardware", f"plan_part[{part}]") for part in ("vocab", "pretrain", "grpo")),
    *(("detect_hardware", job) for job in ("prepare_tokenizer", "render_deepspeed_config[pretrain]",
                                          "render_deepspeed_config[grpo]", "pretrain", "consolidate[pretrain]",
                                          "grpo", "consolidate[grpo]")),
    ("plan_part[vocab]", "prepare_tokenizer"),
    *((f"plan_part[{stage}]", job) for stage in ("pretrain", "grpo")
      for job in (f"render_deepspeed_config[{stage}]", stage, f"consolidate[{stage}]")),
    ("render_deepspeed_config[pretrain]", "pretrain"),
    ("prepare_tokenizer", "pretrain"),
    ("pretrain", "consolidate[pretrain]"),
    ("prepare_tokenizer", "consolidate[pretrain]"),
    ("consolidate[pretrain]", "grpo"),
    ("render_deepspeed_config[grpo]", "grpo"),
    ("prepare_tokenizer", "grpo"),
    ("grpo", "consolidate[grpo]"),
    ("prepare_tokenizer", "consolidate[grpo]"),
}  # fmt: skip


def dag(workdir: Path, target: str) -> tuple[set[str], set[tuple[str, str]]]:
    """Jobs and dependency edges Snakemake would run for `target` (from --dag), named rule[stage]."""
    out = snakemake(workdir, "--dag", "dot", "--", target).stdout
    names = {}
    for node, label in re.findall(r'^\s*(\d+)\[label = "([^"]+)"', out, flags=re.M):
        rule, _, wildcard = label.partition("\\n")
        names[node] = f"{rule}[{wildcard.split(': ')[1]}]" if wildcard else rule
    edges = {(names[a], names[b]) for a, b in re.findall(r"^\s*(\d+) -> (\d+)", out, flags=re.M)}
    return set(names.values()), edges


def scheduled(workdir: Path, target: str, *extra: str) -> dict[str, str]:
    """Jobs a dry run schedules for `target`, each with Snakemake's reason."""
    out = snakemake(workdir, "-n", *extra, "--", target).stdout
    jobs = {}
    for block in re.split(r"\n(?:rule|checkpoint) ", out)[1:]:
        rule = block.split(":", 1)[0].strip()
        stage = re.search(r"wildcards: (?:stage|part)=(\w+)", block)
        reason = re.search(r"reason: (.*)", block)
        jobs[f"{rule}[{stage.group(1)}]" if stage else rule] = reason.group(1) if reason else ""
    return jobs


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("plan", PLAN_JOBS | {"plan"}),
        ("pretrain", {"detect_hardware", "plan_part[vocab]", "plan_part[pretrain]", "prepare_tokenizer",
                      "render_deepspeed_config[pretrain]", "pretrain"}),
        ("grpo", PLAN_JOBS - {"plan_parallelism"} | {"plan_part[vocab]", "prepare_tokenizer", "pretrain",
                                                     "consolidate[pretrain]", "grpo"}),
        ("all", PLAN_JOBS | {"plan_part[vocab]", "prepare_tokenizer", "pretrain", "consolidate[pretrain]", "grpo",
                             "consolidate[grpo]", "all"}),
    ],
)  # fmt: skip
def test_each_target_has_the_right_jobs_in_the_right_order(
    workdir: Path, target: str, expected: set[str]
) -> None:
    jobs, edges = dag(workdir, target)
    assert jobs == expected
    targets = {"plan", "all"}
    assert {e for e in edges if e[1] not in targets} == {e for e in EDGES if {*e} <= jobs}
    assert set(scheduled(workdir, target)) == expected


def test_plan_runs_then_nothing_to_do_and_edits_rerun_only_what_follows(
    finished_copy: Path,
) -> None:
    """On a copy of the finished small run, whose `all` ran the planning jobs first."""
    workdir = finished_copy
    snakemake(workdir, "plan")
    run = workdir / "results" / "tiny"
    plan = json.loads((run / "plan.json").read_text())
    hardware = json.loads((run / "hardware.json").read_text())
    assert hardware["source"] in ("nvml", "proc", "cpu")
    assert plan["world"] == plan["ranks_per_node"] * plan["nodes"]
    for stage in ("pretrain", "grpo"):
        ds = json.loads((run / "deepspeed" / f"{stage}.json").read_text())
        assert ds["train_batch_size"] == plan["stages"][stage]["layout"]["global_batch"]
    for rule in ("detect_hardware", "plan_parallelism", "render_deepspeed_config_pretrain"):
        assert (run / "logs" / f"{rule}.log").stat().st_size > 0
        assert (run / "benchmarks" / f"{rule}.tsv").exists()

    assert "Nothing to be done" in snakemake(workdir, "-n", "plan").stdout

    edit_config(workdir, "grpo", optimizer={"lr": 2e-5})
    assert set(scheduled(workdir, "plan")) == {"render_deepspeed_config[grpo]", "plan"}
    after_grpo_edit = scheduled(workdir, "all")
    assert "detect_hardware" not in after_grpo_edit and "plan_parallelism" not in after_grpo_edit
    assert "render_deepspeed_config[pretrain]" not in after_grpo_edit
    snakemake(workdir, "plan")

    edit_config(workdir, "parallelism", zero_stage=2)
    assert set(scheduled(workdir, "plan")) == PLAN_JOBS - {"detect_hardware"} | {"plan"}
    snakemake(workdir, "plan")
    assert (
        json.loads((run / "deepspeed" / "grpo.json").read_text())["zero_optimization"]["stage"] == 2
    )

    edit_config(workdir, "hardware", cpu_ranks=1)
    assert set(scheduled(workdir, "plan")) == PLAN_JOBS | {"plan"}


def test_tokenizer_stage_runs_and_data_edits_rerun_it_but_grpo_edits_do_not(
    finished_copy: Path,
) -> None:
    """On a copy of the finished small run: a smaller corpus reruns the tokenizer stage alone."""
    workdir = finished_copy
    edit_config(workdir, "data", train_tokens=20_000, val_tokens=2_000)
    edit_config(workdir, "tokenizer", training_sample_mb=0.2)
    snakemake(workdir, "prepare_tokenizer")
    meta = json.loads((workdir / "results/tiny/data/meta.json").read_text())
    assert meta["train"]["tokens"] >= 20_000

    edit_config(workdir, "grpo", steps=60, optimizer={"lr": 2e-5})
    after_grpo = scheduled(workdir, "all")
    assert "prepare_tokenizer" not in after_grpo and "plan_parallelism" not in after_grpo
    assert "render_deepspeed_config[grpo]" in after_grpo

    edit_config(workdir, "data", generated={"prose_share": 0.5})
    after_data = scheduled(workdir, "all")
    assert "Params have changed" in after_data["prepare_tokenizer"]
    assert {"pretrain", "consolidate[pretrain]", "grpo", "consolidate[grpo]"} <= set(after_data)
    assert "plan_parallelism" not in after_data and "detect_hardware" not in after_data


def test_the_whole_pipeline_runs_and_reports(finished_small_run: Path) -> None:
    """`snakemake all` on a shrunk default config: every stage, both consolidations. The report
    of this run is built and checked by the README's own command (test_commands.py)."""
    workdir = finished_small_run
    run = workdir / "results/tiny"
    records = [
        json.loads(line) for line in (run / "pretrain/metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(set(r) <= set(METRICS) for r in records)
    for png in ("pretrain/loss.png", "grpo/reward.png"):
        assert (run / png).read_bytes()[:4] == b"\x89PNG"
    for stage in ("pretrain", "grpo"):  # `tensorboard --logdir results/tiny/tensorboard`
        assert list((run / "tensorboard" / stage).glob("events.out.tfevents.*")), stage
    for stage, step in (("pretrain", 4), ("grpo", 2)):
        manifest = json.loads((run / f"model/{stage}/MANIFEST.json").read_text())
        assert (manifest["stage"], manifest["step"], manifest["dtype"]) == (stage, step, "bf16")
        assert "verified: validation loss" in (run / f"logs/consolidate_{stage}.log").read_text()
    grpo = json.loads((run / "grpo/summary.json").read_text())
    assert grpo["optimizer_steps"] == 2 and grpo["accuracy"]["end"] is not None


def _final_weights(workdir: Path) -> dict[str, torch.Tensor]:
    summary = json.loads((workdir / "results/tiny/pretrain/summary.json").read_text())
    folder = Path(summary["checkpoint"]["folder"]) / summary["checkpoint"]["tag"]
    return load_file(folder / "mp_rank_00_model_states.pt")["module"]


def test_killed_training_resumes_to_the_same_result(finished_copy: Path) -> None:
    """SIGKILL mid-training, then --rerun-incomplete: same losses and bitwise-same weights as a straight run.

    Both run in one copy of the finished small run, at 12 steps instead of 4 (the plan and the
    pretrain stage rerun; the hardware and the tokenizer stay): first straight, then, with no
    checkpoint left, again and killed. The precision is fixed: under `auto` the re-detection at
    the end measures again, and on a loaded machine may choose another precision (another
    fingerprint, a fresh start) instead of resuming it."""
    workdir = finished_copy
    checkpoints = workdir / "results/tiny/checkpoints/pretrain"
    shutil.rmtree(checkpoints)
    small_run(workdir)
    edit_config(workdir, "deepspeed", precision="fp32")
    snakemake(workdir, "pretrain")
    reference = json.loads((workdir / "results/tiny/pretrain/summary.json").read_text())
    b = _final_weights(workdir)
    shutil.rmtree(checkpoints)

    kill_after_checkpoint(workdir, "pretrain", 4, "--forcerun", "pretrain", "--", "pretrain")
    assert not (workdir / "results/tiny/pretrain/summary.json").exists()
    snakemake(workdir, "--unlock")
    snakemake(workdir, "--rerun-incomplete", "pretrain")

    resumed = json.loads((workdir / "results/tiny/pretrain/summary.json").read_text())
    assert 4 <= resumed["resumed_from_step"] < 12  # killed mid-run, after a checkpoint
    assert (
        resumed["losses"] == reference["losses"]
        and resumed["final_eval_loss"] == reference["final_eval_loss"]
    )
    a = _final_weights(workdir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [
        json.loads(line)["step"]
        for line in (workdir / "results/tiny/pretrain/metrics.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(1, 13))

    edit_config(workdir, "pretrain", optimizer={"lr": 1e-3})
    snakemake(workdir, "pretrain")
    log = (workdir / "results/tiny/logs/pretrain.log").read_text()
    assert (
        f"config changed since checkpoint {reference['fingerprint']} (training): starting fresh"
        in log
    )

    edit_config(workdir, "hardware", cpu_ranks=1)  # the ZeRO-0 checkpoint holds the whole state
    snakemake(workdir, "pretrain")
    log = (workdir / "results/tiny/logs/pretrain.log").read_text()
    assert (
        "2 ranks (dp=2 tp=1) ZeRO-0 -> 1 rank (dp=1 tp=1) ZeRO-0: the ZeRO-0 checkpoint at step 12"
        in log
    )


def test_bad_config_is_one_line_and_writes_nothing(workdir: Path) -> None:
    edit_config(workdir, "pretrain", steps=0)
    proc = snakemake(workdir, "plan", check=False)
    assert proc.returncode == 1
    assert "error: config: pretrain.steps: expected a value >= 1, got 0" in proc.stderr.splitlines()
    assert not (workdir / "results").exists()


def test_keys_that_disagree_fail_the_dry_run_and_a_stage_run_alone_in_one_line(
    workdir: Path,
) -> None:
    """The checks across keys (workflow.checks) run where no schema can: at the workflow's door
    before any rule, so `snakemake -n` refuses with one line and writes nothing, and in a stage
    script run on its own with the same config file, which refuses before it reads an input."""
    edit_config(workdir, "grpo", replay={"families": ["comparison"], "share": 0.1})
    line = ("error: config: grpo.replay.families: 'comparison' is in grpo.curriculum.families; "
            "replay is for the others")  # fmt: skip
    proc = snakemake(workdir, "-n", check=False)
    assert proc.returncode == 1 and line in proc.stderr.splitlines(), proc.stderr[-2000:]
    assert not (workdir / "results").exists()
    config = workdir / "config/config.yaml"
    script = [sys.executable, "scripts/plan_parallelism.py", "--config", str(config)]
    alone = subprocess.run([*script, "--hardware", "h.json", "--plan", "p.json"], cwd=workdir,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert alone.returncode != 0
    assert alone.stderr.strip().splitlines()[-1] == line.replace("config:", f"{config}:"), (
        alone.stderr[-2000:]
    )


def test_a_stage_error_surfaces_its_line_and_leaves_no_artifact(workdir: Path) -> None:
    """The planner's refusal fails the jobs that would write the plan (the first to run stops the
    run), each with the line in its log; none writes a file."""
    edit_config(workdir, "parallelism", dp=3)
    proc = snakemake(workdir, "plan", check=False)
    assert proc.returncode != 0
    logs = [*(workdir / "results/tiny/logs").glob("plan_*.log")]
    assert logs
    for path in logs:
        line = path.read_text().strip().splitlines()[-1]
        assert line.startswith(
            "error: parallelism.dp: dp * tp must equal the world size (dp=3, tp=None, world=2"
        )
        assert (
            line in proc.stdout + proc.stderr
        )  # shown by --show-failed-logs from the default profile
    assert not (workdir / "results/tiny/plan.json").exists()
    assert not [*(workdir / "results/tiny").glob("plan/*.json")]


def test_two_run_names_do_not_clobber(finished_copy: Path) -> None:
    """The first run is the finished small run, planned for two ranks."""
    workdir = finished_copy
    snakemake(workdir, "plan")
    edit_config(workdir, "run", name="second")
    edit_config(workdir, "hardware", cpu_ranks=1)
    snakemake(workdir, "plan")
    first = json.loads((workdir / "results/tiny/plan.json").read_text())
    second = json.loads((workdir / "results/second/plan.json").read_text())
    assert (first["world"], second["world"]) == (2, 1)


def test_stage_script_runs_on_its_own_and_validates_the_whole_config(
    workdir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "hardware.json"
    cmd = [
        sys.executable,
        "scripts/detect_hardware.py",
        "--config",
        "config/config.yaml",
        "--hardware",
        str(out),
    ]
    subprocess.run(cmd, cwd=workdir, check=True, capture_output=True)
    assert json.loads(out.read_text())["nodes"] == 1

    plan = tmp_path / "plan.json"
    plan_cmd = [sys.executable, "scripts/plan_parallelism.py", "--config", "config/config.yaml",
                "--hardware", str(out), "--plan", str(plan)]  # fmt: skip
    subprocess.run(plan_cmd, cwd=workdir, check=True, capture_output=True)
    part_cmd = [sys.executable, "scripts/plan_part.py", "--config", "config/config.yaml", "--plan", str(plan),
                "--part", str(tmp_path / "grpo_part" / "grpo.json")]  # fmt: skip
    subprocess.run(part_cmd, cwd=workdir, check=True, capture_output=True)
    render_cmd = [sys.executable, "scripts/render_deepspeed_config.py", "--config", "config/config.yaml",
                  "--stage", "grpo", "--plan", str(tmp_path / "grpo_part" / "grpo.json"), "--deepspeed-config", str(tmp_path / "grpo.json")]  # fmt: skip
    subprocess.run(render_cmd, cwd=workdir, check=True, capture_output=True)
    assert json.loads((tmp_path / "grpo.json").read_text())["train_batch_size"] == 128

    edit_config(workdir, "model", num_kv_heads=3)
    plan.unlink()
    proc = subprocess.run(plan_cmd, cwd=workdir, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: model.num_kv_heads: 3 must divide model.num_heads 4"
    assert not plan.exists()
