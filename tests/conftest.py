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


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A copy of the workflow in a temporary folder, so runs and config edits stay there."""
    root = tmp_path / "wf"
    root.mkdir()
    for part in WORKFLOW_PARTS:
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, root / part)
        else:
            shutil.copy(src, root / part)
    return root


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


def edit_config(workdir: Path, section: str, **changes: Any) -> None:
    """Change keys of one section of the workdir's config.yaml (nested keys as dicts)."""
    path = workdir / "config" / "config.yaml"
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


def small_run(workdir: Path, steps: int = 12) -> None:
    """Shrink the default config so the training stages take seconds."""
    edit_config(workdir, "data", train_tokens=30_000, val_tokens=3_000)
    edit_config(workdir, "tokenizer", training_sample_mb=0.2)
    edit_config(workdir, "pretrain", seq_len=32, global_batch_size=8, steps=steps, log_every=1, eval_every=4,
                checkpoint_every=4, eval_batches=2, optimizer={"warmup_steps": 2})  # fmt: skip
