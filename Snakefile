# stagetrain: one config, one command, from bare hardware to a trained model.
#
# results/<run.name>/
#   hardware.json                 detect_hardware (a checkpoint)
#   plan.json                     plan_parallelism
#   plan/{vocab,pretrain,grpo}.json   plan_part
#   tokenizer/ data/ model_config.json   prepare_tokenizer
#   deepspeed/{pretrain,grpo}.json       render_deepspeed_config
#   pretrain/summary.json         pretrain
#   model/pretrain/               consolidate
#   grpo/summary.json             grpo
#   model/grpo/                   consolidate: the pipeline's product
#   evaluate/{pretrain,grpo}.json  evaluate_model (the optional `evaluate` target)
#   publish.json                  publish (optional: models, card and layouts pushed to the hub)
#   logs/<rule>.log  benchmarks/<rule>.tsv
from snakemake.utils import min_version

min_version("9.0")

from stagetrain.config import files as configfiles


# A config file given with --configfile stands on its own: every key it leaves
# out takes the schema's default, never config/config.yaml's. The embedded
# default runs only when no --configfile is given (config/README.md), and not
# when another workflow uses this one as a module with its own config.
if not workflow.overwrite_configfiles and not workflow.modifier.skip_configfile:
    configfiles.check(["config/config.yaml"])

    configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/detect_hardware.smk"
include: "workflow/rules/plan_parallelism.smk"
include: "workflow/rules/prepare_tokenizer.smk"
include: "workflow/rules/render_deepspeed_config.smk"
include: "workflow/rules/pretrain.smk"
include: "workflow/rules/consolidate.smk"
include: "workflow/rules/grpo.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/publish.smk"


# Quick steps that may reach the hub (login nodes have a network, compute nodes
# often do not) run where Snakemake runs, never as cluster jobs.
localrules:
    all,
    plan,
    plan_parallelism,
    plan_part,
    publish,
    render_deepspeed_config,


rule all:
    default_target: True
    input:
        f"{RUN}/model/grpo",
        # The whole plan's record: no stage reads it, and a DAG that finds it current reads
        # the plan from it instead of working it out again.
        rules.plan_parallelism.output.plan,


rule plan:
    input:
        rules.detect_hardware.output.hardware,
        rules.plan_parallelism.output.plan,
        expand(f"{RUN}/deepspeed/{{stage}}.json", stage=TRAINING_STAGES),


# Optional: lm-evaluation-harness on both consolidated models (pip install 'stagetrain[eval]').
rule evaluate:
    input:
        expand(f"{RUN}/evaluate/{{stage}}.json", stage=TRAINING_STAGES),
