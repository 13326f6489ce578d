"""The command that starts the training ranks: torchrun, under srun inside a Slurm job.

World size always comes from plan.json. Outside Slurm torchrun runs
standalone on this machine; inside an allocation one srun step starts one
torchrun per node (`srun --ntasks-per-node 1`) and they meet through c10d
rendezvous on the allocation's first host, so one node and many take one path.

Process lifetime: every link of Snakemake -> stage script -> launcher (torchrun,
or srun) -> ranks dies with the one before it. The stage script is a child of
Snakemake in Snakemake's process group, and so is the launcher, but torchrun
starts each rank in a session of its own, so a signal to the group (kill -9,
a closed terminal, a batch system that kills the job's process group) never
reaches the ranks, and orphaned ranks used to train on beside a rerun. Chosen:
`prctl(PR_SET_PDEATHSIG)`, at each link.
- The stage script asks for SIGTERM when Snakemake (or the shell that ran it)
  dies, at the start of `launch_stage`; Python dies of it at once, and the
  launcher follows.
- The launcher is started through `python -m stagetrain.training.launch`, which
  asks for SIGTERM when the stage script dies and then execs the real command.
  SIGTERM, not SIGKILL: torchrun and srun answer it by stopping their ranks
  (srun forwards it to its tasks on every node), which SIGKILL would not allow.
- Each rank, first thing in `rank_main` (stagetrain.training.rank), asks for SIGKILL when its torchrun
  agent dies, so a killed agent takes its ranks with it at once.
The kernel delivers the signal at the parent's death, whatever killed it, with
no thread or polling (a watchdog on the parent pid would notice only at its next
poll and needs a thread in every rank; torchrun has no such option: it puts
ranks in new sessions on purpose). Measured on two CPU ranks (busy 2-core
machine), from the signal to no rank alive: SIGKILL of the Snakemake process
group 0.1-0.2 s, of Snakemake alone 1.8 s, of the stage script alone 5.7 s
(torchrun's own teardown); before, the ranks trained on in all three
(docs/architecture.md, "Process lifetime and locks").

The death signal is per parent thread: Snakemake waits for the stage script
in the thread that started it, and the stage script and torchrun start their
children from their main threads. A launcher or rank whose parent died before
it asked is caught by a check on its parent right after; a stage script whose
Snakemake died in its first second, before `launch_stage`, is not.

The job spec the ranks read is written here alone (`job_spec`, each stage's part by
`pretrain_part` and `grpo_part`); its types are `stagetrain.training.spec`'s.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict, cast

from stagetrain.config.settings import TrackingSettings
from stagetrain.errors import StageError
from stagetrain.hardware.allocation import Allocation
from stagetrain.hardware.allocation import allocation as job_allocation
from stagetrain.planning.plan import NoThroughput, ThroughputRecord
from stagetrain.training import mlflow_run
from stagetrain.training.metrics import WANDB_MISSING
from stagetrain.training.rank import die_with_parent
from stagetrain.training.spec import (
    GrpoJob,
    GrpoPart,
    MlflowRun,
    PretrainJob,
    PretrainPart,
    WandbRun,
)

RDZV_PORT = 29400
log = logging.getLogger("stagetrain")


def tied_to_this_process(cmd: Sequence[str]) -> list[str]:
    """`cmd` run so that it gets SIGTERM when this process dies, by any signal (see `exec_tied`)."""
    return [sys.executable, "-m", "stagetrain.training.launch", str(os.getpid()), *cmd]


def exec_tied(argv: Sequence[str]) -> None:
    """`PARENT_PID CMD...`: die with SIGTERM when PARENT_PID dies, then become CMD.

    The death signal survives exec. If the parent is already gone (it died
    before the request), CMD is never started.
    """
    parent, *cmd = argv
    die_with_parent(signal.SIGTERM)
    if os.getppid() != int(parent):
        sys.exit(
            f"error: the process that started {cmd[0]} (pid {parent}) is gone; not starting it"
        )
    os.execvp(cmd[0], cmd)


def torchrun_command(
    *,
    nodes: int,
    procs_per_node: int,
    module: str,
    args: Sequence[str],
    allocation: Allocation | None,
    gpus: bool = False,
) -> list[str]:
    """The argv that starts `nodes * procs_per_node` ranks running `python -m module args`.

    Outside Slurm, and for a single rank, torchrun runs standalone. Inside an
    allocation, one srun step starts one torchrun per node (all of the node's
    CPUs and GPUs to it), and they meet through c10d on the first host.

    Raises:
        StageError: several nodes outside a Slurm allocation, or an allocation
            whose node count differs from the plan's.
    """
    if allocation is None or nodes * procs_per_node == 1:
        if nodes > 1:
            raise StageError(
                f"plan.json: {nodes} nodes need a Slurm allocation to start them (run through profiles/slurm)"
            )
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node", str(procs_per_node),
                "-m", module, *args]  # fmt: skip
    hosts = allocation.hosts
    if len(hosts) != nodes:
        raise StageError(
            f"plan.json: {nodes} nodes, but the Slurm allocation has {len(hosts)}: {','.join(hosts)}"
        )
    # --kill-on-bad-exit: a node whose torchrun fails (its ranks died, or the node was
    # lost) ends the whole step at once instead of leaving the others to wait.
    step = ["srun", "--nodes", str(nodes), "--ntasks", str(nodes), "--ntasks-per-node", "1",
            "--kill-on-bad-exit=1"]  # fmt: skip
    if allocation.cpus_per_node:
        step.append(f"--cpus-per-task={allocation.cpus_per_node}")
    if gpus:
        step.append(f"--gres=gpu:{procs_per_node}")
    return [*step, *node_torchrun(nodes=nodes, procs_per_node=procs_per_node, first_host=hosts[0],
                                  run_id=allocation.job_id, module=module, args=args)]  # fmt: skip


def node_torchrun(
    *,
    nodes: int,
    procs_per_node: int,
    first_host: str,
    run_id: str,
    module: str,
    args: Sequence[str],
) -> list[str]:
    """The torchrun that each of `nodes` hosts runs: c10d rendezvous on `first_host`.

    Every node runs the same command; they meet at `first_host:RDZV_PORT` under
    `run_id`, and torchrun gives out the ranks. No restarts (torchrun's default
    --max-restarts 0): a rank that fails stops its node's torchrun, and with it,
    under srun --kill-on-bad-exit, every node's.
    """
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nodes), "--nproc_per_node", str(procs_per_node),
        "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{first_host}:{RDZV_PORT}",
        "--rdzv_id", run_id,
        "-m", module, *args,
    ]  # fmt: skip


THREAD_VARIABLES = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS",
)  # fmt: skip


def rank_environment(env: Mapping[str, str], *, cores: int, ranks_per_node: int) -> dict[str, str]:
    """`env` with every threading library limited to this rank's share of the node's cores.

    Snakemake sets these variables to the job's thread count for the whole job;
    handed down to every rank unchanged, each rank would run that many threads
    and the ranks would fight over the cores (seen: 3-5x slower on 2 CPU ranks).
    """
    share = str(max(1, cores // ranks_per_node))
    return {**env, **dict.fromkeys(THREAD_VARIABLES, share)}


def run_ranks(cmd: Sequence[str], env: Mapping[str, str], stage: str) -> None:
    """Run the ranks, passing their output lines to the log; a failure becomes one line.

    Once a rank has said `error: ...` (bad input, which every rank may meet at once), the log
    takes only error lines it has not had yet: the same line from the other ranks, and
    torchrun's `ChildFailedError` report that follows, repeated the one line four times inside a
    traceback. The stage's own error then says it once more, last.

    Raises:
        StageError: the ranks failed; the message is a rank's own `error:` line
            when there is one (bad input), else the exit status.
    """
    log.info("launch: %s", " ".join(cmd))
    first_error = None
    failure = NodeFailures()
    with subprocess.Popen(
        tied_to_this_process(cmd),
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        said: set[str] = set()
        for line in proc.stdout:
            line = line.rstrip("\n")
            failure.read(line)
            if line.startswith("error: "):
                first_error = first_error or line.removeprefix("error: ")
                if line in said:
                    continue
                said.add(line)
            elif first_error is not None:
                continue
            log.info("%s", line)
    if proc.returncode != 0:
        raise StageError(
            first_error
            or failure.summary(stage)
            or f"{stage}: the training ranks exited with status {proc.returncode}"
        )


class NodeFailures:
    """Which node's ranks failed first, read from the launchers' output of a failed run.

    torchrun reports each failed rank in a block (`host : node2`, `rank : 1`,
    `exitcode : -9 (pid: 7) (SIGKILL)`), and srun names each node whose
    torchrun exited (`srun: error: node2: task 1: Exited with exit code 1`).
    When one node's ranks die, the others fail moments later in a collective
    ("Connection closed by peer"), so the first failure is not always the
    cause: a rank killed by a signal (SIGKILL, the OOM killer) is named before
    any rank that merely exited, and srun's first line otherwise.
    """

    _TORCHRUN = re.compile(r"^\s*(host|rank|exitcode)\s*:\s*(\S+)(?:.*\((SIG\w+)\))?")
    _SRUN = re.compile(r"^srun: error: (\S+): tasks? ([\d,-]+): (.+)$")

    def __init__(self) -> None:
        self.ranks: list[dict[str, str]] = []
        self.nodes: list[tuple[str, str]] = []

    def read(self, line: str) -> None:
        """Take one output line."""
        if found := self._SRUN.match(line):
            self.nodes.append((found.group(1), found.group(3)))
        elif found := self._TORCHRUN.match(line):
            key, value, signame = found.groups()
            if key == "host":
                self.ranks.append({"host": value})
            elif self.ranks:
                self.ranks[-1][key] = value
                if signame:
                    self.ranks[-1]["signal"] = signame

    def summary(self, stage: str) -> str | None:
        """One line naming the node that failed, or None when the output named none."""
        killed = [r for r in self.ranks if r.get("signal") not in (None, "SIGTERM")]
        nodes = sorted({host for host, _ in self.nodes})
        stopped = (
            f"; the ranks on every node were stopped (srun: {', '.join(nodes)})" if nodes else ""
        )
        if killed:
            r = killed[0]
            return f"{stage}: rank {r.get('rank', '?')} on node {r['host']} was killed by {r['signal']}{stopped}"
        if self.nodes:
            host, what = self.nodes[0]
            return f"{stage}: the ranks on node {host} failed first ({what}){stopped}"
        return None


class Trackers(TypedDict):
    """`job_spec`'s tracker arguments (`trackers`): None where `tracking.report_to` leaves one out."""

    tensorboard: Path | None
    wandb: WandbRun | None
    mlflow: MlflowRun | None


def pretrain_part(
    config: Mapping[str, Any], throughput: ThroughputRecord | NoThroughput
) -> PretrainPart:
    """Pretrain's part of the job spec from the validated config (or the stage's sections of it,
    `run` among them) and the planner's predicted throughput: the one writer of its keys."""
    return {"pretrain": config["pretrain"], "model": config["model"],
            "seed": config["run"]["seed"], "throughput": throughput}  # fmt: skip


def grpo_part(config: Mapping[str, Any]) -> GrpoPart:
    """GRPO's part of the job spec from the validated config (or the stage's sections of it)."""
    return {"grpo": config["grpo"], "tasks": config["tasks"], "seed": config["run"]["seed"]}


def job_spec(
    *,
    inputs: Mapping[str, str | Path],
    outputs: Mapping[str, str | Path],
    checkpoints: Path,
    part: PretrainPart | GrpoPart,
    tensorboard: Path | None = None,
    wandb: WandbRun | None = None,
    mlflow: MlflowRun | None = None,
) -> PretrainJob | GrpoJob:
    """The job spec a training stage's ranks read (`--spec job.json`): the one writer of its shape.

    Absolute paths of the stage's inputs and outputs by name, the checkpoint
    root, the TensorBoard folder when events are wanted, the W&B run's project,
    name and folder when one is, the MLflow run's URI, experiment, name and
    params (the part, flattened) when one is, then the stage's `part` (`pretrain_part`,
    `grpo_part`: config sections, seed). The stage launcher, the test harness
    and the benchmarks all build it here, so a key added for the ranks reaches
    every caller.
    """
    spec = {
        **{k: str(Path(v).resolve()) for k, v in {**inputs, **outputs}.items()},
        "checkpoints": str(checkpoints),
        **part,
    }
    if tensorboard is not None:
        spec["tensorboard"] = str(tensorboard)
    if wandb is not None:
        spec["wandb"] = dict(wandb)
    if mlflow is not None:
        spec["mlflow"] = {**mlflow, "params": mlflow_run.params(part)}
    # The paths are the rule's named inputs and outputs: which stage's spec it is, its part says.
    return cast("PretrainJob | GrpoJob", spec)


def trackers(tracking: TrackingSettings, results: Path, stage: str) -> Trackers:
    """`job_spec`'s tracker arguments for `tracking.report_to`, under results/<run>/.

    TensorBoard's folder and W&B's sit beside the checkpoints, outside the
    declared outputs, so curves survive a rerun.

    Raises:
        StageError: wandb or mlflow asked for but not installed, or MLflow's server not
            answering, before any rank starts.
    """
    out: Trackers = {"tensorboard": None, "wandb": None, "mlflow": None}
    if "tensorboard" in tracking.report_to:
        out["tensorboard"] = results / "tensorboard" / stage
    if "wandb" in tracking.report_to:
        if importlib.util.find_spec("wandb") is None:
            raise StageError(WANDB_MISSING)
        out["wandb"] = {"project": tracking.wandb_project, "name": f"{results.name}-{stage}",
                        "dir": str(results / "wandb")}  # fmt: skip
    if "mlflow" in tracking.report_to:
        mlflow_run.check(tracking.mlflow)
        out["mlflow"] = {"tracking_uri": mlflow_run.tracking_uri(tracking.mlflow),
                         "experiment": tracking.mlflow.experiment, "name": f"{results.name}-{stage}",
                         "params": {}}  # fmt: skip
    return out


def launch_stage(
    *,
    stage: str,
    module: str,
    inputs: Mapping[str, str],
    outputs: Mapping[str, str],
    part: PretrainPart | GrpoPart,
    tracking: TrackingSettings,
) -> None:
    """Write the job spec of a training stage and run its ranks as the plan says.

    The spec holds absolute paths of the stage's inputs and outputs, its checkpoint folder
    results/<run>/checkpoints/<stage>/ (outside the declared outputs, so reruns resume) and
    the stage's `part` (config sections, seed, pretrain's predicted throughput).
    """
    import json

    from stagetrain.io import atomic_write_json
    from stagetrain.training.lock import StageLock

    die_with_parent(signal.SIGTERM)  # Snakemake (or the shell) gone: stop, and the launcher with us
    plan = json.loads(Path(inputs["plan"]).read_text())
    root = Path(outputs["summary"]).resolve().parents[1] / "checkpoints" / stage
    StageLock(root).check_free()  # a second run fails here, before it writes its job.json
    spec = job_spec(inputs=inputs, outputs=outputs, checkpoints=root, part=part,
                    **trackers(tracking, root.parents[1], stage))  # fmt: skip
    atomic_write_json(root / "job.json", spec)
    alloc = job_allocation(os.environ)
    # Inside Slurm the job's CPUs on a node, not the node's (nothing may pin this process).
    cores = alloc.cpus_per_node if alloc and alloc.cpus_per_node else len(os.sched_getaffinity(0))
    env = rank_environment(os.environ, cores=cores, ranks_per_node=plan["ranks_per_node"])
    cmd = torchrun_command(nodes=plan["nodes"], procs_per_node=plan["ranks_per_node"], module=module,
                           args=["--spec", str(root / "job.json")], allocation=alloc,
                           gpus=plan["device"] != "cpu")  # fmt: skip
    run_ranks(cmd, env, stage)


if __name__ == "__main__":
    exec_tied(sys.argv[1:])
