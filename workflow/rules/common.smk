import functools
import json
import os
import sys
from pathlib import Path

from snakemake.common.tbdstring import TBDString
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

import stagetrain
from stagetrain import config as stconfig
from stagetrain import configfiles, slurm
from stagetrain.codedeps import code_digest
from stagetrain.errors import StageError
from stagetrain.training.lock import refuse_while_running
from stagetrain.inputs import local_inputs
from stagetrain.settings import training_settings
from stagetrain.tasks.families import data_part

# Snakemake's YAML loader keeps the last of two equal keys without a word, and
# its validator crashes on a section of the wrong type: check every config file
# strictly first, so each mistake is one line naming the key.
configfiles.check(workflow.configfiles)
try:
    stconfig.validate(config)
except StageError as _err:
    sys.exit(f"error: {_err}")
validate(config, "../schemas/config.schema.yaml")
# Every local file a stage reads is a declared input (resolved here, once): an
# edited file reruns the stage, a missing one is one line naming its key.
try:
    LOCAL_INPUTS = local_inputs(config)
except StageError as _err:
    sys.exit(f"error: {_err}")

RUN = f"results/{config['run']['name']}"
# The workflow's own folder (this file is workflow/rules/common.smk in it): workflow.basedir
# is the using workflow's when another one uses this as a module.
WORKFLOW_ROOT = Path(workflow.current_basedir).parents[1]
TRAINING_STAGES = ["pretrain", "grpo"]
# The keys of each section that shape the plan: editing any other key of these
# sections (a learning rate, a curriculum threshold) must not replan.
PLAN_KEYS = {
    "tokenizer": ["vocab_size"],
    "pretrain": ["seq_len", "global_batch_size", "global_batch_unit"],
    "grpo": ["prompts_per_step", "group_size", "max_prompt_len", "max_new_tokens", "kl_coef"],
}


wildcard_constraints:
    stage="|".join(TRAINING_STAGES),


# Before Snakemake deletes any job's outputs and log: with --nolock, a second run of a
# training stage would otherwise wipe the live run's log and metrics before the stage's
# own lock could refuse it. Runs only when jobs are to run (not on -n).
onstart:
    try:
        refuse_while_running(Path(RUN).resolve() / "checkpoints", TRAINING_STAGES)
    except StageError as _err:
        sys.exit(f"error: {_err}")


def all_cores():
    """Every core Snakemake was given: the training ranks use them all.

    --unlock, --report and --dag run no job and need no --cores, but
    workflow.cores refuses to answer without one; 1 stands in for them.
    """
    try:
        return workflow.cores
    except WorkflowError:
        return 1


# `snakemake --report` refuses a target whose report plots do not all exist ("... marked for
# report but does not exist"), as after a run that stopped before GRPO: while a report is
# written (and no run comes first), only the plots that exist are marked, so it shows those.
REPORT_ONLY = any(a == "--report" or a.startswith("--report=") for a in sys.argv) and (
    "--report-after-run" not in sys.argv
)


def reported(path, **options):
    """`report(path, ...)`, except while writing a report of a run that did not make `path`."""
    if REPORT_ONLY and not Path(path).exists():
        return path
    return report(path, **options)


def logged(rule_name):
    """The log path of a rule."""
    return f"{RUN}/logs/{rule_name}.log"


def benchmarked(rule_name):
    """The benchmark path of a rule."""
    return f"{RUN}/benchmarks/{rule_name}.tsv"


def get_plan_section(section):
    """Only the keys of `section` the planner reads."""
    return {key: config[section][key] for key in PLAN_KEYS[section]}


def code_of(script):
    """A digest of scripts/<script>.py and every stagetrain module it reaches: a rule param,
    so an edited library module reruns exactly the stages that run it."""
    root = Path(stagetrain.__file__).resolve().parent.parent
    return code_digest(WORKFLOW_ROOT / "scripts" / f"{script}.py", root)


def get_vocab_padding(wildcards):
    """plan/vocab.json: the tp the tokenizer stage pads the vocabulary for, not the whole plan."""
    return checkpoints.plan_parallelism.get().output.vocab


def get_stage_plan(wildcards):
    """plan/<stage>.json: a training stage's own layout and the run-wide facts, not the other stage's."""
    return getattr(checkpoints.plan_parallelism.get().output, f"{wildcards.stage}_plan")


def get_plan_of(stage):
    """get_stage_plan for a rule that is one stage (no stage wildcard)."""
    return lambda wildcards: getattr(checkpoints.plan_parallelism.get().output, f"{stage}_plan")


def get_table(wildcards):
    """The local parallelism table the planner reads, if any."""
    return LOCAL_INPUTS["table"]


def get_corpus_files(wildcards):
    """The files of the data.files globs, the task files and a local pretrained tokenizer."""
    return [*LOCAL_INPUTS["data_files"], *LOCAL_INPUTS["task_files"], *LOCAL_INPUTS["tokenizer"]]


def get_task_files(wildcards):
    """The local files of tasks.families: GRPO draws its prompts from them."""
    return LOCAL_INPUTS["task_files"]


def get_reward_files(wildcards):
    """The files of the tasks' reward functions: editing one reruns GRPO, nothing upstream (and
    GRPO's checkpoint fingerprint holds their content, so the edit retrains, not resumes)."""
    return LOCAL_INPUTS["reward_files"]


def get_tasks_data():
    """What the corpus stage reads of the tasks section: its problems, not its rewards."""
    return data_part(config["tasks"])


def get_init_config(wildcards):
    """The non-weight files of a local model.init_from folder: its config shapes plan and tokenizer."""
    return LOCAL_INPUTS["init_from_config"]


def get_init_model(wildcards):
    """Every file of a local model.init_from folder: pretraining starts from its weights."""
    return LOCAL_INPUTS["init_from"]


def get_training(wildcards):
    """The optimizer and optimizer-step count of one training stage, for its DeepSpeed config."""
    stage = wildcards.stage
    steps = training_settings(stage, config[stage]).optimizer_steps
    return {"steps": steps, "optimizer": config[stage]["optimizer"]}


def plan_resources(stage):
    """The Slurm resources of a stage's job, read from plan.json just before submission (the
    whole plan: the runtime needs the predicted step time, which the stage's part leaves out).

    Training stages get nodes, tasks, CPUs, GPUs, memory and (pretrain on GPUs)
    runtime; consolidation its memory. Before planning (a dry run of a fresh run)
    each is Snakemake's <TBD>.
    """

    def read(key):
        def resource(wildcards, input):
            if not os.path.exists(input.plan):
                return TBDString()
            whole = f"{RUN}/plan.json"  # the part less its estimates (planning.derived)
            return _stage_resources(stage, whole, os.stat(whole).st_mtime_ns)[key]

        return resource

    keys = ["mem_mb"] if stage == "consolidate" else slurm.TRAINING_RESOURCES
    return {key: read(key) for key in keys}


@functools.lru_cache(maxsize=16)
def _stage_resources(stage, plan_path, plan_mtime_ns):
    """All of a stage's resources at once: each resource function asks for one key,
    and plan.json and hardware.json are read once per plan version, not once per key."""
    plan = json.loads(Path(plan_path).read_text())
    if stage == "consolidate":
        return {"mem_mb": slurm.consolidate_mem_mb(plan, config["consolidate"])}
    cores = json.loads(Path(f"{RUN}/hardware.json").read_text())["cpu"]["cores"]
    return slurm.job_resources(plan, stage, cores, training_settings(stage, config[stage]).optimizer_steps)
