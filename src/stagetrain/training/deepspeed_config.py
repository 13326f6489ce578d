"""The render_deepspeed_config stage: one complete DeepSpeed config per training stage.

Nothing is left as "auto": batch sizes, ZeRO stage and options, precision,
optimizer and schedule, clipping, AutoTP, AutoEP and activation checkpointing all come
from the plan's layout and the config. The result is parsed by DeepSpeed's own
`DeepSpeedConfig` (at the plan's world size), so a key DeepSpeed's
config models reject or a batch that does not add up fails here, on the laptop,
not on the cluster. DeepSpeed ignores unknown top-level keys, so `render` emits
only the keys `DeepSpeedJson` names.
"""

import logging
from typing import Literal, NotRequired, TypedDict

from stagetrain.config.settings import DeepSpeedSettings, OptimizerSettings, TrainingSettings
from stagetrain.errors import StageError
from stagetrain.planning.plan import Layout, PlanPart, PlanRecord

SCHEDULERS = {"cosine": "WarmupCosineLR", "linear": "WarmupDecayLR", "constant": "WarmupLR"}


class OffloadDevice(TypedDict):
    """Where ZeRO moves a part of the training state (optimizer or parameters)."""

    device: Literal["cpu"]
    pin_memory: bool


class Zero(TypedDict):
    """`zero_optimization`: the stage, and each stage's own options."""

    stage: int
    overlap_comm: NotRequired[bool]
    contiguous_gradients: NotRequired[bool]
    reduce_bucket_size: NotRequired[int]
    allgather_bucket_size: NotRequired[int]
    stage3_prefetch_bucket_size: NotRequired[int]
    stage3_max_live_parameters: NotRequired[int]
    offload_optimizer: NotRequired[OffloadDevice]
    offload_param: NotRequired[OffloadDevice]


class Scheduler(TypedDict):
    """DeepSpeed's scheduler: its class name and that class's keyword arguments."""

    type: str
    params: dict[str, float | int | str]


class Enabled(TypedDict):
    """A precision section that is on or off."""

    enabled: bool


class Fp16(Enabled):
    """fp16 with dynamic loss scaling (`loss_scale` 0)."""

    loss_scale: int
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    min_loss_scale: int


class DeepSpeedJson(TypedDict):
    """deepspeed/<stage>.json: what `deepspeed.initialize` gets, and nothing it would ignore."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    gradient_clipping: float
    steps_per_print: int
    wall_clock_breakdown: bool
    zero_optimization: Zero
    optimizer: dict[str, str | dict[str, float | bool | list[float]]]
    scheduler: Scheduler
    bf16: NotRequired[Enabled]
    fp16: NotRequired[Fp16]
    tensor_parallel: NotRequired[dict[str, int | bool]]
    expert_parallel: NotRequired[dict[str, int | bool]]
    activation_checkpointing: NotRequired[dict[str, bool]]


def _scheduler(optimizer: OptimizerSettings, steps: int) -> Scheduler:
    warmup, kind = optimizer.warmup_steps, optimizer.schedule
    params: dict[str, float | int | str]
    if kind == "cosine":
        params = {
            "total_num_steps": steps,
            "warmup_num_steps": warmup,
            "warmup_min_ratio": 0.0,
            "cos_min_ratio": optimizer.min_lr_ratio,
        }
    else:
        params = {"warmup_min_lr": 0.0, "warmup_max_lr": optimizer.lr, "warmup_num_steps": warmup}
        if kind == "linear":
            params["total_num_steps"] = steps
    return {"type": SCHEDULERS[kind], "params": {**params, "warmup_type": "linear"}}


def _zero(layout: Layout, deepspeed: DeepSpeedSettings) -> Zero:
    stage = layout.zero_stage
    zero: Zero = {"stage": stage}
    if stage == 0:
        return zero
    bucket = deepspeed.bucket_size
    zero.update(
        {
            "overlap_comm": deepspeed.overlap_comm,
            "contiguous_gradients": True,
            "reduce_bucket_size": bucket,
        }
    )
    if stage in (1, 2):
        zero["allgather_bucket_size"] = bucket
    if stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": bucket,
                "stage3_max_live_parameters": deepspeed.stage3_max_live_parameters,
            }
        )
    if layout.offload in ("optimizer", "optimizer_and_params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if layout.offload == "optimizer_and_params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return zero


def _set_precision(config: DeepSpeedJson, precision: str, deepspeed: DeepSpeedSettings) -> None:
    """bf16 as is; fp16 with dynamic loss scaling from 2**fp16_initial_scale_power; fp32: neither."""
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":
        config["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": deepspeed.fp16_initial_scale_power,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }


def render(
    *,
    stage: str,
    plan: PlanPart | PlanRecord,
    deepspeed: DeepSpeedSettings,
    training: TrainingSettings,
) -> DeepSpeedJson:
    """The DeepSpeed config of `stage`.

    Args:
        stage: "pretrain" or "grpo".
        plan: plan.json, or the stage's part of it (plan/<stage>.json).
        deepspeed: the `deepspeed` config section.
        training: the stage's config section (its optimizer, and its optimizer steps for the
            schedule).
    """
    if stage not in plan["stages"]:
        raise StageError(f"plan.json: no stage {stage!r} (has {', '.join(plan['stages'])})")
    layout = Layout.from_plan(plan, stage)
    optimizer, steps = training.optimizer, training.optimizer_steps
    config: DeepSpeedJson = {
        # DeepSpeed counts every rank here, tensor-parallel ones included (it is given no
        # mpu), so with tp > 1 this is the global batch in sequences times tp.
        "train_batch_size": layout.global_batch * layout.tp,
        "train_micro_batch_size_per_gpu": layout.micro_batch_size,
        "gradient_accumulation_steps": layout.grad_accum,
        "gradient_clipping": optimizer.grad_clip,
        "steps_per_print": steps,
        "wall_clock_breakdown": False,
        "zero_optimization": _zero(layout, deepspeed),
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": optimizer.lr,
                "betas": list(optimizer.betas),
                "eps": optimizer.eps,
                "weight_decay": optimizer.weight_decay,
                # torch's AdamW needs no compiled op; offload needs DeepSpeed's CPU Adam.
                **({} if layout.offload != "none" else {"torch_adam": True}),
            },
        },
        "scheduler": _scheduler(optimizer, steps),
    }
    _set_precision(config, layout.precision, deepspeed)
    if layout.tp > 1:
        # Full logits on every tp rank (the output projection gathers its columns), so the
        # loss is the ordinary cross-entropy; the planner counts the logits unsplit.
        config["tensor_parallel"] = {"autotp_size": layout.tp, "vocab_parallel_lm_head": False}
    if layout.ep > 1:
        # AutoEP replaces each MoE block with its own layer (`AutoEPMoELayer`), the preset found
        # from the model's model_type; no load_balance_coeff: the stage balances the router itself
        # (training.experts), and AutoEP refuses one.
        config["expert_parallel"] = {"enabled": True, "autoep_size": layout.ep}
    if layout.activation_checkpointing:
        config["activation_checkpointing"] = {
            "partition_activations": False,
            "cpu_checkpointing": False,
            "contiguous_memory_optimization": False,
        }
    check(config, ranks=layout.dp * layout.tp, where=f"deepspeed/{stage}.json")
    return config


def check(config: DeepSpeedJson, *, ranks: int, where: str) -> None:
    """Parse `config` with DeepSpeed's own DeepSpeedConfig as if on `ranks` ranks.

    Raises:
        StageError: DeepSpeed rejected the config; its first line is kept.
    """
    from deepspeed.runtime.config import DeepSpeedConfig

    class _AtWorldSize(DeepSpeedConfig):  # type: ignore[misc]  # Any: the check skips deepspeed
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
