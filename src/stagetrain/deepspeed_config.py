"""The render_deepspeed_config stage: one complete DeepSpeed config per training stage.

Nothing is left as "auto": batch sizes, ZeRO stage and options, precision,
optimizer and schedule, clipping, AutoTP and activation checkpointing all come
from plan.json and the config. The result is parsed by DeepSpeed's own
`DeepSpeedConfig` (at the plan's world size), so a key DeepSpeed's
config models reject or a batch that does not add up fails here, on the laptop,
not on the cluster. DeepSpeed ignores unknown top-level keys, so `render` emits
only keys from its own fixed set.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from stagetrain.errors import StageError

SCHEDULERS = {"cosine": "WarmupCosineLR", "linear": "WarmupDecayLR", "constant": "WarmupLR"}


def _scheduler(optimizer: Mapping[str, Any], steps: int) -> dict[str, Any]:
    warmup, lr = optimizer["warmup_steps"], optimizer["lr"]
    kind = optimizer["schedule"]
    if kind == "cosine":
        params = {
            "total_num_steps": steps,
            "warmup_num_steps": warmup,
            "warmup_min_ratio": 0.0,
            "cos_min_ratio": optimizer["min_lr_ratio"],
        }
    else:
        params = {"warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": warmup}
        if kind == "linear":
            params["total_num_steps"] = steps
    return {"type": SCHEDULERS[kind], "params": {**params, "warmup_type": "linear"}}


def _precision(precision: str, deepspeed: Mapping[str, Any]) -> dict[str, Any]:
    if precision == "bf16":
        return {"bf16": {"enabled": True}}
    if precision == "fp16":
        return {
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": deepspeed["fp16_initial_scale_power"],
                "loss_scale_window": 1000,
                "hysteresis": 2,
                "min_loss_scale": 1,
            }
        }
    return {}


def _zero(layout: Mapping[str, Any], deepspeed: Mapping[str, Any]) -> dict[str, Any]:
    stage = layout["zero_stage"]
    zero: dict[str, Any] = {"stage": stage}
    if stage == 0:
        return zero
    bucket = deepspeed["bucket_size"]
    zero.update(
        overlap_comm=deepspeed["overlap_comm"], contiguous_gradients=True, reduce_bucket_size=bucket
    )
    if stage in (1, 2):
        zero["allgather_bucket_size"] = bucket
    if stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=bucket,
            stage3_max_live_parameters=deepspeed["stage3_max_live_parameters"],
        )
    if layout["offload"] in ("optimizer", "optimizer_and_params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if layout["offload"] == "optimizer_and_params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return zero


def render(
    *,
    stage: str,
    plan: Mapping[str, Any],
    deepspeed: Mapping[str, Any],
    training: Mapping[str, Any],
) -> dict[str, Any]:
    """The DeepSpeed config of `stage`.

    Args:
        stage: "pretrain" or "grpo".
        plan: plan.json.
        deepspeed: the `deepspeed` config section.
        training: the stage's `steps` and `optimizer` (from its config section).
    """
    if stage not in plan["stages"]:
        raise StageError(f"plan.json: no stage {stage!r} (has {', '.join(plan['stages'])})")
    layout = plan["stages"][stage]["layout"]
    optimizer, steps = training["optimizer"], training["steps"]
    offloaded = layout["offload"] != "none"
    config: dict[str, Any] = {
        # DeepSpeed counts every rank here, tensor-parallel ones included (it is given no
        # mpu), so with tp > 1 this is the global batch in sequences times tp.
        "train_batch_size": layout["global_batch"] * layout["tp"],
        "train_micro_batch_size_per_gpu": layout["micro_batch_size"],
        "gradient_accumulation_steps": layout["grad_accum"],
        "gradient_clipping": optimizer["grad_clip"],
        "steps_per_print": steps,
        "wall_clock_breakdown": False,
        "zero_optimization": _zero(layout, deepspeed),
        **_precision(layout["precision"], deepspeed),
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": optimizer["lr"],
                "betas": list(optimizer["betas"]),
                "eps": optimizer["eps"],
                "weight_decay": optimizer["weight_decay"],
                # torch's AdamW needs no compiled op; offload needs DeepSpeed's CPU Adam.
                **({} if offloaded else {"torch_adam": True}),
            },
        },
        "scheduler": _scheduler(optimizer, steps),
    }
    if layout["tp"] > 1:
        # Full logits on every tp rank (the output projection gathers its columns), so the
        # loss is the ordinary cross-entropy; the planner counts the logits unsplit.
        config["tensor_parallel"] = {"autotp_size": layout["tp"], "vocab_parallel_lm_head": False}
    if layout["activation_checkpointing"]:
        config["activation_checkpointing"] = {
            "partition_activations": False,
            "cpu_checkpointing": False,
            "contiguous_memory_optimization": False,
        }
    check(config, ranks=layout["dp"] * layout["tp"], where=f"deepspeed/{stage}.json")
    return config


def check(config: Mapping[str, Any], *, ranks: int, where: str) -> None:
    """Parse `config` with DeepSpeed's own DeepSpeedConfig as if on `ranks` ranks.

    Raises:
        StageError: DeepSpeed rejected the config; its first line is kept.
    """
    from deepspeed.runtime.config import DeepSpeedConfig

    class _AtWorldSize(DeepSpeedConfig):
        # Outside a process group DeepSpeedConfig assumes one rank; the batch
        # arithmetic must be checked with the plan's world size.
        def _configure_train_batch_size(self) -> None:
            self.world_size = ranks
            super()._configure_train_batch_size()

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    try:
        _AtWorldSize(dict(config))
    except (ValueError, AssertionError, TypeError, KeyError) as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        detail = "; ".join(lines[:3]) if lines else type(err).__name__
        raise StageError(f"{where}: DeepSpeed rejects the config: {detail}") from None
