"""Two hosts for real: training across the simulated hosts of .ci/hosts.sh, by torchrun and through Slurm.

node1 and node2 are network namespaces that reach each other only over a
private link, each with its own hostname; the two-node Slurm runs one slurmd in
each. Where the hosts cannot be made (no root, no Slurm to install) every test
here is skipped with hosts.sh's reason; `.ci/run` starts them on CI.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness.compare import same_losses, same_params
from harness.configs import edit_config, small_grpo, small_run
from harness.training import run, write_job
from harness.workflow import CLUSTER_SNAKEMAKE, REPO, snakemake

from stagetrain.training.launch import node_torchrun, rank_environment

pytestmark = [pytest.mark.slow, pytest.mark.multinode]
HOSTS_SH = ["bash", str(REPO / ".ci" / "hosts.sh")]
HOSTS = ("node1", "node2")
LINK = "eth0"
"""Each host's interface on the private link (the only one besides loopback)."""


@pytest.fixture(scope="module")
def hosts() -> Iterator[dict[str, str]]:
    """The simulated hosts and their Slurm: those .ci/run started, else started (and removed) here.

    Yields the environment that reaches this Slurm (SLURM_CONF) and makes gloo use the link.
    """
    env_line = subprocess.run([*HOSTS_SH, "env"], capture_output=True, text=True).stdout.strip()
    env = {**os.environ, **dict([env_line.split("=", 1)]), "GLOO_SOCKET_IFNAME": LINK}
    if subprocess.run([*HOSTS_SH, "status"], capture_output=True).returncode == 0:
        yield env
        return
    proc = subprocess.run([*HOSTS_SH, "start"], capture_output=True, text=True, timeout=900)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip() or proc.stderr.strip())
    assert proc.returncode == 0, f".ci/hosts.sh start failed:\n{proc.stdout}\n{proc.stderr}"
    try:
        yield env
    finally:
        subprocess.run([*HOSTS_SH, "stop"], capture_output=True, timeout=120)


def on_hosts(job: Path, *, per_node: int, env: dict[str, str], run_id: str) -> None:
    """The pretrain entry point as the launcher starts it on each node: one torchrun per host,
    c10d on node1, each host pinned to one of this machine's CPUs and its ranks sharing it."""
    cmd = node_torchrun(nodes=len(HOSTS), procs_per_node=per_node, first_host=HOSTS[0],
                        run_id=run_id, module="stagetrain.pretrain.train", args=["--spec", str(job)])  # fmt: skip
    cpus = sorted(os.sched_getaffinity(0))
    rank_env = rank_environment(env, cores=1, ranks_per_node=per_node)
    procs = [
        subprocess.Popen(
            [*HOSTS_SH, "exec", host, "taskset", "-c", str(cpus[i % len(cpus)]), *cmd],
            env=rank_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )  # fmt: skip
        for i, host in enumerate(HOSTS)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    for host, proc, out in zip(HOSTS, procs, outputs, strict=True):
        assert proc.returncode == 0, f"{host}: exit {proc.returncode}\n{out[-4000:]}"


@pytest.fixture(scope="module")
def one_host(data: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference: one rank on this machine, micro batch 4, accumulation 2 (global batch 8)."""
    return run(data, tmp_path_factory.mktemp("one_host"), world=1,
               layout={"dp": 1, "tp": 1, "micro_batch_size": 4, "zero_stage": 0})  # fmt: skip


@pytest.mark.parametrize("per_node", [1, 2])
def test_two_hosts_train_what_one_host_trains(
    data: dict[str, str], hosts: dict[str, str], one_host: dict[str, Any], tmp_path: Path,
    per_node: int,
) -> None:  # fmt: skip
    world = len(HOSTS) * per_node
    job = write_job(data, tmp_path, world=world, nodes=len(HOSTS),
                    layout={"dp": world, "tp": 1, "micro_batch_size": 2, "zero_stage": 0})  # fmt: skip
    on_hosts(job, per_node=per_node, env=hosts, run_id=f"{os.getpid()}-{per_node}")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["layout"]["world"] == world and summary["layout"]["dp"] == world
    first, *others = summary["param_checksum_per_rank"]
    assert len(others) == world - 1 and all(c == first for c in others)  # one model on both hosts
    same_losses(summary, one_host)
    same_params(summary, one_host)


def rank_pids(host: str, module: str) -> list[int]:
    """The training ranks running `module` inside `host` (its torchrun agent excluded)."""
    listed = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True)
    pids = []
    for pid in listed.stdout.split():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        words = [w.decode(errors="replace") for w in argv]
        if module in words and "torch.distributed.run" not in words and "srun" not in words[0]:
            pids.append(int(pid))
    return pids


def wait_for(predicate: Any, proc: subprocess.Popen[str], timeout: float, what: str) -> Any:
    """Poll `predicate` every half second until it returns something true, while `proc` runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := predicate():
            return found
        if proc.poll() is not None:
            pytest.fail(
                f"no {what}: snakemake exited {proc.returncode}\n{proc.stdout.read()[-5000:]}"
            )
        time.sleep(0.5)
    pytest.fail(f"no {what} after {timeout} s")


def job_state(job_id: str) -> str:
    """The job's state as squeue reports it (empty once it is gone)."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip()


def lose_node2_mid_pretrain(workdir: Path) -> tuple[str, float, float]:
    """Run the pipeline until pretrain's first checkpoint, kill node2's ranks; the failed run's
    output, seconds from the kill to the Slurm job's end and to Snakemake's exit."""
    run_dir = workdir / "results/tiny"
    proc = subprocess.Popen(
        [*CLUSTER_SNAKEMAKE, "--cores", "2", "--workflow-profile", "profiles/slurm-local", "all"],
        cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(lambda: list(run_dir.glob("checkpoints/pretrain/*/latest.json")), proc, 480,
                 "pretrain checkpoint")  # fmt: skip
        ranks = wait_for(lambda: rank_pids("node2", "stagetrain.pretrain.train"), proc, 30,
                         "rank on node2")  # fmt: skip
        job_id = next((workdir / "results/slurm_logs/rule_pretrain").glob("*.log")).stem
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
        lost = time.monotonic()
        wait_for(lambda: job_state(job_id) not in ("RUNNING", "COMPLETING"), proc, 120,
                 "end of the Slurm job")  # fmt: skip
        job_ended = time.monotonic() - lost
        out = proc.communicate(timeout=300)[0]
        snakemake_ended = time.monotonic() - lost
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, out[-3000:]
    return out, job_ended, snakemake_ended


@contextlib.contextmanager
def drained(node: str) -> Iterator[None]:
    """`node` unavailable to Slurm (drained, as an administrator marks a lost node) inside the block,
    back in service after it, so that later tests see both nodes again. A resumed node reads
    "idle*" (not responding) until the controller's next ping, a second or so: waited for."""
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=drain", "reason=lost"],
                   check=True, capture_output=True, timeout=30)  # fmt: skip
    try:
        yield
    finally:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"],
                       capture_output=True, timeout=30)  # fmt: skip
        deadline = time.monotonic() + 60
        while node_state(node) != "idle" and time.monotonic() < deadline:
            time.sleep(0.5)


def node_state(node: str) -> str:
    """The node's state as sinfo reports it (idle, drained, ...)."""
    out = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip()


def slurm_jobs(workdir: Path) -> dict[str, list[str]]:
    """The Slurm job ids each rule submitted (its logs, kept also for successful jobs), oldest first."""
    root = workdir / "results/slurm_logs"
    jobs: dict[str, list[str]] = {}
    for log in sorted(root.glob("rule_*/**/*.log"), key=lambda p: int(p.stem)):
        jobs.setdefault(log.relative_to(root).parts[0], []).append(log.stem)
    return jobs


def job_nodes(job_id: str) -> str:
    """The nodes a (recent) Slurm job ran on, from the controller (MinJobAge keeps it 10 minutes)."""
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
    found = re.search(r"^\s*NodeList=(\S+)", out.stdout, re.M)
    return found.group(1) if found else out.stdout + out.stderr


def launch_line(run_dir: Path, stage: str) -> str:
    """The stage log's line that shows the command starting its ranks."""
    log = (run_dir / f"logs/{stage}.log").read_text()
    return next(line for line in log.splitlines() if "launch: " in line)


def test_the_whole_pipeline_on_two_slurm_nodes_survives_losing_one(
    workdir: Path, hosts: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("SLURM_CONF", "GLOO_SOCKET_IFNAME"):
        monkeypatch.setenv(key, hosts[key])
    small_run(workdir, steps=12)
    small_grpo(workdir)
    edit_config(workdir, "hardware", nodes=2, cpu_ranks=1)
    # Pinned, not planned: the rerun re-detects and replans, and on a CPU `auto` precision follows a
    # speed measurement (a new precision is a new fingerprint, a fresh start); one rank alone would
    # be planned ZeRO-0, which no ZeRO-0 -> ZeRO-0 resume needs to convert.
    edit_config(workdir, "deepspeed", precision="fp32")
    edit_config(workdir, "parallelism", zero_stage=2)
    run_dir = workdir / "results/tiny"

    out, job_ended, snakemake_ended = lose_node2_mid_pretrain(workdir)
    print(
        f"node2's ranks killed: Slurm job over {job_ended:.1f} s later, Snakemake {snakemake_ended:.1f} s"
    )
    assert job_ended < 60  # srun --kill-on-bad-exit, not the collective timeout
    error = re.search(r"^error: (pretrain: .*)$", out, re.M)
    assert error and "on node node2 was killed by SIGKILL" in error.group(1), out[-4000:]
    assert "results/tiny/logs/pretrain.log" in out
    assert re.search(r"results/slurm_logs/rule_pretrain/\d+\.log", out)
    the_first_run_was_on_both_nodes(run_dir)
    before = slurm_jobs(workdir)
    tokenizer_written = (run_dir / "data/train.bin").stat().st_mtime_ns

    # node2 stays lost: Slurm may not use it, and the same command with hardware.nodes: 1
    # continues pretraining from the last checkpoint on node1 alone.
    edit_config(workdir, "hardware", nodes=1)
    with drained("node2"):
        assert node_state("node2") in ("drained", "draining"), node_state("node2")
        began = time.monotonic()
        snakemake(workdir, "--workflow-profile", "profiles/slurm-local", "all")
        print(f"rerun on node1 alone: {time.monotonic() - began:.1f} s")
        after = slurm_jobs(workdir)
        new = [i for rule, ids in after.items() for i in ids[len(before.get(rule, [])) :]]
        assert {job_nodes(i) for i in new} == {"node1"}, after
    assert node_state("node2") == "idle"
    the_rerun_resumed_on_one_node(workdir, before, after)
    assert (run_dir / "data/train.bin").stat().st_mtime_ns == tokenizer_written


def the_first_run_was_on_both_nodes(run_dir: Path) -> None:
    """Before the loss: detection inside a two-node allocation, a two-rank plan, and pretraining
    started as one srun step of one torchrun per node meeting on node1."""
    hardware = json.loads((run_dir / "hardware.json").read_text())
    assert (hardware["nodes"], hardware["nodes_source"]) == (2, "slurm")
    assert hardware["slurm"]["job_id"] and hardware["slurm"]["nodelist"] == "node1,node2"
    plan = json.loads((run_dir / "plan.json").read_text())
    assert (plan["nodes"], plan["ranks_per_node"], plan["world"]) == (2, 1, 2)
    assert re.search(r"launch: srun --nodes 2 --ntasks 2 --ntasks-per-node 1 .*torch\.distributed\.run "
                     r"--nnodes 2 --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint node1:",
                     launch_line(run_dir, "pretrain"))  # fmt: skip


def the_rerun_resumed_on_one_node(
    workdir: Path, before: dict[str, list[str]], after: dict[str, list[str]]
) -> None:
    """What the rerun on node1 alone did: detected one node, replanned, resumed pretraining from
    the two-node checkpoint (converted once), ran GRPO and both consolidations, kept the tokenizer."""
    run_dir = workdir / "results/tiny"
    expected = ["hardware.json", "plan.json", "model_config.json", "tokenizer", "data/train.bin",
                "data/val.bin", "data/meta.json", "deepspeed/pretrain.json", "pretrain/summary.json",
                "pretrain/metrics.jsonl", "pretrain/loss.png", "model/pretrain/MANIFEST.json",
                "grpo/summary.json", "grpo/reward.png", "model/grpo/MANIFEST.json"]  # fmt: skip
    assert [name for name in expected if not (run_dir / name).exists()] == []
    # Heavy stages were Slurm jobs, with logs; the quick local rules were not. The rerun submitted
    # detection, pretraining, GRPO and both consolidations again, not the tokenizer.
    assert {rule: len(ids) - len(before.get(rule, [])) for rule, ids in after.items()} == {
        "rule_detect_hardware": 1, "rule_prepare_tokenizer": 0, "rule_pretrain": 1,
        "rule_consolidate": 2, "rule_grpo": 1,
    }  # fmt: skip
    hardware = json.loads((run_dir / "hardware.json").read_text())
    assert (hardware["nodes"], hardware["nodes_source"]) == (1, "config")
    assert hardware["slurm"]["job_id"] and hardware["slurm"]["nodelist"] == "node1"
    plan = json.loads((run_dir / "plan.json").read_text())
    assert (plan["nodes"], plan["ranks_per_node"], plan["world"]) == (1, 1, 1)
    for stage in ("pretrain", "grpo"):
        assert re.search(r"launch: .*torch\.distributed\.run --standalone --nnodes 1 --nproc_per_node 1 ",
                         launch_line(run_dir, stage)), launch_line(run_dir, stage)  # fmt: skip
        summary = json.loads((run_dir / f"{stage}/summary.json").read_text())
        assert summary["layout"]["world"] == plan["world"] == 1
    pretrain = json.loads((run_dir / "pretrain/summary.json").read_text())
    step = pretrain["resumed_from_step"]
    assert pretrain["final_step"] == 12 and step >= 4
    log = (run_dir / "logs/pretrain.log").read_text()
    converted = re.search(
        rf"2 ranks \(dp=2 tp=1\) ZeRO-2 -> 1 rank \(dp=1 tp=1\) ZeRO-2: converted step {step} "
        r"to a universal checkpoint in ([\d.]+) s", log)  # fmt: skip
    assert converted, log[-4000:]
    assert "starting fresh" not in log
    print(f"pretraining resumed from step {step} on one rank; conversion {converted.group(1)} s")
    fingerprints = list((run_dir / "checkpoints/pretrain").glob("*/latest.json"))
    assert len(fingerprints) == 1, fingerprints
