"""publish: push both consolidated models, a model card and the measured layouts to the hub.

Snakemake runs it through the `publish` rule for the optional `publish` target; it writes
publish.json, the receipt (repo, revision, commit, files). The token comes from huggingface_hub's
usual sources (HF_TOKEN, `hf auth login`) and is never written. On its own:
    python scripts/publish.py --config config/config.yaml --plan results/tiny/plan.json \
        --meta results/tiny/data/meta.json --metrics results/tiny/grpo/metrics.jsonl \
        --receipt results/tiny/publish.json
(the models and summaries are read from results/<run>/ beside the plan).
"""

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from stagetrain.config.settings import (
    GrpoSettings,
    ModelSettings,
    PublishSettings,
    RunSettings,
    TasksSettings,
)
from stagetrain.corpus.meta import TokenizerMeta
from stagetrain.errors import StageError
from stagetrain.io import atomic_write_json, json_lines, read_json
from stagetrain.planning.plan import PlanRecord
from stagetrain.publish.card import RunRecords, card_text, prompting
from stagetrain.publish.push import measured_layouts, push
from stagetrain.workflow.stage import StageIO, run_stage

if TYPE_CHECKING:  # the types alone: publishing imports no training code (nor torch)
    from stagetrain.grpo.summary import GrpoSummary
    from stagetrain.pretrain.summary import PretrainSummary

log = logging.getLogger("stagetrain")
STAGES = ("pretrain", "grpo")


def main(io: StageIO) -> None:
    settings = PublishSettings.from_config(io.sections["publish"], "publish")
    if settings.repo is None:
        raise StageError(
            "publish.repo: expected the hub repo to push to (namespace/name); none is set"
        )
    results = Path(io.inputs["plan"]).parent
    plan: PlanRecord = read_json(io.inputs["plan"])
    meta: TokenizerMeta = read_json(io.inputs["meta"])
    pretrain: PretrainSummary = read_json(results / "pretrain/summary.json")
    grpo: GrpoSummary = read_json(results / "grpo/summary.json")
    layouts = measured_layouts(plan, pretrain["layout"])
    if not layouts:
        log.info(
            "%s: a run on CPU ranks measures no GPU layout; %s is not written",
            settings.repo,
            "parallelism_data.json",
        )
    s = io.sections
    tasks = TasksSettings.from_config(s["tasks"], "tasks")
    records = RunRecords(
        run=RunSettings.from_config(s["run"], "run").name, repo=settings.repo, license=settings.license,
        model=ModelSettings.from_config(s["model"], "model"), grpo_settings=GrpoSettings.from_config(s["grpo"], "grpo"),
        tasks=tasks, prompting=prompting(tasks, results / "model/grpo"), plan=plan, meta=meta, pretrain=pretrain, grpo=grpo,
        generated_tokens=generated_tokens(Path(io.inputs["metrics"])), evaluations=evaluations(results),
    )  # fmt: skip
    card = card_text(records)
    receipt = push(repo=settings.repo, revision=settings.revision, private=settings.private,
                   models={stage: results / "model" / stage for stage in STAGES}, card=card, layouts=layouts)  # fmt: skip
    log.info(
        "pushed %d files to %s@%s: commit %s",
        len(receipt["files"]),
        receipt["repo"],
        receipt["revision"],
        receipt["commit"],
    )
    atomic_write_json(io.outputs["receipt"], receipt)


def generated_tokens(metrics: Path) -> int:
    """The completion tokens GRPO generated: its metrics' `rollout/generated_tokens`, summed over
    the steps (each step's record is one line)."""
    with open(metrics, "rb") as lines:
        return sum(
            int(v.get("rollout/generated_tokens", 0)) for _, v in json_lines(lines, str(metrics))
        )


def evaluations(results: Path) -> dict[str, dict]:
    """The `evaluate` target's results by stage, for the stages it evaluated (none: {})."""
    return {s: read_json(results / "evaluate" / f"{s}.json") for s in STAGES
            if (results / "evaluate" / f"{s}.json").exists()}  # fmt: skip


run_stage(
    main,
    snakemake=globals().get("snakemake"),
    doc=__doc__,
    inputs=["plan", "meta", "metrics"],
    outputs=["receipt"],
    sections=["run", "model", "grpo", "tasks", "publish"],
)
