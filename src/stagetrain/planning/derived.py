"""The small files plan_parallelism derives from plan.json, one per reader.

Each stage depends only on the part of the plan it reads, so a replan that
leaves that part alone does not rerun it: the tokenizer stage reads only the
tensor-parallel degree its padded vocabulary must divide by (plan/vocab.json),
each training stage (its DeepSpeed config, its consolidation) only the run-wide
facts and its own stage's entry (plan/<stage>.json, plan.json's shape).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# The run-wide keys the training stages read (world, backend, device, model shape).
SHARED_KEYS = (
    "attention",
    "backend",
    "device",
    "model",
    "nodes",
    "precision",
    "ranks_per_node",
    "world",
)


def vocab_padding(plan: Mapping[str, Any]) -> dict[str, int]:
    """plan/vocab.json: `tp`, the lcm of the stages' tp, which the padded vocabulary must divide by."""
    return {"tp": math.lcm(*(stage["layout"]["tp"] for stage in plan["stages"].values()))}


def stage_plan(plan: Mapping[str, Any], stage: str) -> dict[str, Any]:
    """plan/<stage>.json: plan.json with only the run-wide keys and `stages.<stage>`."""
    return {**{key: plan[key] for key in SHARED_KEYS}, "stages": {stage: plan["stages"][stage]}}
