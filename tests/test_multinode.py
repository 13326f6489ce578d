"""Two hosts for real: training across the simulated hosts of .ci/hosts.sh, by torchrun and through Slurm.

node1 and node2 are network namespaces that reach each other only over a
private link, each with its own hostname; the two-node Slurm runs one slurmd in
each. Where the hosts cannot be made (no root, no Slurm to install) every test
here is skipped with hosts.sh's reason; `.ci/run` starts them on CI.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from pretrain_harness import build_comm_op, run, write_job
from test_pretrain_dist import _same_losses, _same_params

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
    build_comm_op()
    world = len(HOSTS) * per_node
    job = write_job(data, tmp_path, world=world, nodes=len(HOSTS),
                    layout={"dp": world, "tp": 1, "micro_batch_size": 2, "zero_stage": 0})  # fmt: skip
    on_hosts(job, per_node=per_node, env=hosts, run_id=f"{os.getpid()}-{per_node}")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["layout"]["world"] == world and summary["layout"]["dp"] == world
    first, *others = summary["param_checksum_per_rank"]
    assert len(others) == world - 1 and all(c == first for c in others)  # one model on both hosts
    _same_losses(summary, one_host)
    _same_params(summary, one_host)
