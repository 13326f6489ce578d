"""The pipeline on Slurm: the profiles' resource requests, and a failing job on a one-node Slurm.

The submission test needs the Slurm that .ci/slurm.sh starts (`.ci/run` does);
where it cannot start (no root, no apt-get) it is skipped with its reason. The
pipeline itself runs on two nodes, in tests/test_multinode.py.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.configs import edit_config, small_run
from harness.workflow import REPO, snakemake

pytestmark = pytest.mark.slow


def resources(out: str, rule: str) -> dict[str, str]:
    """The resources a dry run prints for the first job of `rule`."""
    block = re.split(rf"\n(?:rule|checkpoint) {rule}:", out, maxsplit=1)[1].split("\n\n", 1)[0]
    line = re.search(r"resources: (.*)", block).group(1)
    return dict(item.split("=", 1) for item in line.split(", "))


def test_both_profiles_request_what_a_two_node_plan_needs(workdir: Path) -> None:
    edit_config(workdir, "hardware", nodes=2)  # 2 nodes x 2 CPU ranks on this machine's kind
    fresh = snakemake(workdir, "-n", "--workflow-profile", "profiles/slurm", "pretrain").stdout
    detect = resources(fresh, "detect_hardware")
    assert (detect["slurm_partition"], detect["slurm_extra"]) == ("gpu", "--exclusive")
    assert resources(fresh, "pretrain")["nodes"] == "<TBD>"  # no plan yet: known before submission

    snakemake(workdir, "results/tiny/plan.json")
    plan = json.loads((workdir / "results/tiny/plan.json").read_text())
    assert (plan["nodes"], plan["ranks_per_node"]) == (2, 2)
    for profile, partition in (("slurm", "gpu"), ("slurm-local", "debug")):
        out = snakemake(workdir, "-n", "--workflow-profile", f"profiles/{profile}", "all").stdout
        train = resources(out, "pretrain")
        assert train["slurm_partition"] == partition
        assert (train["nodes"], train["tasks_per_node"], train["cpus_per_task"], train["mpi"]) == (
            "2", "2", "1", "srun",
        )  # fmt: skip
        assert "tasks" not in train and "gres" not in train  # CPU ranks: no GPUs asked for
        assert int(train["mem_mb"]) >= 2 * 4096
        assert resources(out, "grpo")["nodes"] == "2"
        consolidate = resources(out, "consolidate")
        assert int(consolidate["mem_mb"]) >= 4096 and "gres" not in consolidate


def test_a_two_node_gpu_plan_asks_for_eight_gpus_a_node_a_runtime_and_one_to_verify(
    workdir: Path,
) -> None:
    edit_config(workdir, "hardware", source="describe", gpu="H100", gpus_per_node=8, nodes=2)
    snakemake(workdir, "results/tiny/plan.json")
    out = snakemake(workdir, "-n", "--workflow-profile", "profiles/slurm", "all").stdout
    train = resources(out, "pretrain")
    assert (train["nodes"], train["tasks_per_node"], train["gres"], train["tasks_per_gpu"]) == (
        "2", "8", "gpu:8", "0",
    )  # fmt: skip
    consolidate = resources(out, "consolidate")  # its loss check runs on one of the GPUs
    assert (consolidate["gres"], consolidate["tasks_per_gpu"]) == ("gpu:1", "0")
    assert train["cpus_per_task"] == "-1"  # described hardware: its cores are unknown
    assert int(train["runtime"]) >= 30  # from the plan's predicted step time


@pytest.fixture(scope="module")
def slurm() -> Iterator[None]:
    """A running one-node Slurm: the one .ci/run started, else one started (and stopped) here."""
    script = ["bash", str(REPO / ".ci" / "slurm.sh")]
    if subprocess.run([*script, "status"], capture_output=True).returncode == 0:
        yield
        return
    proc = subprocess.run([*script, "start"], capture_output=True, text=True, timeout=900)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip() or proc.stderr.strip())
    assert proc.returncode == 0, f".ci/slurm.sh start failed:\n{proc.stdout}\n{proc.stderr}"
    yield
    subprocess.run([*script, "stop"], capture_output=True, timeout=120)


def test_a_failing_job_names_its_slurm_log(workdir: Path, slurm: None) -> None:
    small_run(workdir)
    # A corpus file that exists (a missing one is refused before any job, at DAG time)
    # but is not UTF-8: the tokenizer stage's job fails with its one line.
    (workdir / "corpus").mkdir()
    (workdir / "corpus" / "bad.txt").write_bytes(b"plain text, then \xff\xfe not UTF-8\n")
    edit_config(workdir, "data", files=[{"path": "corpus/bad.txt"}])
    proc = snakemake(workdir, "--workflow-profile", "profiles/slurm-local", "pretrain", check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    slurm_log = re.search(r"results/slurm_logs/rule_prepare_tokenizer/\d+\.log", out)
    assert slurm_log, out[-3000:]
    assert (workdir / slurm_log.group(0)).exists()
    assert "corpus/bad.txt" in out and "not UTF-8" in out
