"""What a test run makes once, whether pytest runs in one process or in pytest-xdist's workers.

The suite runs in two xdist workers (pyproject.toml), and each worker is a pytest session of
its own: a plain session fixture would be made once per worker, so the finished small run, the
shared two-rank runs and the scoring model would each be trained twice. `made_once` keeps one
per test run: in a folder every worker of the run shares, under a file lock, the first worker
that asks makes it and the others wait for it and read what it made.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from stagetrain.io import atomic_write_json


def shared_root(factory: pytest.TempPathFactory) -> Path:
    """The temporary folder every worker of this test run sees (the session's own without xdist:
    the parent then holds earlier runs' folders too)."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def made_once(folder: Path, make: Callable[[Path], Any]) -> Any:
    """`make(folder)`'s value (JSON, so that another process can read it), made by the first
    process that asks; a folder a failed `make` left is removed, and the next asker tries again."""
    value_file = folder.with_name(folder.name + ".value.json")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(folder.with_name(folder.name + ".lock")):
        if value_file.exists():
            return json.loads(value_file.read_text())["value"]
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        value = make(folder)
        atomic_write_json(value_file, {"value": value})
        return value
