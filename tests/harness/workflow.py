"""The workflow run by the real Snakemake in a scratch copy: the default config, the copy, the run."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import pytest

from stagetrain.config import validation as stconfig

REPO = Path(__file__).resolve().parents[2]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
CLUSTER_SNAKEMAKE = [sys.executable, str(Path(__file__).with_name("cluster_snakemake.py"))]
"""Snakemake for a run that submits to a cluster: its status checks at a fixed short interval."""
WORKFLOW_PARTS = ("Snakefile", "workflow", "config", "scripts", "profiles", "examples")
SHAPES = Path(".snakemake/stagetrain-shapes")
"""Where a workflow copy keeps the model shapes its planner counted (planning/shape.py)."""
kept_shapes: Path | None = None
"""The shapes every run of this test run counted (set by conftest): each copy starts with them,
so that Snakemake's process imports torch for the planner once per model in a test run, not once
per copy; each is keyed by everything it was counted from, so none is served for another model."""


def default_config() -> dict[str, Any]:
    """The embedded default config, validated, defaults filled."""
    return stconfig.load(REPO / "config" / "config.yaml")


def checked(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` validated and checked as the workflow checks it before any rule
    (`workflow.checks`, what `snakemake -n` runs): its filled copy, or the one line."""
    from stagetrain.config.settings import Settings
    from stagetrain.workflow import checks

    filled = stconfig.validate(config)
    checks.check(Settings.from_config(filled))
    return filled


def copy_workflow(root: Path) -> Path:
    """Copy the workflow into `root` (created), so runs and config edits stay there."""
    root.mkdir(parents=True)
    for part in WORKFLOW_PARTS:
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, root / part)
        else:
            shutil.copy(src, root / part)
    if kept_shapes is not None:
        shutil.copytree(kept_shapes, root / SHAPES)
    return root


def _keep_shapes(workdir: Path) -> None:
    """Add the shapes a run in `workdir` counted to `kept_shapes`."""
    if kept_shapes is None or not (workdir / SHAPES).is_dir():
        return
    for shape in (workdir / SHAPES).glob("*.json"):
        if not (kept_shapes / shape.name).exists():
            partial = kept_shapes / f".{shape.name}.{os.getpid()}"
            shutil.copy(shape, partial)
            partial.replace(kept_shapes / shape.name)


def snakemake(
    workdir: Path, *args: str, check: bool = True, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run the real Snakemake in `workdir`; fail the test with its output if `check` and it fails.
    A run with a workflow profile (a cluster's) polls its jobs as CLUSTER_SNAKEMAKE does."""
    command = CLUSTER_SNAKEMAKE if "--workflow-profile" in args else [SNAKEMAKE]
    proc = subprocess.run(
        [*command, "--cores", "2", *args],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    _keep_shapes(workdir)
    if check and proc.returncode != 0:
        pytest.fail(
            f"snakemake {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def kill_after_checkpoint(workdir: Path, stage: str, step: int, *targets: str) -> None:
    """Start Snakemake on `targets`, SIGKILL it and every process under it once `stage` has a
    complete checkpoint at or past `step`, and wait for it to die. Fails the test, with the
    stage's log, if Snakemake ends or 300 s pass first."""
    proc = subprocess.Popen([SNAKEMAKE, "--cores", "2", *targets], cwd=workdir, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    pointer = workdir / f"results/tiny/checkpoints/{stage}"
    deadline = time.monotonic() + 300

    def reached() -> bool:
        return any(json.loads(p.read_text())["step"] >= step for p in pointer.glob("*/latest.json"))

    while time.monotonic() < deadline and proc.poll() is None and not reached():
        time.sleep(0.2)
    if not reached():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the ranks follow (PR_SET_PDEATHSIG)
        log = workdir / f"results/tiny/logs/{stage}.log"
        pytest.fail(f"{stage} never saved step {step} (snakemake exit {proc.wait()}):\n"
                    f"{log.read_text()[-4000:] if log.exists() else 'no log'}")  # fmt: skip
    victims = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    for pid in victims:  # torchrun starts its ranks in sessions of their own: kill each one
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
