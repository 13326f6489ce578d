"""One writer per training stage: an exclusive `flock` on <checkpoints>/<stage>/writer.lock.

The lock covers the stage's checkpoint root, not one fingerprint's folder: two
runs of one stage with different configs would still share the stage's declared
outputs (summary.json, metrics, plots), its job.json and its log, so they must
not run at once either. Rank 0 holds it for the whole run (the open file
description it locks is never closed before the process ends), so the kernel
releases it when rank 0 dies, however it dies: there is never a stale lock.
After locking, the holder writes `{"pid", "host", "since"}` into the file (in
place: replacing the file would put a new, unlocked inode in its place), so the
run that finds it taken can say who holds it.

On a network filesystem the lock is as good as the mount's lock support: see
"Process lifetime and locks" in docs/architecture.md. Where the filesystem has
none (flock fails with ENOSYS, ENOLCK, EOPNOTSUPP or EINVAL), taking it is a
one-line error rather than a warning: a run that silently went on unlocked
would bring back the two-writers corruption this lock exists to prevent.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path

from stagetrain.errors import StageError

LOCK_NAME = "writer.lock"
UNSUPPORTED = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL}


class StageLock:
    """The exclusive lock of one stage's checkpoint root; `acquire` holds it until the process ends."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock without waiting and record this process in it.

        Raises:
            StageError: another process holds it (one line naming the folder and
                the holder's pid and host), or the filesystem cannot lock.
        """
        fd = self._lock()
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder, sort_keys=True) + "\n").encode(), 0)
            os.fsync(fd)
        except OSError as err:
            os.close(fd)
            raise StageError(
                f"{self.path}: cannot record the holder in the lock file ({err.strerror})"
            ) from None
        self._fd = fd

    def check_free(self) -> None:
        """Fail now, the way `acquire` would, if another process holds the lock; leave it free.

        A launcher calls this before it writes anything, so a second run fails
        before its ranks start; the lock the ranks then take is what counts.
        """
        os.close(self._lock())  # closing the only descriptor of this open file releases it

    def _lock(self) -> int:
        """A descriptor of the lock file, locked exclusively; a StageError if that cannot be."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise StageError(f"{self.path}: cannot open the lock file ({err.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(os.pread(fd, 4096, 0))
            os.close(fd)
            raise StageError(
                f"{self.root}: another run of this stage is writing here ({holder}); "
                "wait for it to end or stop it, then rerun"
            ) from None
        except OSError as err:
            os.close(fd)
            if err.errno in UNSUPPORTED:
                raise StageError(
                    f"{self.path}: this filesystem cannot lock files (flock: {os.strerror(err.errno)}), so two runs "
                    "could write one checkpoint folder; mount it with lock support (Lustre: -o flock) or put "
                    "results/ on a filesystem that has it"
                ) from None
            raise StageError(
                f"{self.path}: cannot lock the lock file (flock: {err.strerror or err})"
            ) from None
        return fd


def refuse_while_running(checkpoints: Path, stages: Iterable[str]) -> None:
    """Raise `acquire`'s one line if a run of any of `stages` holds its lock under `checkpoints`.

    Snakemake calls it before it touches any output (workflow/rules/common.smk): it deletes a
    job's log and outputs before the job starts, so a second run under --nolock wiped the live
    run's log and metrics before the stage's own refusal. Creates nothing where no lock exists.
    """
    for stage in stages:
        if (checkpoints / stage / LOCK_NAME).exists():
            StageLock(checkpoints / stage).check_free()


def _holder(raw: bytes) -> str:
    """`pid 1234 on host node7 since ...` from the lock file's content, or why it is unknown."""
    try:
        holder = json.loads(raw)
        return f"pid {holder['pid']} on host {holder['host']} since {holder['since']}"
    except (ValueError, KeyError, TypeError):
        return "holder not recorded yet"
