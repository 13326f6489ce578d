"""Processes of a run as /proc shows them: alive or not, a parent, the ranks of a lock's holder."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def parent(pid: int) -> int | None:
    """The parent pid of `pid`, None once it is gone."""
    with contextlib.suppress(FileNotFoundError, IndexError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return None


def holder_ranks(lock: Path, run: Future, timeout: float = 300) -> list[int]:
    """The pids of the ranks of the run whose rank 0 holds `lock` (its pid is written there),
    once it holds it; rank 0's siblings are the other ranks of its torchrun agent."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not run.done():
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError, KeyError):
            holder = json.loads(lock.read_text())["pid"]
            if alive(holder):
                agent = parent(holder)
                return [int(p.name) for p in Path("/proc").iterdir()
                        if p.name.isdigit() and parent(int(p.name)) == agent]  # fmt: skip
        time.sleep(0.05)
    raise AssertionError(
        f"the first run never held {lock}: {run.result().stderr[-3000:] if run.done() else 'timeout'}"
    )


def second_run_while_first_holds(
    launch: Callable[[], Any], lock: Path
) -> tuple[Any, Any, list[int]]:
    """(the first run's result, the second's, the first's ranks): the first run's ranks are
    stopped (SIGSTOP) while its rank 0 holds `lock`, so the second certainly starts while the
    first is mid-run, whatever the machine's load; then the first goes on to its end."""
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(launch)
        ranks = holder_ranks(lock, first)
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        try:
            second = launch()
        finally:
            for pid in ranks:
                os.kill(pid, signal.SIGCONT)
        return first.result(), second, ranks
