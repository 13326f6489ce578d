"""The summary.json keys every training stage writes (`training.loop.StageLoop.summary`), and
what consolidation reads of them; its own module, so that a reader imports no training code."""

from typing import TypedDict

from stagetrain.planning.plan import LayoutRecord


class CheckpointRef(TypedDict):
    """Where a stage's final checkpoint is: its fingerprint folder and tag."""

    folder: str
    tag: str


class EvalBatch(TypedDict):
    """The validation windows a stage's last loss was measured on: what consolidation re-evaluates."""

    shard: str
    windows: list[int]
    seq_len: int
    micro_batch_size: int


class LoopSummary(TypedDict):
    """What `StageLoop.summary` returns: `StageSummary` less `eval_losses`, which each stage
    gathers from its own records."""

    stage: str
    final_step: int
    resumed_from_step: int
    layout: LayoutRecord
    fingerprint: str
    attention: str
    checkpoint: CheckpointRef
    eval_batch: EvalBatch
    final_eval_loss: float


class StageSummary(LoopSummary):
    """The summary.json keys every training stage writes (`StageLoop.summary`, and each stage's
    `eval_losses`): the final
    checkpoint, its layout, fingerprint and attention kernel, and the validation loss with the
    windows it was measured on, by step and at the end; what consolidation reads (docs/architecture.md, "Contracts
    between stages"). `pretrain.summary.PretrainSummary` and `grpo.summary.GrpoSummary` add the rest."""

    eval_losses: dict[int, float]
    """The validation loss by step (text keys once read back from JSON)."""
