"""What one GRPO run holds while it trains: `Run`, built once by `grpo.train.setup` and read by
every step (`grpo.steps`), the replay it mixes in, and the types of what it saves and writes
(its checkpoints' client state, summary.json). Its own module so that the loop and the steps
both import it and neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, TypedDict

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations import HfDeepSpeedConfig

from stagetrain.config.settings import GrpoSettings
from stagetrain.evaluate.heldout import GainReport
from stagetrain.grpo.curriculum import CurriculumConfig, CurriculumStateRecord
from stagetrain.grpo.metrics import GrpoRecord
from stagetrain.grpo.tree import TreeConfig
from stagetrain.planning.plan import Layout
from stagetrain.tasks import Problem
from stagetrain.tasks.families import FamilyRecord
from stagetrain.tasks.judge import Judge
from stagetrain.training.checkpoints import ClientState
from stagetrain.training.loop import StageLoop, StageSummary
from stagetrain.training.spec import GrpoJob

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


class Replay(NamedTuple):
    """What `grpo.replay` mixes into each step: `share` of the prompts from `families`, each
    at a level drawn uniformly from 1 to its `levels` (the corpus's levels of it)."""

    share: float
    levels: dict[str, int]


class GrpoClient(ClientState):
    """What GRPO's checkpoints carry beside DeepSpeed's state: every family's curriculum."""

    curriculum: dict[str, CurriculumStateRecord]


class Accuracy(TypedDict):
    """summary.json's `accuracy`: greedy, on the fixed held-out problems, mean over families and
    by family, at the start (None when the metrics lost the step-0 record) and the end, and
    the gain report (`stagetrain.evaluate.heldout.gains`)."""

    start: float | None
    start_by_family: dict[str, float] | None
    end: float
    end_by_family: dict[str, float]
    gain: GainReport | None


class SamplerSummary(TypedDict):
    """summary.json's `sampler`: the sampler-trainer gap over the logged steps (None when none
    logged it) and the truncated importance correction applied (`grpo.sampler_correction`)."""

    logprob_gap_mean: float | None
    logprob_gap_max: float | None
    kl_mean: float | None
    correction: dict[str, float] | None


class GrpoSummary(StageSummary):
    """grpo/summary.json (`grpo.train.summarise`; docs/architecture.md, "Contracts between
    stages"): the keys every stage writes, then DeepSpeed's optimizer steps, the curriculum at
    the end, by step (text keys once read back from JSON) the losses, rewards, levels and
    held-out evaluations, the accuracy and its gain, the sampler-trainer gap, the task files
    read and the dtypes at the end."""

    optimizer_steps: int
    curriculum: dict[str, CurriculumStateRecord]
    losses: dict[int, float]
    final_loss: float | None
    rewards: dict[int, float]
    levels: dict[int, dict[str, int]]
    evaluations: dict[int, dict[str, float]]
    accuracy: Accuracy
    eval_losses: dict[int, float]
    sampler: SamplerSummary
    tasks: dict[str, FamilyRecord]
    dtypes: dict[str, str]


@dataclass(kw_only=True)
class Run:
    """Everything the loop needs, built once by `setup`."""

    spec: GrpoJob
    cfg: GrpoSettings
    engine: DeepSpeedEngine
    reference: DeepSpeedEngine | PreTrainedModel | None
    """The frozen reference policy; None without a KL term."""
    tokenizer: PreTrainedTokenizerBase
    judge: Judge
    """The prompts and rewards of the task families (training and evaluation alike)."""
    device: torch.device
    layout: Layout
    dp_rank: int
    curriculum: CurriculumConfig
    tree: TreeConfig | None
    eval_set: list[Problem]
    loop: StageLoop[GrpoRecord, GrpoClient]
    val: np.ndarray
    eval_windows: np.ndarray
    generation_batch: int
    """Most sequences one `generate` call makes: the plan counted their KV cache."""
    replay: Replay | None = None
    zero3_config: HfDeepSpeedConfig | None = None
    """Held for the run's life under ZeRO-3: transformers keeps only a weak reference to it."""
