"""The workflow used from another workflow, as Snakemake users reuse a pipeline: a `module`
statement pointing at a local copy, its config passed in, every rule renamed with a prefix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from harness.workflow import REPO, copy_workflow, snakemake

pytestmark = pytest.mark.slow

USING = """\
configfile: "config/stagetrain.yaml"


module stagetrain:
    snakefile:
        "{snakefile}"
    config:
        config


use rule * from stagetrain as stagetrain_*
"""


def test_another_workflow_uses_it_as_a_module_and_plans(tmp_path: Path) -> None:
    """Run in the using workflow's folder: the config is that workflow's (no config/config.yaml
    of ours is read), the results land there, and the module's scripts are found beside its
    Snakefile, not the user's."""
    module = copy_workflow(tmp_path / "stagetrain")
    user = tmp_path / "analysis"
    (user / "config").mkdir(parents=True)
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["run"]["name"] = "mine"
    (user / "config/stagetrain.yaml").write_text(yaml.safe_dump(config))
    (user / "Snakefile").write_text(USING.format(snakefile=module / "Snakefile"))
    shutil.rmtree(module / "config")  # the module's own default is never the one used

    dry = snakemake(user, "-n", "stagetrain_all").stdout
    for rule in ("stagetrain_detect_hardware", "stagetrain_plan_parallelism", "stagetrain_all"):
        assert rule in dry, dry[-2000:]
    snakemake(user, "stagetrain_plan")
    plan = json.loads((user / "results/mine/plan.json").read_text())
    assert set(plan["stages"]) == {"pretrain", "grpo"}
    assert (user / "results/mine/deepspeed/grpo.json").exists()
    assert not (module / "results").exists()
