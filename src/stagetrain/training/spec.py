"""The job spec: what the launcher writes (`training.launch.job_spec`) and every rank of a
training stage reads (`--spec job.json`).

Its own module so that the launcher, the ranks' entry (`training.rank`), the metrics log and
the stages all import its types without importing each other. No `from __future__ import
annotations` here: Python 3.11 reads `NotRequired` only from evaluated annotations.
"""

from typing import Any, NotRequired, TypedDict

from stagetrain.planning.plan import NoThroughput, ThroughputRecord


class WandbRun(TypedDict):
    """The Weights & Biases run a stage logs to (`launch.trackers`): project, run name, folder."""

    project: str
    name: str
    dir: str


class MlflowRun(TypedDict):
    """The MLflow run a stage logs to (`launch.trackers`, `launch.job_spec`): where, the run's
    name, and the stage's config part as params (`mlflow_run.params`)."""

    tracking_uri: str
    experiment: str
    name: str
    params: dict[str, str]


class PretrainPart(TypedDict):
    """Pretrain's part of its job spec (`launch.pretrain_part`). The sections stay the validated
    config's own JSON: the checkpoint fingerprint hashes them as written; the ranks read them
    typed (`settings.PretrainSettings`, `settings.ModelSettings`)."""

    pretrain: dict[str, Any]
    model: dict[str, Any]
    seed: int
    throughput: ThroughputRecord | NoThroughput
    """plan.json's estimate for the layout (its part of the plan leaves estimates out)."""


class GrpoPart(TypedDict):
    """GRPO's part of its job spec (`launch.grpo_part`); the sections as in `PretrainPart`."""

    grpo: dict[str, Any]
    tasks: dict[str, Any]
    seed: int


class JobSpec(TypedDict):
    """job.json, what every rank of a training stage reads, built by `launch.job_spec` alone.

    Absolute paths of the stage's named inputs and outputs (a benchmark's spec names no
    outputs), the checkpoint root, the trackers `tracking.report_to` asks for, then the stage's
    part: `PretrainJob` and `GrpoJob` are the two stages' whole specs. One flat type cannot hold
    both: `model` is the model section in pretrain's and the start model's folder in GRPO's.
    """

    plan: str
    deepspeed_config: str
    tokenizer: str
    model_config: str
    meta: str
    val: str
    summary: NotRequired[str]
    metrics: NotRequired[str]
    checkpoints: str
    tensorboard: NotRequired[str]
    wandb: NotRequired[WandbRun]
    mlflow: NotRequired[MlflowRun]


class PretrainJob(JobSpec, PretrainPart):
    """Pretrain's job spec: its training shard and loss plot beside the shared keys and its part."""

    train: str
    loss_plot: NotRequired[str]


class GrpoJob(JobSpec, GrpoPart):
    """GRPO's job spec: the consolidated pretrain model it starts from (`model`), its reward plot
    and its completions table (grpo.completions)."""

    model: str
    reward_plot: NotRequired[str]
    completions: NotRequired[str]
    completions_table: NotRequired[str]
