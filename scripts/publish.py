"""publish: push both consolidated models, a model card and the measured layouts to the hub.

Snakemake runs it through the `publish` rule for the optional `publish` target; it writes
publish.json, the receipt (repo, revision, commit, files). The token comes from huggingface_hub's
usual sources (HF_TOKEN, `hf auth login`) and is never written. On its own:
    python scripts/publish.py --config config/config.yaml --plan results/tiny/plan.json \
        --meta results/tiny/data/meta.json --receipt results/tiny/publish.json
(the models and summaries are read from results/<run>/ beside the plan).
"""

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from stagetrain.config.settings import ModelSettings, PublishSettings, RunSettings
from stagetrain.corpus.meta import TokenizerMeta
from stagetrain.errors import StageError
from stagetrain.io import atomic_write_json, read_json
from stagetrain.planning.plan import PlanRecord
from stagetrain.publish.push import card_text, measured_layouts, push
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
    run = RunSettings.from_config(io.sections["run"], "run")
    model = ModelSettings.from_config(io.sections["model"], "model")
    card = card_text(run=run.name, model=model, plan=plan, meta=meta, pretrain=pretrain, grpo=grpo,
                     repo=settings.repo)  # fmt: skip
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


run_stage(
    main,
    snakemake=globals().get("snakemake"),
    doc=__doc__,
    inputs=["plan", "meta"],
    outputs=["receipt"],
    sections=["run", "model", "publish"],
)
