"""Shared helpers: the default config, and a scratch copy of the workflow to run Snakemake in."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from stagetrain import config as stconfig

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
WORKFLOW_PARTS = ("Snakefile", "workflow", "config", "scripts", "profiles")


def default_config() -> dict[str, Any]:
    """The embedded default config, validated, defaults filled."""
    return stconfig.load(REPO / "config" / "config.yaml")


def copy_workflow(root: Path) -> Path:
    """Copy the workflow into `root` (created), so runs and config edits stay there."""
    root.mkdir(parents=True)
    for part in WORKFLOW_PARTS:
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, root / part)
        else:
            shutil.copy(src, root / part)
    return root


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A copy of the workflow in a temporary folder, so runs and config edits stay there."""
    return copy_workflow(tmp_path / "wf")


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the real Snakemake in `workdir`; fail the test with its output if `check` and it fails."""
    proc = subprocess.run(
        [SNAKEMAKE, "--cores", "2", *args],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"snakemake {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def edit_config(
    workdir: Path, section: str, *, file: str = "config/config.yaml", **changes: Any
) -> None:
    """Change keys of one section of a config file of the workdir (nested keys as dicts)."""
    path = workdir / file
    data = yaml.safe_load(path.read_text())

    def merge(into: dict[str, Any], new: dict[str, Any]) -> None:
        for key, value in new.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                merge(into[key], value)
            else:
                into[key] = value

    data.setdefault(section, {})
    merge(data[section], changes)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def small_run(workdir: Path, steps: int = 12, *, file: str = "config/config.yaml") -> None:
    """Shrink a config (the default one unless `file` says) so the training stages take seconds."""
    edit_config(workdir, "data", file=file, train_tokens=30_000, val_tokens=3_000)
    edit_config(workdir, "tokenizer", file=file, training_sample_mb=0.2)
    edit_config(workdir, "pretrain", file=file, seq_len=32, global_batch_size=8, steps=steps, log_every=1,
                eval_every=4, checkpoint_every=4, eval_batches=2, optimizer={"warmup_steps": 2})  # fmt: skip


def small_grpo(workdir: Path, *, file: str = "config/config.yaml") -> None:
    """Shrink the GRPO stage of a config to two steps of a few short rollouts."""
    edit_config(workdir, "grpo", file=file, steps=2, prompts_per_step=4, group_size=4, max_new_tokens=8,
                eval_problems=8, eval_every=2, checkpoint_every=2, eval_batches=1,
                optimizer={"warmup_steps": 1})  # fmt: skip


@pytest.fixture(scope="session")
def finished_small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workflow copy whose shrunk default pipeline has run to the end, shared by the tests that read it."""
    root = copy_workflow(tmp_path_factory.mktemp("finished") / "wf")
    small_run(root, steps=4)
    small_grpo(root)
    snakemake(root, "all")
    return root


@pytest.fixture(scope="session")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The small corpus, tokenizer and model config the multi-rank tests share, prepared once
    per session (read only), after DeepSpeed's CPU comm op is built, before any ranks start."""
    from pretrain_harness import build_comm_op, prepare_data

    build_comm_op()
    return prepare_data(tmp_path_factory.mktemp("data"))


def kill_after_checkpoint(workdir: Path, stage: str, step: int, *targets: str) -> None:
    """Start Snakemake on `targets`, SIGKILL it and every process under it once `stage` has a
    complete checkpoint at or past `step`, and wait for it to die."""
    import contextlib
    import json
    import os
    import signal
    import time

    import psutil

    proc = subprocess.Popen([SNAKEMAKE, "--cores", "2", *targets], cwd=workdir, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    pointer = workdir / f"results/tiny/checkpoints/{stage}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not any(
        json.loads(p.read_text())["step"] >= step for p in pointer.glob("*/latest.json")
    ):
        time.sleep(0.2)
    victims = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    for pid in victims:  # torchrun starts its ranks in sessions of their own: kill each one
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
