"""The pretrain stage's metric names: every key its metrics.jsonl may hold, with what it means.

`stagetrain.training.metrics.MetricsLog` refuses a key that is not here. `PretrainRecord`
types a record with the same keys (tests/test_pretrain_unit.py holds the two equal).
"""

from typing import NotRequired, TypedDict

METRICS: dict[str, str] = {
    "step": "optimizer steps completed; every record",
    "train/loss": "mean cross-entropy over the step's tokens on all data-parallel ranks; every record",
    "train/lr": "learning rate used by the step; every record",
    "train/grad_norm": "global gradient norm before clipping (null where DeepSpeed does not report it); every record",
    "train/tokens": "training tokens seen so far over all ranks; every record",
    "throughput/tokens_per_s": "training tokens per second over all ranks since the previous record; every record",
    "throughput/mfu(%)": "model FLOPs utilisation, (6N + 12 L h s) x tokens/s over the peak of all devices; null on CPUs or GPUs missing from the catalog",
    "memory/max_allocated(GiB)": "peak GPU memory allocated by torch on rank 0 since the previous record; GPU only",
    "memory/max_reserved(GiB)": "peak GPU memory held by torch's caching allocator on rank 0 since the previous record (allocated plus cached blocks: what the device must have); GPU only",
    "memory/max_rss(GiB)": "peak resident memory of rank 0's process; CPU only",
    "eval/loss": "mean loss on the fixed validation batches; every eval_every steps and at the end",
    "train/aux_loss": "the router's load-balancing loss (unweighted), mean over ranks; MoE models whose architecture defines one (mixtral, qwen2_moe; not deepseek_v3) only (train/loss stays the language-model loss)",
    "moe/load_entropy": "entropy of the experts' shares of routed tokens over log(experts), mean over MoE layers: 1 evenly loaded, 0 collapsed; MoE only",
    "moe/load_max_over_mean": "the busiest expert's share over the mean share, mean over MoE layers: 1 balanced, `experts` collapsed; MoE only",
    "moe/load_entropy_by_layer": "moe/load_entropy of each MoE layer, by its index among the MoE layers; MoE only",
    "moe/load_max_over_mean_by_layer": "moe/load_max_over_mean of each MoE layer, by its index among the MoE layers; MoE only",
    "moe/load_by_layer": "per MoE layer, each expert's share of the step's routed tokens (all ranks; the experts the router chose, a routing bias included); MoE only",
    "time/elapsed_s": "seconds since this process started training; every record",
}

PretrainRecord = TypedDict(
    "PretrainRecord",
    {
        "step": int,
        "train/loss": float,
        "train/lr": float,
        "train/grad_norm": float | None,
        "train/tokens": int,
        "throughput/tokens_per_s": float,
        "throughput/mfu(%)": float | None,
        "memory/max_allocated(GiB)": NotRequired[float],
        "memory/max_reserved(GiB)": NotRequired[float],
        "memory/max_rss(GiB)": NotRequired[float],
        "eval/loss": NotRequired[float],
        "train/aux_loss": NotRequired[float],
        "moe/load_entropy": NotRequired[float],
        "moe/load_max_over_mean": NotRequired[float],
        "moe/load_entropy_by_layer": NotRequired[dict[str, float]],
        "moe/load_max_over_mean_by_layer": NotRequired[dict[str, float]],
        "moe/load_by_layer": NotRequired[list[list[float]]],
        "time/elapsed_s": float,
    },
)
"""One record of pretrain's metrics.jsonl (`pretrain.train.record`); METRICS says when each
optional key is there."""
