"""Slurm's side of a training stage: the resources it asks for and the command that starts its ranks."""

from __future__ import annotations

import pytest

from stagetrain.config.settings import ConsolidateSettings
from stagetrain.errors import StageError
from stagetrain.hardware.allocation import Allocation, allocation, expand_nodelist
from stagetrain.training.launch import NodeFailures, torchrun_command
from stagetrain.workflow.slurm import (
    TRAINING_RESOURCES,
    consolidate_mem_mb,
    consolidate_resources,
    job_resources,
)


def _plan(nodes: int, per_node: int, device: str = "H100") -> dict:
    memory = {"host_per_node": 3 * 2**30, "total": 2**30}
    throughput = {"step_s": 1.5} if device != "cpu" else {"reason": "no throughput model for CPUs"}
    return {"nodes": nodes, "ranks_per_node": per_node, "device": device,
            "stages": {"pretrain": {"memory": memory, "throughput": throughput}}}  # fmt: skip


def test_a_two_node_gpu_plan_asks_for_one_task_and_one_gpu_per_rank() -> None:
    res = job_resources(_plan(2, 8), "pretrain", node_cores=96, steps=1000)
    assert res == {
        "nodes": 2, "tasks": None, "tasks_per_node": 8, "cpus_per_task": 12,
        "mem_mb": 3 * 1024 + 8 * 4096, "gres": "gpu:8", "tasks_per_gpu": 0, "mpi": "srun",
        "runtime": 2 * 1000 * 1.5 // 60 + 30,  # twice the predicted 25 minutes, plus 30
    }  # fmt: skip


def test_consolidation_memory_is_the_verified_model_not_the_checkpoint() -> None:
    """Streaming needs no memory per parameter; the loss check holds the model in the output dtype
    and one micro batch of logits (here 2 x 4096 tokens x 128K vocabulary, 10 bytes each in bf16)."""
    plan = {"model": {"params": 70 * 10**9, "vocab_size": 128 * 1024},
            "stages": {"pretrain": {"layout": {"micro_batch_size": 2, "seq_len": 4096}},
                       "grpo": {"layout": {"micro_batch_size": 1, "seq_len": 1024}}}}  # fmt: skip
    logits = 2 * 4096 * 128 * 1024 * 10
    assert consolidate_mem_mb(plan, ConsolidateSettings(dtype="bf16", max_shard_size="2GB", verify="loss")) == -(-(140 * 10**9 + logits) // 2**20) + 4096  # fmt: skip
    assert (
        consolidate_mem_mb(
            plan, ConsolidateSettings(dtype="fp32", max_shard_size="2GB", verify="loss")
        )
        > 280 * 10**9 // 2**20
    )
    assert (
        consolidate_mem_mb(
            plan, ConsolidateSettings(dtype="bf16", max_shard_size="2GB", verify="finite")
        )
        == 4096
    )


def test_a_cpu_plan_counts_the_model_state_in_host_memory() -> None:
    res = job_resources(_plan(1, 2, device="cpu"), "pretrain", node_cores=2, steps=10)
    assert res["mem_mb"] == 3 * 1024 + 2 * 1024 + 2 * 4096
    assert (res["tasks_per_node"], res["cpus_per_task"], res["gres"], res["mpi"]) == (
        2,
        1,
        None,
        "srun",
    )


def test_one_rank_per_node_uses_tasks_and_a_single_rank_needs_no_srun_step() -> None:
    several = job_resources(_plan(4, 1), "pretrain", node_cores=16, steps=10)
    assert (several["tasks"], several["tasks_per_node"], several["mpi"]) == (4, None, "srun")
    single = job_resources(_plan(1, 1), "pretrain", node_cores=None, steps=10)
    assert (single["tasks"], single["tasks_per_node"], single["mpi"]) == (1, None, None)
    assert single["cpus_per_task"] == -1  # described hardware: cores unknown, Slurm's default


def test_outside_slurm_and_for_one_rank_torchrun_runs_standalone() -> None:
    cmd = torchrun_command(
        nodes=1, procs_per_node=2, module="m", args=["--spec", "s"], allocation=None
    )
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node", "2",
                       "-m", "m", "--spec", "s"]  # fmt: skip
    one = torchrun_command(nodes=1, procs_per_node=1, module="m", args=[],
                           allocation=Allocation("5", ["a1"], 4))  # fmt: skip
    assert one[0] != "srun" and "--standalone" in one


@pytest.mark.parametrize(
    ("nodes", "nodelist", "first"),
    [(1, "cpu1", "cpu1"), (2, "gpu[07-08]", "gpu07"), (16, "n[1-8],m[01-08]", "n1")],
)
def test_inside_slurm_one_srun_step_starts_one_torchrun_per_node_with_c10d(
    nodes: int, nodelist: str, first: str
) -> None:
    alloc = Allocation("42", expand_nodelist(nodelist), 96)
    cmd = torchrun_command(
        nodes=nodes, procs_per_node=8, module="m", args=[], allocation=alloc, gpus=True
    )
    assert cmd[:10] == ["srun", "--nodes", str(nodes), "--ntasks", str(nodes), "--ntasks-per-node", "1",
                        "--kill-on-bad-exit=1", "--cpus-per-task=96", "--gres=gpu:8"]  # fmt: skip
    text = " ".join(cmd)
    assert f"--nnodes {nodes} --nproc_per_node 8" in text
    assert f"--rdzv_backend c10d --rdzv_endpoint {first}:29400 --rdzv_id 42" in text
    assert "--standalone" not in text


def test_nodelists_expand_as_slurm_does() -> None:
    assert expand_nodelist("node1") == ["node1"]
    assert expand_nodelist("n[01-03,7],gpu5") == ["n01", "n02", "n03", "n7", "gpu5"]
    assert len(expand_nodelist("n[1-8],m[01-08]")) == 16


def test_the_plan_and_the_allocation_must_agree_on_nodes() -> None:
    with pytest.raises(StageError, match="2 nodes need a Slurm allocation"):
        torchrun_command(nodes=2, procs_per_node=8, module="m", args=[], allocation=None)
    with pytest.raises(StageError, match="2 nodes, but the Slurm allocation has 3: a1,a2,a3"):
        torchrun_command(nodes=2, procs_per_node=8, module="m", args=[],
                         allocation=Allocation("1", ["a1", "a2", "a3"], None))  # fmt: skip


def test_allocation_from_the_environment_or_from_scontrol() -> None:
    assert allocation({}) is None

    def no_scontrol(job_id: str) -> str:
        raise AssertionError("the environment was enough")

    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_CPUS_PER_NODE": "16(x2)"}
    assert allocation(env, no_scontrol) == Allocation("9", ["n1", "n2"], 16)
    # In the executor plugin's job step only SLURM_JOB_ID is left.
    answer = "JobId=9 JobName=x NodeList=gpu[3-4] NumNodes=2 NumCPUs=64 NumTasks=16 CPUs/Task=4"
    assert allocation({"SLURM_JOB_ID": "9"}, lambda job_id: answer) == Allocation(
        "9", ["gpu3", "gpu4"], 32
    )
    with pytest.raises(StageError, match="Slurm job 9: no node list"):
        allocation({"SLURM_JOB_ID": "9"}, lambda job_id: "JobId=9 NodeList=")


def test_every_training_resource_is_declared_to_the_workflow() -> None:
    assert (
        tuple(job_resources(_plan(1, 2), "pretrain", node_cores=8, steps=10)) == TRAINING_RESOURCES
    )


NODE2_KILLED = """\
[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:561] Connection closed by peer [10.199.77.2]:40614.
srun: error: node2: task 1: Exited with exit code 1
srun: launch/slurm: _step_signal: Terminating StepId=5.0
[0]:
  time      : 2026-11-30_20:44:13
  host      : node2
  rank      : 1 (local_rank: 0)
  exitcode  : -9 (pid: 14511) (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 14511
srun: error: node1: task 0: Exited with exit code 1
"""


def failure_of(output: str) -> str | None:
    failures = NodeFailures()
    for line in output.splitlines():
        failures.read(line)
    return failures.summary("pretrain")


def test_a_failed_multi_node_run_names_the_node_whose_rank_was_killed() -> None:
    assert failure_of(NODE2_KILLED) == (
        "pretrain: rank 1 on node node2 was killed by SIGKILL; "
        "the ranks on every node were stopped (srun: node1, node2)"
    )
    # node1's launcher reported first, but its ranks only lost their peer: node2 is still named
    node1_first = NODE2_KILLED.replace("srun: error: node2: task 1: Exited with exit code 1\n", "")
    assert "rank 1 on node node2 was killed by SIGKILL" in failure_of(
        node1_first + "srun: error: node2: task 1: Exited with exit code 1\n"
    )


def test_without_a_killed_rank_the_first_node_srun_names_is_blamed() -> None:
    out = (
        "srun: error: node2: task 1: Exited with exit code 1\nsrun: error: node1: task 0: Killed\n"
    )
    assert failure_of(out) == (
        "pretrain: the ranks on node node2 failed first (Exited with exit code 1); "
        "the ranks on every node were stopped (srun: node1, node2)"
    )
    assert failure_of("Traceback (most recent call last):\n") is None  # one node: the old message


def test_consolidation_asks_for_one_gpu_where_the_verified_model_fits_one() -> None:
    """On a GPU plan the loss check gets one GPU if the model and its logits fit it with a fifth
    to spare; not for a CPU plan, a `finite` check, or a model larger than one device."""
    device = 80 * 2**30
    plan = {"device": "H100", "model": {"params": 10**9, "vocab_size": 32768},
            "stages": {"pretrain": {"layout": {"micro_batch_size": 2, "seq_len": 4096}, "memory": {"device": device}}}}  # fmt: skip
    loss = ConsolidateSettings(dtype="bf16", max_shard_size="2GB", verify="loss")
    assert consolidate_resources(plan, loss) == {
        "mem_mb": consolidate_mem_mb(plan, loss),
        "gres": "gpu:1",
        "tasks_per_gpu": 0,
    }
    finite = ConsolidateSettings(dtype="bf16", max_shard_size="2GB", verify="finite")
    large = {**plan, "model": {**plan["model"], "params": 35 * 10**9}}  # 70 GB of bf16 weights
    for other, cfg in (({**plan, "device": "cpu"}, loss), (plan, finite), (large, loss)):
        assert consolidate_resources(other, cfg)["gres"] is None, (other["device"], cfg.verify)
