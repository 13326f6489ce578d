"""grpo/summary.json's type: what `grpo.train.summarise` writes, and publish reads (docs/
architecture.md, "Contracts between stages"); its own module, so that a reader imports no
training code."""

from typing import TypedDict

from stagetrain.corpus.meta import FamilyRecord
from stagetrain.evaluate.heldout import GainReport
from stagetrain.grpo.curriculum import CurriculumStateRecord
from stagetrain.training.summary import StageSummary


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
    logged it), the truncated importance correction applied (`grpo.sampler_correction`) and an
    MoE policy's routing stability."""

    logprob_gap_mean: float | None
    logprob_gap_max: float | None
    kl_mean: float | None
    correction: dict[str, float] | None
    routing_flip_share_mean: float | None
    """An MoE policy's: the share of (token, MoE layer) pairs whose experts the trainer's
    forward chose differently from the sampler's, mean over the logged steps; None for a dense
    policy."""
    routing_flip_share_max: float | None


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
    reward_max: float | None
    """The largest reward of any completion over the logged steps, to set against success_at."""
    levels: dict[int, dict[str, int]]
    evaluations: dict[int, dict[str, float]]
    accuracy: Accuracy
    sampler: SamplerSummary
    tasks: dict[str, FamilyRecord]
    dtypes: dict[str, str]
