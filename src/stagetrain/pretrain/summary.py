"""pretrain/summary.json's type: what `train.summarise` writes, and the loss plot and the
consolidation read (docs/architecture.md, "Contracts between stages")."""

from __future__ import annotations

from typing import TypedDict

from stagetrain.training.summary import StageSummary


class ExpertsSummary(TypedDict):
    """An MoE run's routing in summary.json: its settings, the aux loss and expert load at the
    last record, and the load imbalance at each record (`train.experts_summary`). A router
    balanced by a bias (deepseek_v3) has no aux loss (`aux_loss_coef`, `final_aux_loss` None)
    and a `bias_update_rate`; one balanced by an aux loss, the other way round."""

    experts: int
    top_k: int
    aux_loss_coef: float | None
    bias_update_rate: float | None
    final_aux_loss: float | None
    final_load_entropy: float
    final_load_max_over_mean: float
    final_load_by_layer: list[list[float]]
    load_max_over_mean: dict[int, float]
    """By step (text keys once read back from JSON, as every by-step map here)."""


class ParamRecord(TypedDict):
    """The parameters at the end (`train.final_params`): rank 0's element count after
    construction and the whole model's (`training.engine.ParamCounts`), the dtypes, and every
    rank's element count and checksum."""

    local_param_elements: int
    param_elements: int
    dtypes: dict[str, str]
    local_param_elements_per_rank: list[int]
    param_checksum_per_rank: list[list[float]]


_Mfu = TypedDict("_Mfu", {"mfu(%)": float | None})


class PretrainSummary(StageSummary, ParamRecord, _Mfu):
    """pretrain/summary.json (`train.summarise`): the keys every stage writes, then the losses,
    throughput and MFU (median over the records after the first; `mfu_reason` when there is
    none), the routing of an MoE model, the parameters."""

    final_loss: float
    losses: dict[int, float]
    tokens_per_s: float
    predicted_tokens_per_s: float | None
    tokens_per_s_over_predicted: float | None
    mfu_reason: str | None
    experts: ExpertsSummary | None
