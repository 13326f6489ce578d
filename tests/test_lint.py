"""The project's own hygiene: ruff, snakemake --lint, and the README commands CI runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.workflow import REPO, SNAKEMAKE

BIN = Path(sys.executable).parent


def test_ruff_is_clean() -> None:
    proc = subprocess.run(
        [str(BIN / "ruff"), "check", "."], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout


def test_snakemake_lint_is_clean() -> None:
    proc = subprocess.run([SNAKEMAKE, "--lint"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Congratulations" in proc.stdout + proc.stderr


def test_ci_runs_the_readme_test_command() -> None:
    """The README opens with the run command and the test command; .ci/run runs the latter."""
    readme = (REPO / "README.md").read_text().splitlines()
    commands = [line for line in readme[:20] if line.startswith("python3.11 -m venv")]
    assert len(commands) == 2, commands
    run, test = commands
    assert "snakemake --cores all" in run
    assert test in (REPO / ".ci" / "run").read_text().splitlines()
