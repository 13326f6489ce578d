"""The typed stage layout the training stages read from plan.json."""

from __future__ import annotations

import pytest
from harness.planning import cpu_hardware, plan_for
from harness.workflow import default_config

from stagetrain.errors import StageError
from stagetrain.training.layout import StageLayout


@pytest.mark.parametrize("stage", ["pretrain", "grpo"])
def test_the_plans_layout_round_trips_through_the_dataclass(stage: str) -> None:
    """Every key the planner writes is a field and back: summary.json repeats the plan's layout unchanged."""
    plan = plan_for(default_config(), cpu_hardware())
    raw = plan["stages"][stage]["layout"]
    layout = StageLayout.from_plan(plan, stage)
    assert layout.to_json() == raw
    assert layout.checkpoint_layout == {k: raw[k] for k in ("dp", "tp", "zero_stage")}


def test_grpo_sequence_length_is_planned_as_prompt_plus_completion() -> None:
    """GRPO reads its sequence length from the plan instead of adding the config's two lengths again."""
    cfg = default_config()
    layout = StageLayout.from_plan(plan_for(cfg, cpu_hardware()), "grpo")
    assert layout.seq_len == cfg["grpo"]["max_prompt_len"] + cfg["grpo"]["max_new_tokens"]


@pytest.mark.parametrize("change", ["missing", "unknown"])
def test_a_layout_of_another_version_is_one_line(change: str) -> None:
    raw = dict(plan_for(default_config(), cpu_hardware())["stages"]["pretrain"]["layout"])
    if change == "missing":
        del raw["grad_accum"]
    else:
        raw["pipeline"] = 2
    with pytest.raises(
        StageError,
        match=r"^plan.json stages.pretrain.layout: the layout .*(grad_accum|pipeline).*replan",
    ) as err:
        StageLayout.from_plan({"stages": {"pretrain": {"layout": raw}}}, "pretrain")
    assert "\n" not in str(err.value)
