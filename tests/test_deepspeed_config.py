"""Rendered DeepSpeed configs: complete, consistent with the plan, and accepted by DeepSpeed's own parser."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from harness.planning import cpu_hardware, plan_for, preset_config
from harness.workflow import REPO, default_config

from stagetrain.config.settings import DeepSpeedSettings, training_settings
from stagetrain.errors import StageError
from stagetrain.training.deepspeed_config import check, render


def _render(cfg: dict[str, Any], stage: str, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    plan = plan or plan_for(cfg)
    deepspeed = DeepSpeedSettings.from_config(cfg["deepspeed"])
    return render(
        stage=stage, plan=plan, deepspeed=deepspeed, training=training_settings(stage, cfg[stage])
    )


def _no_auto(obj: Any) -> bool:
    if isinstance(obj, dict):
        return all(_no_auto(v) for v in obj.values())
    if isinstance(obj, list):
        return all(_no_auto(v) for v in obj)
    return obj != "auto"


@pytest.mark.parametrize("preset", ["llama-1b-h200", "mistral-7b-8xh100", "deepseek-moe-h100"])
@pytest.mark.parametrize("stage", ["pretrain", "grpo"])
def test_presets_render_complete_configs(preset: str, stage: str) -> None:
    cfg = preset_config(preset)
    plan = plan_for(cfg)
    config = _render(cfg, stage, plan)
    layout = plan["stages"][stage]["layout"]
    assert _no_auto(config)
    assert config["train_batch_size"] == layout["global_batch"] * layout["tp"]
    per_rank = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
    assert per_rank * layout["dp"] == layout["global_batch"]
    assert config["zero_optimization"]["stage"] == layout["zero_stage"]
    assert config["bf16"] == {"enabled": True}
    assert config["optimizer"]["params"]["lr"] == cfg[stage]["optimizer"]["lr"]
    assert ("tensor_parallel" in config) == (layout["tp"] > 1)
    json.dumps(config)


@pytest.mark.parametrize(
    ("zero", "tp"), [(0, 1), (1, 1), (2, 1), (3, 1), (0, 2), (1, 2), (2, 2)]
)  # AutoTP with ZeRO-3 is refused by the planner (test_planning)
def test_every_zero_stage_and_tp_is_accepted(zero: int, tp: int) -> None:
    cfg = preset_config("mistral-7b-8xh100", parallelism={"zero_stage": zero, "tp": tp})
    config = _render(cfg, "pretrain")
    assert config["zero_optimization"]["stage"] == zero
    if tp > 1:
        assert config["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": False}
    if zero == 3:
        assert (
            config["zero_optimization"]["stage3_max_live_parameters"]
            == cfg["deepspeed"]["stage3_max_live_parameters"]
        )


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_expert_parallelism_enables_autoep_where_the_plan_splits_experts(zero: int) -> None:
    """AutoEP finds its preset from the model's model_type; no load_balance_coeff (AutoEP
    refuses one, and the stage balances the router itself). GRPO's plan takes the config's ep
    with flat rollouts, and keeps ep=1 with tree rollouts."""
    hardware = {"gpus_per_node": 8}
    cfg = preset_config(
        "deepseek-moe-h100", hardware=hardware, parallelism={"ep": 4, "zero_stage": zero}
    )
    assert _render(cfg, "pretrain")["expert_parallel"] == {"enabled": True, "autoep_size": 4}
    assert _render(cfg, "grpo")["expert_parallel"] == {"enabled": True, "autoep_size": 4}
    tree = preset_config("deepseek-moe-h100", hardware=hardware, parallelism={"ep": 4, "zero_stage": zero},
                         grpo={"rollout": "tree"})  # fmt: skip
    assert "expert_parallel" not in _render(tree, "grpo")
    assert "expert_parallel" not in _render(
        preset_config("deepseek-moe-h100", hardware=hardware), "pretrain"
    )


def test_offload_and_activation_checkpointing_follow_the_plan() -> None:
    fixed = {"zero_stage": 3, "offload": "optimizer_and_params", "activation_checkpointing": True}
    config = _render(preset_config("mistral-7b-8xh100", parallelism=fixed), "pretrain")
    zero = config["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert "torch_adam" not in config["optimizer"]["params"]  # offload runs DeepSpeed's CPU Adam
    assert "activation_checkpointing" in config


def test_fp16_with_loss_scaling_on_gpus_without_bf16() -> None:
    cfg = preset_config("llama-1b-h200", hardware={"gpu": "V100-32GB", "gpus_per_node": 8})
    config = _render(cfg, "pretrain")
    assert "bf16" not in config
    assert config["fp16"]["enabled"] and config["fp16"]["loss_scale"] == 0
    assert config["fp16"]["initial_scale_power"] == 16


def test_fp32_on_request() -> None:
    config = _render(preset_config("llama-1b-h200", deepspeed={"precision": "fp32"}), "pretrain")
    assert "bf16" not in config and "fp16" not in config


@pytest.mark.parametrize(
    ("schedule", "kind", "keys"),
    [
        ("cosine", "WarmupCosineLR", {"total_num_steps", "warmup_num_steps", "cos_min_ratio"}),
        ("linear", "WarmupDecayLR", {"total_num_steps", "warmup_max_lr"}),
        ("constant", "WarmupLR", {"warmup_max_lr", "warmup_num_steps"}),
    ],
)
def test_schedules(schedule: str, kind: str, keys: set[str]) -> None:
    cfg = default_config()
    cfg["pretrain"]["optimizer"]["schedule"] = schedule
    config = _render(cfg, "pretrain", plan_for(cfg, cpu_hardware()))
    assert config["scheduler"]["type"] == kind
    assert keys <= set(config["scheduler"]["params"])


def test_default_config_renders_on_cpu() -> None:
    cfg = default_config()
    plan = plan_for(cfg, cpu_hardware())
    for stage in ("pretrain", "grpo"):
        config = _render(cfg, stage, plan)
        assert config["optimizer"]["params"]["torch_adam"] is True
        assert config["gradient_clipping"] == cfg[stage]["optimizer"]["grad_clip"]


def test_deepspeed_itself_rejects_bad_keys_and_batch_arithmetic() -> None:
    """check() runs DeepSpeed's parser: a typo in a ZeRO key or a wrong batch fails here, in one line."""
    cfg = default_config()
    good = _render(cfg, "pretrain", plan_for(cfg, cpu_hardware()))
    check(good, ranks=2, where="x.json")
    typo = {**good, "zero_optimization": {"stagee": 2}}
    with pytest.raises(StageError, match="x.json: DeepSpeed rejects the config:.*stagee") as err:
        check(typo, ranks=2, where="x.json")
    assert "\n" not in str(err.value)
    with pytest.raises(StageError, match="x.json: DeepSpeed rejects the config"):
        check(good, ranks=3, where="x.json")  # 32 != 16 * 1 * 3


def test_unknown_stage_is_an_error() -> None:
    cfg = default_config()
    plan = plan_for(cfg, cpu_hardware())
    with pytest.raises(StageError, match="plan.json: no stage 'sft'"):
        render(
            stage="sft",
            plan=plan,
            deepspeed=DeepSpeedSettings.from_config(cfg["deepspeed"]),
            training=training_settings("pretrain", cfg["pretrain"]),
        )


RENDER = """
import json, sys
sys.path.insert(0, "tests")
from harness.planning import cpu_hardware, plan_for
from harness.workflow import default_config
from test_deepspeed_config import _render
cfg = default_config()
print(json.dumps({stage: _render(cfg, stage, plan_for(cfg, cpu_hardware())) for stage in ("pretrain", "grpo")}))
"""


def test_rendering_is_byte_identical_across_processes_and_hash_seeds() -> None:
    """A set or dict iterated in hash order would render differently in another process (and
    rerun every stage after it); one process rendering twice cannot see that."""
    rendered = {}
    for seed in ("0", "1"):
        done = subprocess.run([sys.executable, "-c", RENDER], cwd=REPO, capture_output=True, text=True,
                              check=True, env={**os.environ, "PYTHONHASHSEED": seed})  # fmt: skip
        rendered[seed] = done.stdout.splitlines()[-1]  # DeepSpeed logs its accelerator first
    assert len(set(rendered.values())) == 1, rendered
    assert json.loads(rendered["0"])["grpo"]["train_batch_size"] > 0
