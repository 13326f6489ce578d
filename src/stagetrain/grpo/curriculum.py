"""The difficulty curriculum: which level the prompts come from, moved by a rolling success rate.

GRPO learns nothing from a group whose completions all succeed or all fail
(zero advantage), so prompts should be hard enough to fail sometimes and easy
enough to succeed sometimes. The curriculum keeps the success rate of the last
`window` current-level prompts (a reward >= 1 is a success) and, once the model
has spent `min_steps` optimizer steps at a level and the window is full:

    promote (level + 1) when rate >= promote_at    and level < max_level
    demote  (level - 1) when rate <= demote_below  and level > 1

A change empties the window and the step count, so the next decision is made on
outcomes of the new level only. Demotion may go below start_level, down to 1: a
start that proves too hard is corrected rather than stuck. To keep earlier skills,
a share `earlier_share` of each step's prompts is drawn uniformly from levels
1 .. level - 1; their outcomes are not fed to `update`.

Everything here is deterministic given its inputs (the sampler takes the rng),
and the state round-trips through JSON because it is saved with checkpoints.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from stagetrain.errors import StageError

KEY = "grpo.curriculum"


@dataclass(frozen=True, kw_only=True, slots=True)
class CurriculumConfig:
    """The `grpo.curriculum` section, validated on construction."""

    start_level: int
    max_level: int
    window: int
    """Current-level prompts in the rolling success window."""
    promote_at: float
    """Success rate at or above which the level goes up."""
    demote_below: float
    """Success rate at or below which the level goes down."""
    min_steps: int
    """Optimizer steps at a level before it may change."""
    earlier_share: float
    """Share of prompts drawn from earlier levels."""

    def __post_init__(self) -> None:
        if self.start_level < 1:
            raise StageError(f"{KEY}.start_level: must be >= 1 (got {self.start_level})")
        if self.max_level < self.start_level:
            raise StageError(
                f"{KEY}.max_level: must be >= start_level {self.start_level} (got {self.max_level})"
            )
        for key in ("window", "min_steps"):
            if getattr(self, key) < 1:
                raise StageError(f"{KEY}.{key}: must be >= 1 (got {getattr(self, key)})")
        for key in ("promote_at", "demote_below", "earlier_share"):
            if not 0 <= getattr(self, key) <= 1:
                raise StageError(f"{KEY}.{key}: must be in [0, 1] (got {getattr(self, key)})")
        if self.demote_below >= self.promote_at:
            raise StageError(
                f"{KEY}.demote_below: must be < promote_at {self.promote_at} (got {self.demote_below})"
            )


@dataclass(kw_only=True, slots=True)
class CurriculumState:
    """Where the curriculum stands; mutated by `update`, saved with checkpoints."""

    level: int
    steps_at_level: int = 0
    recent: list[int] = field(default_factory=list)
    """0/1 outcomes of the latest current-level prompts, oldest first, at most `window`."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """Every promotion and demotion so far, as `update` returned them."""

    @classmethod
    def start(cls, cfg: CurriculumConfig) -> CurriculumState:
        """The state before the first step."""
        return cls(level=cfg.start_level)

    def to_json(self) -> dict[str, Any]:
        """The state as a checkpoint stores it."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CurriculumState:
        """The state `to_json` wrote."""
        return cls(
            level=int(data["level"]),
            steps_at_level=int(data["steps_at_level"]),
            recent=[int(x) for x in data["recent"]],
            events=[dict(e) for e in data["events"]],
        )


def update(
    state: CurriculumState, cfg: CurriculumConfig, step: int, outcomes: Sequence[float]
) -> dict[str, Any] | None:
    """Record one optimizer step's current-level rewards; promote or demote if due.

    Returns the event {"step", "kind": "promote" | "demote", "from", "to",
    "success_rate", "window"} (also appended to state.events), or None.
    """
    state.recent.extend(1 if r >= 1 else 0 for r in outcomes)
    del state.recent[: -cfg.window]
    state.steps_at_level += 1
    if state.steps_at_level < cfg.min_steps or len(state.recent) < cfg.window:
        return None
    rate = sum(state.recent) / len(state.recent)
    if rate >= cfg.promote_at and state.level < cfg.max_level:
        kind, to = "promote", state.level + 1
    elif rate <= cfg.demote_below and state.level > 1:
        kind, to = "demote", state.level - 1
    else:
        return None
    event = {
        "step": step,
        "kind": kind,
        "from": state.level,
        "to": to,
        "success_rate": rate,
        "window": len(state.recent),
    }
    state.level, state.steps_at_level, state.recent = to, 0, []
    state.events.append(event)
    return event


def levels_for(
    state: CurriculumState, cfg: CurriculumConfig, n: int, rng: random.Random
) -> list[int]:
    """The level of each of n prompts: uniform over 1 .. level - 1 with probability
    earlier_share, else the current level (always the current level at level 1)."""
    if state.level == 1:
        return [1] * n
    return [
        rng.randint(1, state.level - 1) if rng.random() < cfg.earlier_share else state.level
        for _ in range(n)
    ]
