import collections
import functools
import glob
import json
import os
import re
import sys
from pathlib import Path

from snakemake.common.tbdstring import TBDString
from snakemake.exceptions import IncompleteCheckpointException, WorkflowError
from snakemake.utils import validate

import stagetrain
from stagetrain.config import validation as stconfig
from stagetrain.workflow import checks
from stagetrain.config import files as configfiles
from stagetrain.workflow import slurm
from stagetrain.workflow.codedeps import code_digest
from stagetrain.errors import StageError
from stagetrain.training.lock import refuse_while_running
from stagetrain.config.inputs import local_inputs
from stagetrain.planning.ahead import inputs_key, plan_ahead, planner_sections
from stagetrain.planning.derived import digest, part_of
from stagetrain.tasks.families import data_part, held_out_families

# Snakemake's YAML loader keeps the last of two equal keys without a word, and
# its validator crashes on a section of the wrong type: check every config file
# strictly first, so each mistake is one line naming the key.
configfiles.check(workflow.configfiles)
# The typed settings, built once, then the checks no schema can make (workflow.checks).
try:
    SETTINGS = stconfig.settings(config)
    checks.check(SETTINGS)
except StageError as _err:
    sys.exit(f"error: {_err}")
validate(config, "../schemas/config.schema.yaml")
# Every local file a stage reads is a declared input (resolved here, once): an
# edited file reruns the stage, a missing one is one line naming its key.
try:
    LOCAL_INPUTS = local_inputs(SETTINGS)
except StageError as _err:
    sys.exit(f"error: {_err}")

RUN = f"results/{config['run']['name']}"
HARDWARE = f"{RUN}/hardware.json"
# The workflow's own folder (this file is workflow/rules/common.smk in it): workflow.basedir
# is the using workflow's when another one uses this as a module.
WORKFLOW_ROOT = Path(workflow.current_basedir).parents[1]
STATE = Path(".snakemake")  # Snakemake's own state folder: what the DAG keeps between commands
TRAINING_STAGES = ["pretrain", "grpo"]


wildcard_constraints:
    stage="|".join(TRAINING_STAGES),
    part="|".join(["vocab", *TRAINING_STAGES]),


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
    """`report(path, ...)`, except while writing a report of a run that did not make `path`. A
    pattern (`evaluate/{stage}.tsv`) is made when a file it matches exists: tested as a name, it
    never was, and the evaluation table never reached the report."""
    if REPORT_ONLY and not glob.glob(re.sub(r"\{[^{}]*\}", "*", path)):
        return path
    return report(path, **options)


def logged(rule_name):
    """The log path of a rule."""
    return f"{RUN}/logs/{rule_name}.log"


def benchmarked(rule_name):
    """The benchmark path of a rule."""
    return f"{RUN}/benchmarks/{rule_name}.tsv"


def code_of(script):
    """A digest of scripts/<script>.py and every stagetrain module it reaches: a rule param,
    so an edited library module reruns exactly the stages that run it."""
    root = Path(stagetrain.__file__).resolve().parent.parent
    return code_digest(WORKFLOW_ROOT / "scripts" / f"{script}.py", root, STATE / "stagetrain-imports")


def tracking_of_models():
    """The tracking section as consolidation reads it: whole where report_to names mlflow (the
    model folder is logged to the stage's MLflow run), else no tracker, so that a change to
    another tracker's keys does not rerun consolidation."""
    if "mlflow" in config["tracking"]["report_to"]:
        return config["tracking"]
    return {"report_to": []}


def publish_repo(wildcards):
    """No file: the first input of `publish`. Snakemake evaluates it as it builds the DAG, on a
    dry run (-n) too, so `snakemake publish` without `publish.repo` stops here in one line instead
    of running the whole pipeline first and refusing at the end."""
    if SETTINGS.publish.repo is None:
        sys.exit(
            "error: publish.repo: expected the hub repo to push to (namespace/name); none is "
            "set, so the publish target cannot run"
        )
    return []


def after_detection(wildcards):
    """No file: the first input of every job after detect_hardware, a checkpoint. Each is built
    again once hardware.json is written: its params and resources that need the plan are known
    then, and Snakemake judges it afresh (a job judged on the first, placeholder pass alone keeps
    that pass's "input updated by another job": a forced detection reran the tokenizer stage
    although its part of the plan had not changed)."""
    checkpoints.detect_hardware.get()
    return []


def get_hardware(wildcards):
    """hardware.json, once detect_hardware has written it: through the checkpoint, so that the
    planner's job, whose params need the plan, is only judged once it can be built whole (a job
    judged on Snakemake's <TBD> would leave its dependents marked to run)."""
    return checkpoints.detect_hardware.get().output.hardware


def planner_key(wildcards=None):
    """The digest of everything the planner reads (planning.ahead.inputs_key). Known once
    detect_hardware has run: before, a param that asks for it is Snakemake's <TBD>."""
    hardware = checkpoints.detect_hardware.get().output.hardware
    return _planner_key(hardware, os.stat(hardware).st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _planner_key(hardware, mtime_ns):
    files = [*LOCAL_INPUTS["table"], *LOCAL_INPUTS["init_from_config"]]
    return inputs_key(Path(hardware), planner_sections(config), files, code_of("plan_parallelism"))


def planned():
    """The plan as plan_parallelism writes it (or the planner's refusal), worked out while the
    DAG is built, so that a dry run knows which plan parts change (planning/ahead.py)."""
    return _planned(planner_key())


@functools.lru_cache(maxsize=4)
def _planned(key):
    return plan_ahead(Path(RUN) / "plan.json", key, Path(HARDWARE), planner_sections(config),
                      cache=STATE / "stagetrain-plans", shapes=STATE / "stagetrain-shapes")


def get_plan(wildcards, input):
    """plan_parallelism's plan (a derived param: passed to the script, never a rerun trigger)."""
    return planned()


def get_part_digest(wildcards):
    """plan_part's rerun trigger: the digest of the part it will write."""
    return digest(part_of(planned(), wildcards.part))


def get_part(wildcards, input):
    """What plan_part writes (a derived param)."""
    return part_of(planned(), wildcards.part)


def get_predicted(stage):
    """The planner's predicted throughput of a stage, which its summary reports against (a
    derived param: it moves with every measurement of the machine, and reruns nothing)."""
    def throughput(wildcards, input):
        plan = planned()
        return {} if isinstance(plan, str) else plan["stages"][stage]["throughput"]

    return throughput


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
    steps = SETTINGS.training(stage).optimizer_steps
    return {"steps": steps, "optimizer": config[stage]["optimizer"]}


def plan_resources(stage):
    """The Slurm resources of a stage's job, from the plan worked out with the DAG (the whole
    plan: the runtime needs the predicted step time, which the stage's part leaves out).

    Training stages get nodes, tasks, CPUs, GPUs, memory and (pretrain on GPUs)
    runtime; consolidation its memory, and a GPU for its verification where one fits it.
    Before detection (a dry run of a fresh run) each is Snakemake's <TBD>.
    """

    def read(key):
        def resource(wildcards):
            try:
                plan_key = planner_key()
            except IncompleteCheckpointException:
                return TBDString()
            return _stage_resources(stage, plan_key)[key]

        return resource

    keys = slurm.CONSOLIDATE_RESOURCES if stage == "consolidate" else slurm.TRAINING_RESOURCES
    return {key: read(key) for key in keys}


@functools.lru_cache(maxsize=16)
def _stage_resources(stage, plan_key):
    """All of a stage's resources at once: each resource function asks for one key,
    and the plan and hardware.json are read once per plan, not once per key."""
    plan = _planned(plan_key)
    if isinstance(plan, str):
        return collections.defaultdict(TBDString)  # the planner's job fails with the reason
    if stage == "consolidate":
        return slurm.consolidate_resources(plan, SETTINGS.consolidate)
    cores = json.loads(Path(HARDWARE).read_text())["cpu"]["cores"]
    return slurm.job_resources(plan, stage, cores, SETTINGS.training(stage).optimizer_steps)
