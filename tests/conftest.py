"""Fixtures: a workflow copy, a finished small run, the multi-rank tests' data and runs.

Helpers are imported from the harness package (tests/harness/), not from here.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from harness import workflow
from harness.configs import apply_config, small_grpo, small_run
from harness.sessions import made_once, shared_root
from harness.workflow import REPO, copy_workflow, snakemake

from stagetrain.config.validation import read_file

if TYPE_CHECKING:
    from harness.training import SharedRuns

SHARED_UNITS = {"test_cluster.py": "slurm", "test_multinode.py": "slurm"}
"""Modules one xdist worker runs together: the Slurm tests, so that the two clusters' jobs do
not run beside each other's."""
LONGEST_FIRST = (
    "test_default_run.py", "test_elastic.py", "test_commands.py", "slurm", "test_workflow.py",
    "test_grpo.py", "test_pretrain_dist.py", "test_reruns.py", "test_experts.py",
    "test_consolidate.py", "test_lifecycle.py", "test_grpo_tasks.py",
)  # fmt: skip
"""The units of work that take longest, measured (docs/development.md): the workers take them
first, so that the suite does not end waiting for one long test that started last."""

EXAMPLE_FAMILY = read_file(REPO / "config/presets/own-tasks.yaml")["tasks"]["families"][0]
"""The worked example's family, as the own-tasks preset declares it (paths relative to a workflow copy)."""


def unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, or its SHARED_UNITS group."""
    module = Path(nodeid.split("::", 1)[0]).name
    return SHARED_UNITS.get(module, module)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest units first; xdist's workers take units in this order."""
    rank = {name: at for at, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(unit(item.nodeid), len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scheduler by scope, with `unit` as the scope: one worker runs the whole of a
    unit, so that a module fixture is made once. (xdist's own `loadgroup` marks its groups by
    rewriting node ids, which pytest 9 no longer reads: its groups were split over workers.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit(nodeid)

    return ByUnit(config, log)


@pytest.fixture(scope="session", autouse=True)
def kept_shapes(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The model shapes every workflow copy of this test run starts with (harness.workflow)."""
    folder = shared_root(tmp_path_factory) / "shapes"
    folder.mkdir(parents=True, exist_ok=True)
    workflow.kept_shapes = folder


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A copy of the workflow in a temporary folder, so runs and config edits stay there."""
    return copy_workflow(tmp_path / "wf")


@pytest.fixture(scope="session")
def finished_small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workflow copy whose shrunk default pipeline has run to the end, shared by the tests that
    read it. Its tasks section declares the worked example's family (examples/largest), which
    neither the corpus nor GRPO uses: its data and reward file are inputs all the same."""

    def make(folder: Path) -> str:
        root = copy_workflow(folder / "wf")
        small_run(root, steps=4)
        small_grpo(root)
        apply_config(root / "config/config.yaml", tasks={"families": [EXAMPLE_FAMILY]})
        snakemake(root, "all")
        return str(root)

    return Path(made_once(shared_root(tmp_path_factory) / "finished", make))


@pytest.fixture
def finished_copy(finished_small_run: Path, tmp_path: Path) -> Path:
    """A copy of the finished small run, for a test that changes it: its stages rerun only as far
    as the test's edits reach (the hardware is not detected again, nor the tokenizer trained)."""
    shutil.copytree(finished_small_run, tmp_path / "wf", symlinks=True)
    return tmp_path / "wf"


@pytest.fixture(scope="session")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The small corpus, tokenizer and model config the multi-rank tests share, prepared once
    per session (read only)."""
    from harness.training import prepare_data

    return made_once(shared_root(tmp_path_factory) / "data", prepare_data)


@pytest.fixture(scope="session")
def scoring_start(data: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """A consolidated fp32 model that scores on harness.training.SCORING_FAMILIES, trained once
    per session for the GRPO tests (read only)."""
    from harness.training import scoring_model

    return made_once(
        shared_root(tmp_path_factory) / "scoring", lambda folder: scoring_model(data, folder)
    )


@pytest.fixture(scope="session")
def shared_runs(data: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> SharedRuns:
    """Two-rank pretrain runs of each layout in harness.training.SHARED, made on first use and
    shared by test_pretrain_dist, test_consolidate, test_grpo and test_lifecycle (read only)."""
    from harness.training import SharedRuns

    return SharedRuns(data, shared_root(tmp_path_factory) / "shared-runs")
