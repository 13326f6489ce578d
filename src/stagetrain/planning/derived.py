"""The small files plan_parallelism derives from plan.json, one per reader.

Each stage depends only on the part of the plan it reads, so a replan that
leaves that part alone does not rerun it: the tokenizer stage reads only the
tensor-parallel degree its padded vocabulary must divide by (plan/vocab.json),
each training stage (its DeepSpeed config, its consolidation) only the run-wide
facts and its own stage's entry (plan/<stage>.json, plan.json's shape).

A part leaves out the entry's ESTIMATES (predicted throughput, the runners-up's): they move
with every measurement of the machine, so a part that held them changed at each detection,
and a forced detection on the same machine reran every stage for a layout it kept. The
stages and the Slurm resources read the estimates from plan.json itself (`whole_plan`),
which is not a tracked input of any stage.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import cast

from stagetrain.io import json_bytes
from stagetrain.planning.plan import PlanPart, PlanRecord, RunWide, StageEstimates, VocabPart

SHARED_KEYS = tuple(sorted(RunWide.__required_keys__))
"""The run-wide keys the training stages read (world, backend, device, model shape)."""


def vocab_padding(plan: PlanRecord) -> VocabPart:
    """plan/vocab.json: `tp`, the lcm of the stages' tp, which the padded vocabulary must divide by."""
    return {"tp": math.lcm(*(stage["layout"]["tp"] for stage in plan["stages"].values()))}


ESTIMATES = tuple(sorted(StageEstimates.__required_keys__))
"""The keys of a stage's entry that predict rather than decide (module docstring)."""


def stage_plan(plan: PlanRecord, stage: str) -> PlanPart:
    """plan/<stage>.json: plan.json with only the run-wide keys and `stages.<stage>`, less its
    ESTIMATES (the keys of `plan.RunWide` and of `plan.StageEstimates`; the entry keeps any
    other key as it is)."""
    entry = {k: v for k, v in plan["stages"][stage].items() if k not in ESTIMATES}
    shared = {key: plan[key] for key in SHARED_KEYS}  # type: ignore[literal-required]
    return cast(PlanPart, {**shared, "stages": {stage: entry}})


def whole_plan(part: str | Path) -> Path:
    """plan.json of the plan/<stage>.json `part` (results/<run>/plan/ beside it)."""
    return Path(part).resolve().parent.parent / "plan.json"


PlanFile = VocabPart | PlanPart
"""A part of the plan that one reader depends on (plan/<part>.json)."""


def part_of(plan: PlanRecord | str, part: str) -> PlanFile | str:
    """plan/<part>.json ('vocab' or a stage) of `plan`, or the planner's refusal."""
    if isinstance(plan, str):
        return plan
    return vocab_padding(plan) if part == "vocab" else stage_plan(plan, part)


def digest(content: PlanFile | str) -> str:
    """The sha256 of a plan file's bytes as they are written (or of the refusal)."""
    if isinstance(content, str):
        return "refused: " + hashlib.sha256(content.encode("utf-8")).hexdigest()
    return "sha256:" + hashlib.sha256(json_bytes(content)).hexdigest()
