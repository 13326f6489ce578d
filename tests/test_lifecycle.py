"""Process lifetime and the one-writer lock: real processes, real signals, real torchrun and Snakemake.

Fast tests check the pieces (the lock between two processes, each death-signal
link); the slow ones check the whole: a SIGKILLed Snakemake leaves no rank alive,
two runs started at once give one run's exact result and one line of error, and
a rank killed in the middle of its save resumes from the previous checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from harness.configs import small_run
from harness.processes import alive, second_run_while_first_holds
from harness.training import SharedRuns, dp2, final_params, launch, run
from harness.workflow import SNAKEMAKE, snakemake

from stagetrain.errors import StageError
from stagetrain.training import lock as stage_lock
from stagetrain.training.checkpoints import KILL_DURING_SAVE
from stagetrain.training.lock import LOCK_NAME, StageLock

# ZeRO-1, so that each rank writes a shard of its own
LAYOUT = dp2(1)
STEPS = {"checkpoint_every": 2}
"""The session's shared ZeRO-1 run (4 steps), checkpointed every 2 steps: the same maths."""


def _wait_dead(pids: list[int], seconds: float) -> float | None:
    """Seconds until none of `pids` runs, or None if some still run after `seconds`."""
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        if not any(alive(pid) for pid in pids):
            return time.monotonic() - began
        time.sleep(0.02)
    return None


def _python(code: str, *args: str) -> subprocess.Popen[str]:
    """`python -c code args` with one line of its stdout readable; tests kill it by pid."""
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)


HOLDER = """
import sys, time
from pathlib import Path
from stagetrain.training.lock import StageLock
StageLock(Path(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_a_held_lock_refuses_others_in_one_line_and_dies_with_its_holder(tmp_path: Path) -> None:
    holder = _python(HOLDER, str(tmp_path))
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        for attempt in (StageLock(tmp_path).acquire, StageLock(tmp_path).check_free):
            with pytest.raises(StageError) as err:
                attempt()
            message = str(err.value)
            assert "\n" not in message and message.startswith(f"{tmp_path}: another run")
            assert f"pid {holder.pid} on host {socket.gethostname()}" in message
    finally:
        holder.kill()
        holder.wait()
    StageLock(tmp_path).acquire()  # the kernel released it with the holder: no stale lock
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_a_filesystem_without_locks_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stands in for Lustre mounted without `flock` (no such mount here): flock fails with ENOSYS."""

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(stage_lock.fcntl, "flock", no_locks)
    with pytest.raises(StageError, match="this filesystem cannot lock files") as err:
        StageLock(tmp_path).acquire()
    assert "\n" not in str(err.value) and str(tmp_path / LOCK_NAME) in str(err.value)


@pytest.mark.parametrize(
    ("call", "code", "expected"),
    [("flock", errno.EIO, "cannot lock the lock file (flock: Input/output error)"),
     ("fsync", errno.ENOSPC, "cannot record the holder in the lock file (No space left on device)")],
)  # fmt: skip
def test_any_other_failure_of_the_lock_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, code: int, expected: str
) -> None:
    """flock's and the holder record's other errnos (EIO, ENOSPC, ...) were tracebacks."""

    def fails(*args: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(stage_lock.fcntl if call == "flock" else stage_lock.os, call, fails)
    with pytest.raises(StageError) as err:
        StageLock(tmp_path).acquire()
    assert str(err.value) == f"{tmp_path / LOCK_NAME}: {expected}"


STAGE = """
import subprocess, sys, time
from stagetrain.training.launch import tied_to_this_process
child = subprocess.Popen(tied_to_this_process([sys.executable, "-c", "import time; time.sleep(600)"]))
print(child.pid, flush=True)
time.sleep(600)
"""
AGENT = """
import subprocess, sys, time
code = "from stagetrain.training.rank import die_with_parent; import signal, time; die_with_parent(signal.SIGKILL); print('ready', flush=True); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("parent", [STAGE, AGENT], ids=["launcher-with-stage", "rank-with-agent"])
def test_a_child_dies_with_its_killed_parent(parent: str) -> None:
    """Each link: the launcher with the stage script, a rank (own session, as torchrun starts it) with its agent."""
    proc = _python(parent)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        assert alive(child)
        proc.kill()
        proc.wait()
        assert _wait_dead([child], 5) is not None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def _pids_running(needle: str) -> list[int]:
    """Pids of running processes whose command line contains `needle`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                    pids.append(int(entry.name))
    return pids


@pytest.mark.slow
def test_a_second_run_is_refused_in_one_line_and_no_rank_outlives_a_sigkilled_snakemake(
    finished_copy: Path,
) -> None:
    """In a copy of the finished small run at 400 steps (the plan and pretrain rerun), its
    checkpoints removed so that the first pointer written is this run's."""
    workdir = finished_copy
    root = workdir / "results/tiny/checkpoints/pretrain"
    shutil.rmtree(root)
    small_run(workdir, steps=400)
    proc = subprocess.Popen([SNAKEMAKE, "--cores", "2", "pretrain"], cwd=workdir, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(root.glob("*/latest.json")):
            assert proc.poll() is None, "snakemake ended before training"
            time.sleep(0.2)
        ranks = _pids_running(f"stagetrain.pretrain.train --spec {root / 'job.json'}")
        assert len(ranks) == 3  # torchrun's agent and two ranks, training

        spec_written = (root / "job.json").stat().st_mtime_ns
        live_log = workdir / "results/tiny/logs/pretrain.log"
        logged = live_log.read_text()
        second = snakemake(workdir, "--nolock", "pretrain", check=False)
        holder = json.loads((root / LOCK_NAME).read_text())
        assert second.returncode != 0 and holder["pid"] in ranks
        assert second.stderr.strip().splitlines()[-1] == (
            f"error: {root}: another run of this stage is writing here (pid {holder['pid']} on host "
            f"{holder['host']} since {holder['since']}); wait for it to end or stop it, then rerun"
        )
        # refused before Snakemake deleted the live run's log, and it wrote nothing, not even a job spec
        assert (
            live_log.read_text().startswith(logged)
            and (root / "job.json").stat().st_mtime_ns == spec_written
        )

        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        took = _wait_dead(ranks, 10)
        print(f"SIGKILL of the Snakemake process group to no rank alive: {took} s")
        assert took is not None, f"still running: {[p for p in ranks if alive(p)]}"
    finally:
        for pid in [proc.pid, *ranks]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def lone(shared_runs: SharedRuns) -> dict[str, Any]:
    """The summary of an uninterrupted run, alone on its folder: the session's shared ZeRO-1 run."""
    return shared_runs["zero1"]


def _same_weights(a: dict[str, Any], b: dict[str, Any]) -> None:
    pa, pb = final_params(a), final_params(b)
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@contextlib.contextmanager
def _timed(name: str) -> Iterator[None]:
    began = time.monotonic()
    yield
    print(f"{name}: {time.monotonic() - began:.1f} s")


@pytest.mark.slow
def test_two_runs_at_once_one_trains_the_other_fails_in_one_line(
    data: dict[str, str], lone: dict[str, Any], tmp_path: Path
) -> None:
    """The first run's ranks are stopped (SIGSTOP) while its rank 0 holds the lock, so the
    second run certainly starts while the first is mid-run, whatever the machine's load;
    then the first goes on and must end as a lone run would."""

    def start() -> subprocess.CompletedProcess[str]:
        return launch(data, tmp_path, world=2, layout=LAYOUT, config_changes={"pretrain": STEPS})

    with _timed("two runs at once"):
        winner, loser, ranks = second_run_while_first_holds(
            start, tmp_path / "checkpoints" / LOCK_NAME
        )
    assert len(ranks) == 2, ranks
    assert winner.returncode == 0, winner.stderr[-3000:]
    assert loser.returncode != 0, loser.stderr[-3000:]
    errors = {line for line in loser.stderr.splitlines() if line.startswith("error: ")}
    holder = json.loads((tmp_path / "checkpoints" / LOCK_NAME).read_text())
    assert errors == {
        f"error: {tmp_path / 'checkpoints'}: another run of this stage is writing here (pid {holder['pid']} on "
        f"host {holder['host']} since {holder['since']}); wait for it to end or stop it, then rerun"
    }
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from_step"] == 0 and _steps(tmp_path) == list(range(1, 5))
    assert summary["losses"] == lone["losses"]
    _same_weights(summary, lone)


@pytest.mark.slow
def test_a_rank_killed_while_saving_resumes_from_the_previous_checkpoint(
    data: dict[str, str], lone: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KILL_DURING_SAVE, "1:4")  # rank 1, in its save at step 4
    with _timed("killed in its save"):
        killed = launch(data, tmp_path, world=2, layout=LAYOUT, config_changes={"pretrain": STEPS})
    assert killed.returncode != 0
    (pointer,) = (tmp_path / "checkpoints").glob("*/latest.json")
    checkpoints = pointer.parent
    shard = checkpoints / "step00000004" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert shard.exists()  # rank 1 died in the middle of writing its shard
    with pytest.raises(RuntimeError):
        torch.load(shard, weights_only=False)
    assert json.loads(pointer.read_text())["tag"] == "step00000002"
    monkeypatch.delenv(KILL_DURING_SAVE)
    with _timed("resumed"):
        resumed = run(data, tmp_path, world=2, layout=LAYOUT, config_changes={"pretrain": STEPS})
    assert resumed["resumed_from_step"] == 2 and _steps(tmp_path) == list(range(1, 5))
    assert resumed["losses"] == lone["losses"]
    _same_weights(resumed, lone)
