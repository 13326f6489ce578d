"""The typed stage layout the training stages read from plan.json."""

from __future__ import annotations

import pytest
from harness.planning import cpu_hardware, plan_for
from harness.workflow import default_config

from stagetrain.errors import StageError
from stagetrain.planning.plan import Layout


@pytest.mark.parametrize("stage", ["pretrain", "grpo"])
def test_the_plans_layout_round_trips_through_the_dataclass(stage: str) -> None:
    """Every key the planner writes is a field and back: summary.json repeats the plan's layout unchanged."""
    plan = plan_for(default_config(), cpu_hardware())
    raw = plan["stages"][stage]["layout"]
    layout = Layout.from_plan(plan, stage)
    assert layout.to_json() == raw
    assert layout.checkpoint_layout == {k: raw[k] for k in ("dp", "tp", "zero_stage")}


def test_grpo_sequence_length_is_planned_as_prompt_plus_completion() -> None:
    """GRPO reads its sequence length from the plan instead of adding the config's two lengths again."""
    cfg = default_config()
    layout = Layout.from_plan(plan_for(cfg, cpu_hardware()), "grpo")
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
        Layout.from_plan({"stages": {"pretrain": {"layout": raw}}}, "pretrain")
    assert "\n" not in str(err.value)


def test_a_layout_read_back_is_checked_like_a_planned_one() -> None:
    """One class: factors that could not have been planned are refused when read, naming plan.json."""
    raw = dict(plan_for(default_config(), cpu_hardware())["stages"]["pretrain"]["layout"])
    raw["grad_accum"] += 1  # the global batch no longer adds up
    with pytest.raises(
        StageError, match=r"^plan.json stages.pretrain.layout: parallelism: global batch must equal"
    ) as err:
        Layout.from_plan({"stages": {"pretrain": {"layout": raw}}}, "pretrain")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("fixed", "layout"),
    [
        ({"dp": 3}, {"dp": 3, "tp": 1}),
        ({"tp": 2, "zero_stage": 3}, {"dp": 1, "tp": 2, "zero_stage": 3}),
    ],
)
def test_the_planner_and_a_layout_refuse_factors_with_one_check(
    fixed: dict[str, int], layout: dict[str, int]
) -> None:
    """The config's fixed values and a built layout go through the same check: the same reason."""
    cfg = default_config()
    cfg["parallelism"].update(fixed)
    with pytest.raises(StageError) as planned:
        plan_for(cfg, cpu_hardware(ranks=2))
    raw = plan_for(default_config(), cpu_hardware())["stages"]["pretrain"]["layout"]
    raw = {
        **raw,
        **layout,
        "global_batch": layout["dp"] * raw["micro_batch_size"] * raw["grad_accum"],
    }
    with pytest.raises(StageError) as built:
        Layout(**raw, num_heads=4, num_kv_heads=4)
    assert str(planned.value).split(" (")[0] == str(built.value).split(" (")[0]
