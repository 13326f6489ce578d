"""Fixtures: a workflow copy, a finished small run, the multi-rank tests' comm op, data and runs.

Helpers are imported from the harness package (tests/harness/), not from here.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from harness.configs import apply_config, small_grpo, small_run
from harness.workflow import REPO, copy_workflow, snakemake

from stagetrain.config import read_file

if TYPE_CHECKING:
    from harness.training import SharedRuns

EXAMPLE_FAMILY = read_file(REPO / "config/presets/own-tasks.yaml")["tasks"]["families"][0]
"""The worked example's family, as the own-tasks preset declares it (paths relative to a workflow copy)."""


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A copy of the workflow in a temporary folder, so runs and config edits stay there."""
    return copy_workflow(tmp_path / "wf")


@pytest.fixture(scope="session")
def finished_small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workflow copy whose shrunk default pipeline has run to the end, shared by the tests that
    read it. Its tasks section declares the worked example's family (examples/largest), which
    neither the corpus nor GRPO uses: its data and reward file are inputs all the same."""
    root = copy_workflow(tmp_path_factory.mktemp("finished") / "wf")
    small_run(root, steps=4)
    small_grpo(root)
    apply_config(root / "config/config.yaml", tasks={"families": [EXAMPLE_FAMILY]})
    snakemake(root, "all")
    return root


@pytest.fixture
def finished_copy(finished_small_run: Path, tmp_path: Path) -> Path:
    """A copy of the finished small run, for a test that changes it: its stages rerun only as far
    as the test's edits reach (the hardware is not detected again, nor the tokenizer trained)."""
    shutil.copytree(finished_small_run, tmp_path / "wf", symlinks=True)
    return tmp_path / "wf"


@pytest.fixture(scope="session")
def comm_op() -> None:
    """DeepSpeed's CPU shared-memory comm op, built once in a process of its own before any
    ranks start (as the stage's launcher does); every multi-rank test asks for it."""
    from harness.training import build_comm_op

    build_comm_op()


@pytest.fixture(scope="session")
def data(comm_op: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The small corpus, tokenizer and model config the multi-rank tests share, prepared once
    per session (read only)."""
    from harness.training import prepare_data

    return prepare_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def scoring_start(data: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """A consolidated fp32 model that scores on harness.training.SCORING_FAMILIES, trained once
    per session for the GRPO tests (read only)."""
    from harness.training import scoring_model

    return scoring_model(data, tmp_path_factory.mktemp("scoring"))


@pytest.fixture(scope="session")
def shared_runs(data: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> SharedRuns:
    """Two-rank pretrain runs of each layout in harness.training.SHARED, made on first use and
    shared by test_pretrain_dist, test_consolidate, test_grpo and test_lifecycle (read only)."""
    from harness.training import SharedRuns

    return SharedRuns(data, tmp_path_factory.mktemp("shared-runs"))
