"""evaluate: lm-evaluation-harness on a stage's consolidated model; evaluate/<stage>.json, .tsv, .html.

Snakemake runs it through the `evaluate_model` rule (wildcard: stage) for the optional
`evaluate` target. The run's held-out problems become local lm-eval tasks scored by its own
rewards (stagetrain.evaluate.lmeval), run beside the lm-eval tasks `evaluate.tasks` names, offline.
On its own:
    python scripts/evaluate.py --config config/config.yaml --stage grpo \
        --model results/tiny/model/grpo --meta results/tiny/data/meta.json \
        --evaluation results/tiny/evaluate/grpo.json --table results/tiny/evaluate/grpo.tsv \
        --page results/tiny/evaluate/grpo.html
"""

import logging
from pathlib import Path

from stagetrain.config.settings import (
    DataSettings,
    EvaluateSettings,
    GrpoSettings,
    RunSettings,
    TasksSettings,
)
from stagetrain.evaluate.lmeval import Run, StageEvaluation, evaluate, table, table_page
from stagetrain.io import atomic_write_json, atomic_write_text, read_json
from stagetrain.tasks.families import held_out_families, hub_pins
from stagetrain.workflow.stage import StageIO, run_stage, training_stage

log = logging.getLogger("stagetrain")
smk = globals().get("snakemake")
STAGE = training_stage(smk)


def main(io: StageIO) -> None:
    s = io.sections
    settings = EvaluateSettings.from_config(s["evaluate"], "evaluate")
    grpo = GrpoSettings.from_config(s["grpo"], "grpo")
    families = held_out_families(grpo, DataSettings.from_config(s["data"], "data"),
                                 TasksSettings.from_config(s["tasks"], "tasks"))  # fmt: skip
    # run.json keeps the tasks section as the config gives it; the rest as its settings have it
    run = Run(model=str(Path(io.inputs["model"]).resolve()), tasks=s["tasks"], families=families,
              levels=list(settings.levels), problems=settings.problems,
              seed=RunSettings.from_config(s["run"], "run").seed, max_prompt_len=grpo.max_prompt_len,
              max_new_tokens=grpo.max_new_tokens, pins=hub_pins(read_json(io.inputs["meta"])))  # fmt: skip
    # The task files beside the outputs (not outputs themselves: they are the means).
    folder = Path(io.outputs["evaluation"]).parent / f".tasks-{STAGE}"
    doc = evaluate(run, folder, settings.tasks, settings.batch_size)
    for family, levels in doc["accuracy"].items():
        for level, e in levels.items():
            log.info(
                "%s level %s: %.3f (se %.3f) on %d problems",
                family,
                level,
                e["accuracy"],
                e["se"],
                e["problems"],
            )
    tsv = table(doc)
    atomic_write_text(io.outputs["table"], tsv)
    atomic_write_text(io.outputs["page"], table_page(tsv, STAGE))
    evaluation = StageEvaluation(stage=STAGE, model=io.inputs["model"], problems=run.problems,
                                 seed=run.seed, **doc)  # fmt: skip
    atomic_write_json(io.outputs["evaluation"], evaluation)


run_stage(
    main,
    snakemake=smk,
    doc=__doc__,
    inputs=["model", "meta"],
    outputs=["evaluation", "table", "page"],
    sections=["run", "data", "tasks", "grpo", "evaluate"],
)
